"""FP8 decode staging probe: the register kernel and ring depths beside bf16, in interleaved rounds (medians).

    PYTHONPATH=. python3 benchmarks/probe_fp8.py [--cells 64x4096,16x32768] [--variants 0,2,3,4] [--gran token]
"""
import argparse

import cupy as cp

import cukv
from cukv.bench.decode import _build, _fp8_cache, fp8_bytes, interleaved_medians
from cukv.bench.timing import Timer, read_ceiling_tbs
from cukv.fp8 import scale_block


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="64x4096,16x32768")
    ap.add_argument("--variants", default="0,2,3,4",
                    help="ring stages (0: registers), optionally stages:warps or stages:warps:splits")
    ap.add_argument("--gran", default="token")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    gran = args.gran if args.gran in ("token", "tensor") else int(args.gran)
    timer = Timer()
    ceiling = read_ceiling_tbs(timer)
    hq, hkv, d, ps = 32, 8, 128, 16
    for cell in args.cells.split(","):
        batch, ctx = map(int, cell.split("x"))
        cache, pt, q, _ = _build(batch, ctx, hq, hkv, d, ps)
        fcache = _fp8_cache(batch, ctx, hkv, d, ps, gran)
        out = cp.empty_like(q)
        bf = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16").plan(batch, ctx)
        fns = {"bf16": lambda: bf.run(q, cache, pt, out=out)}
        for v in args.variants.split(","):
            st, nw, sp = (list(map(int, v.split(":"))) + [4, 0])[:3]
            dec = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16", num_warps=nw, kv_dtype="fp8_e4m3",
                                   scale_granularity=gran, stages=st).plan(batch, ctx, num_splits=sp or None)
            fns[f"fp8_r{st}w{nw}s{dec.num_splits}"] = (lambda dec=dec: dec.run(q, fcache, pt, out=out))
        got = interleaved_medians(timer, fns, reps=10 * args.rounds, rounds=args.rounds)
        fb = fp8_bytes(batch, ctx, hkv, d, scale_block(gran, d))
        base = got["bf16"]
        print(f"{cell} ({gran}): " + "  ".join(
            f"{k} {v * 1e3:.1f} us" + ("" if k == "bf16" else f" x{base / v:.2f} {100 * fb / v / 1e9 / ceiling:.0f}%")
            for k, v in got.items()), flush=True)
        del cache, fcache, pt, q, out, fns, bf
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
