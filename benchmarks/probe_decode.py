"""Repeatability probe for decode: a few cells, several (stages, splits) variants, timed in interleaved rounds
so that clock or placement drift shows up as round-to-round spread instead of as a variant's advantage.

    PYTHONPATH=. python3 benchmarks/probe_decode.py [--rounds 3] [--cells 64x4096,32x8192]
"""
import argparse

import cupy as cp
import numpy as np

import cukv
from cukv.bench.decode import _build
from cukv.bench.timing import Timer

VARIANTS = [(3, 1), (3, 2), (3, 4), (2, 1), (2, 2), (4, 1), (0, 1), (0, 2)]  # (stages, num_splits)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cells", default="64x4096,32x8192,128x2048,16x32768")
    args = ap.parse_args()
    timer = Timer()
    hq, hkv, d, ps = 32, 8, 128, 16
    for cell in args.cells.split(","):
        batch, ctx = map(int, cell.split("x"))
        cache, pt, q, _ = _build(batch, ctx, hq, hkv, d, ps)
        out = cp.empty_like(q)
        nbytes = 2 * batch * ctx * hkv * d * 2
        decs = {}
        for st, sp in VARIANTS:
            try:
                decs[(st, sp)] = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16", stages=st).plan(batch, ctx, num_splits=sp)
            except ValueError:
                pass
        auto = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16").plan(batch, ctx)
        decs["auto"] = auto
        res = {k: [] for k in decs}
        for _ in range(args.rounds):
            for k, dec in decs.items():
                res[k].append(timer.median_ms(lambda: dec.run(q, cache, pt, out=out), reps=15, warmup_ms=20))
        print(f"{batch} x {ctx}: auto = stages {auto.config.stages} splits {auto.num_splits}")
        for k, v in res.items():
            best = min(v)
            print(f"   {str(k):>8}: " + " ".join(f"{x * 1e3:7.1f}" for x in v) + f" us   best {nbytes / best / 1e9:.2f} TB/s")
        del cache, pt, q, out, decs, auto
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
