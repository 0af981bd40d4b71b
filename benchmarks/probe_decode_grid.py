"""Paged decode at the bandwidth-bound cells (issue 55): does the grid (splits, ring depth) or the page order move
cukv against cuDNN? Times, in interleaved rounds with ``bench decode``'s timing (L2 flushed by a write and a discard
of its lines before each call, or by the old write alone with ``--write-flush``):

* ``plan``: ``BatchDecode``'s own choice (the bench's kernel);
* ``sN``: N splits forced, merged through global partials (``cluster_merge=False``);
* ``rK``: a K-slot ring;
* ``seq``: the plan's kernel over the same cache with the page table in physical order (pages of a sequence
  adjacent), so a sequence's K/V rows are one contiguous run as in cuDNN's copy;
* ``cudnn``: PyTorch SDPA's cuDNN backend on a contiguous copy (as ``bench decode``).

    PYTHONPATH=. python3 benchmarks/probe_decode_grid.py [--cells 16x32768,32x8192] [--splits 2,4,8] [--stages 2]
"""
import argparse

import cupy as cp
import numpy as np

import cukv
from cukv import tma
from cukv.bench.decode import _build, _peer_fns, _torch
from cukv.bench.timing import Timer, interleaved_medians

CELLS = "64x4096,16x32768,8x32768,32x8192,128x8192"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default=CELLS)
    ap.add_argument("--splits", default="x2,x4", help="forced split counts: N, or xN for N times plan's")
    ap.add_argument("--stages", default="2", help="ring depths to time beside plan's, comma-separated ('' for none)")
    ap.add_argument("--promotions", default="", help="TMA L2 promotions (bytes: 0, 64, 128, 256) to time beside 128 on "
                    "plan's ring and the --stages rings, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--write-flush", action="store_true", help="flush L2 by the 256 MB write alone (no discard)")
    ap.add_argument("--fold-heads", action="store_true",
                    help="one KV head per page: batch x 8 sequences of 4 query heads over 1 KV head (the same bytes and "
                         "(sequence, KV head) pairs; a block's rows then fill whole pages, contiguous with 'seq')")
    args = ap.parse_args()
    torch = _torch()
    d, ps = 128, 16
    timer = Timer(flush="write" if args.write_flush else "discard")
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "write flush" if args.write_flush else "write + discard flush",
          flush=True)
    for cell in args.cells.split(","):
        batch, ctx = map(int, cell.split("x"))
        hq, hkv = (4, 1) if args.fold_heads else (32, 8)
        batch *= 8 // hkv
        cache, pt, q, table = _build(batch, ctx, hq, hkv, d, ps)
        out = cp.empty_like(q)
        base = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16").plan(batch, ctx)
        base.run(q, cache, pt, out=out)
        want = out.copy()
        fns = {f"plan(s{base.num_splits})": lambda: base.run(q, cache, pt, out=out)}
        outs = {}
        for sp in filter(None, args.splits.split(",")):
            n = base.num_splits * int(sp[1:]) if sp.startswith("x") else int(sp)
            dec = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16", cluster_merge=False).plan(batch, ctx, num_splits=n)
            fns[f"s{dec.num_splits}"] = lambda dec=dec: dec.run(q, cache, pt, out=out)
        rings = {"": base}
        for st in filter(None, args.stages.split(",")):
            dec = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16", stages=int(st)).plan(batch, ctx)
            rings[f"r{st}"] = dec
            fns[f"r{st}(s{dec.num_splits})"] = lambda dec=dec: dec.run(q, cache, pt, out=out)
        for pr in filter(None, args.promotions.split(",")):
            code = {"0": tma.L2_PROMOTION_NONE, "64": tma.L2_PROMOTION_64B, "128": tma.L2_PROMOTION_128B,
                    "256": tma.L2_PROMOTION_256B}[pr]
            for rk, dec in rings.items():
                def with_promotion(dec=dec, code=code):
                    tma.L2_PROMOTION = code
                    try:
                        dec.run(q, cache, pt, out=out)
                    finally:
                        tma.L2_PROMOTION = tma.L2_PROMOTION_128B
                fns[f"{rk or 'plan'}p{pr}"] = with_promotion
        # the same cache through a table in physical order: every sequence's pages adjacent
        seq_table = np.arange(table.size, dtype=np.int32).reshape(table.shape)
        pt_seq = cukv.PageTable(cp.asarray(seq_table), pt.lengths, ps)
        fns["seq"] = lambda: base.run(q, cache, pt_seq, out=out)
        if torch is not None:
            fns.update(_peer_fns(torch, cache, table, q, out, batch, ctx, hq, d, {}))
        for k, f in fns.items():  # every variant of the random table answers as plan's did
            if k not in ("seq", "cudnn", "flash"):
                f()
                outs[k] = bool((out == want).all())
        times = interleaved_medians(timer, fns, reps=args.reps, rounds=args.rounds)
        nbytes = batch * ctx * hkv * d * 2 * 2
        ref = times.get("cudnn")
        cols = []
        for k, v in times.items():
            extra = f" cudnn/x {ref / v:.3f}" if ref and k != "cudnn" else ""
            eq = "" if outs.get(k, True) else " (output differs)"
            cols.append(f"{k} {v * 1e3:.1f} us {nbytes / v / 1e9:.3f} TB/s{extra}{eq}")
        print(f"{batch} x {ctx}: " + " | ".join(cols), flush=True)
        del cache, pt, pt_seq, q, out, fns, base
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
