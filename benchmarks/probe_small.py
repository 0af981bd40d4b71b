"""Small decode steps: where does the time go? Times cukv variants (staging, warps, splits) and the SDPA peers
at the latency-bound cells in interleaved rounds (`bench decode`'s timing), beside the harness floor. A
variant is stages:warps:splits, with splits `a` for plan's choice (2..8 forced splits merge in a cluster), and
an `f` in front for an FP8 cache (per-token scales, as `bench decode --kv-dtype fp8_e4m3`).

    PYTHONPATH=. python3 benchmarks/probe_small.py [--cells 1x512,1x2048,8x512] [--variants 0:4:a,2:4:a,f0:4:a]
"""
import argparse

import cupy as cp

import cukv
from cukv.bench.decode import _build, _fp8_cache, _peer_fns, _torch, interleaved_medians
from cukv.bench.timing import Timer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="1x512,1x2048,8x512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="0:4:a,0:4:1,0:4:2,0:4:8,0:2:a,0:8:a,3:4:a")
    args = ap.parse_args()
    torch = _torch()
    hq, hkv, d, ps = 32, 8, 128, 16
    timer = Timer()
    tiny = cp.empty(4096, cp.uint16)
    for cell in args.cells.split(","):
        batch, ctx = map(int, cell.split("x"))
        cache, pt, q, table = _build(batch, ctx, hq, hkv, d, ps)
        out = cp.empty_like(q)
        fns = {"floor": lambda: tiny.fill(0)}
        fcache = None
        for v in args.variants.split(","):
            fp8 = v.startswith("f")
            st, nw, sp = v.lstrip("f").split(":")
            if fp8 and fcache is None:
                fcache = _fp8_cache(batch, ctx, hkv, d, ps, "token")
            kv = dict(kv_dtype="fp8_e4m3", scale_granularity="token") if fp8 else {}
            dec = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16", num_warps=int(nw), stages=int(st), **kv).plan(
                batch, ctx, num_splits=None if sp == "a" else int(sp))
            c = fcache if fp8 else cache
            fns[f"{'f' if fp8 else ''}r{st}w{nw}s{dec.num_splits}"] = (lambda dec=dec, c=c: dec.run(q, c, pt, out=out))
        if torch is not None:
            fns.update(_peer_fns(torch, cache, table, q, out, batch, ctx, hq, d, {}))
        times = interleaved_medians(timer, fns, reps=15 * args.rounds, rounds=args.rounds)
        print(f"{batch} x {ctx} " + "  ".join(f"{k} {v * 1e3:.1f}" for k, v in times.items()), flush=True)
        del cache, fcache, pt, q, out, fns
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
