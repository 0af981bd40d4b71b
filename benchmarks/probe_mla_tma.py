"""A/B probe for the tensor copies of the absorbed MLA decode kernels: each ``bench mla-decode`` shape (the policy's
config) timed with the cache descriptor's L2 promotion varied and with L2 eviction hints compiled in, in interleaved
rounds in one process; prints per shape each variant's time and its ratio to the first (above 1: the variant is
faster), and the geomean per variant. Compare within one call only.

    PYTHONPATH=. python3 benchmarks/probe_mla_tma.py [--dense h128] \
        [--variants 128B,256B,64B,none,128B:CUKV_TMA_EVICT_FIRST]

A variant is ``promotion[:DEFINE]``; promotion is one of 128B (the default), 256B, 64B, none.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

import numpy as np

PROMOTION = {"none": 0, "64B": 1, "128B": 2, "256B": 3}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dense", default="h128")
    ap.add_argument("--variants", default="128B,256B,128B:CUKV_TMA_EVICT_FIRST,256B:CUKV_TMA_EVICT_FIRST")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    import cupy as cp

    from cukv import tma
    from cukv.bench import mla_decode as bd
    from cukv.bench.timing import Timer, interleaved_medians
    from cukv.ops.mla_decode import BatchMLADecode

    variants = [tuple((v + ":").split(":")[:2]) for v in args.variants.split(",")]  # (promotion, define)
    timer = Timer()
    ratios = {v: [] for v in args.variants.split(",")}
    for name, batch, heads, s_q, ctx in bd.SHAPES:
        if not any(w in name for w in args.dense.split(",")):
            continue
        lens = bd._lengths(batch, ctx)
        cache, table, q = bd._problem(batch, heads, s_q, lens)
        fns, outs = {}, {}
        for label, (promo, define) in zip(ratios, variants):
            dec = BatchMLADecode(heads).plan(lens, s_q)
            cfg = dataclasses.replace(dec.config)
            os.environ["CUKV_DEFINES"] = define
            try:
                cfg.compiled
            finally:
                os.environ["CUKV_DEFINES"] = ""
            dec.config = cfg
            dec.plan(lens, s_q)
            outs[label] = cp.empty((batch, s_q, heads, 512), cp.uint16)

            def fn(d=dec, o=outs[label], p=PROMOTION[promo]):
                tma.L2_PROMOTION = p
                d.run(q, cache, table, out=o)

            fns[label] = fn
            fn()
        med = interleaved_medians(timer, fns, reps=args.reps, rounds=args.rounds)
        tma.L2_PROMOTION = tma.L2_PROMOTION_128B
        first = next(iter(fns))
        ref = outs[first]
        line = f"{name:<30} ({dec.config.name[-24:]})"
        for k in fns:
            r = med[first] / med[k]
            ratios[k].append(r)
            same = bool(cp.array_equal(outs[k], ref))
            line += f" | {k} {med[k] * 1e3:7.1f} us x{r:.3f}{'' if same else ' DIFF'}"
        print(line, flush=True)
        cache = table = q = fns = outs = None
        cp.get_default_memory_pool().free_all_blocks()
    print("geomean speedup over", next(iter(ratios)), ":",
          ", ".join(f"{k} {np.exp(np.mean(np.log(v))):.3f}" for k, v in ratios.items() if v))


if __name__ == "__main__":
    main()
