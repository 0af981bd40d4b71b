"""16-bit prefill (paged, then contiguous) with K/V by tensor copies (``PrefillConfig.tma``) beside the cp.async
producer, and the FP8 default, on the bench shapes in interleaved rounds (medians; ratios against the first, paged
cp.async). Also checks that all four 16-bit runs give bitwise the same output (same ring contents, same math).

    PYTHONPATH=. python3 benchmarks/probe_prefill_tma.py --shapes 4x4096x32x8x128
"""
import argparse
import dataclasses

import cupy as cp

import cukv
from cukv.bench.decode import interleaved_medians
from cukv.bench.prefill import DTYPE, PAGE_SIZE, _build, fp8_cache_like
from cukv.bench.timing import Timer
from cukv.policy.prefill import default_config

SHAPES = "4x4096x32x8x128,1x16384x32x8x128,8x2048x32x32x128,4x4096x16x16x256,8x2048x32x8x64"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES, help="batch x L x hq x hkv x d, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gran", default="token", help="FP8 scales of the FP8 default ('' : no FP8 column)")
    args = ap.parse_args()
    timer = Timer()
    for shape in args.shapes.split(","):
        batch, seq_len, hq, hkv, d = map(int, shape.split("x"))
        data = _build(batch, seq_len, hq, hkv, d)
        q, k, v, cache, pt, offsets, lengths = data
        fns, outs = {}, {}
        contig = (k, v, cp.asarray(offsets))
        for page, kv in ((PAGE_SIZE, (cache, pt)), (0, contig)):
            base = default_config(DTYPE, d, page)
            for cfg in (dataclasses.replace(base, tma=False), dataclasses.replace(base, tma=True)):
                pf = cukv.BatchPrefill(hq, hkv, d, page_size=page or None, dtype=DTYPE, config=cfg)
                pf.plan(offsets, lengths, mask="causal")
                out = outs[cfg.name] = cp.full_like(q, 0x7FC0)  # NaN bits: every row must be written
                fns[cfg.name] = (lambda pf=pf, out=out, kv=kv: pf.run(q, kv, out=out))
                fns[cfg.name]()
        a, b, c, e = outs.values()
        same = bool(cp.array_equal(a, b)) and bool(cp.array_equal(c, e)) and bool(cp.array_equal(a, c))
        if args.gran:
            sb = d if args.gran == "token" else 0
            fcache = fp8_cache_like(data, args.gran)
            pf8 = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE, kv_dtype="fp8_e4m3",
                                    scale_granularity=fcache.scale_granularity)
            pf8.plan(offsets, lengths, mask="causal")
            o8 = cp.empty_like(q)
            fns["fp8 " + pf8.config.name] = lambda: pf8.run(q, (fcache, pt), out=o8)
        got = interleaved_medians(timer, fns, reps=5 * args.rounds, rounds=args.rounds)
        t0 = next(iter(got.values()))
        print(shape, f"tma==cp.async (paged, contig) bitwise: {same} |",
              " | ".join(f"{n} {t:.3f} ms x{t0 / t:.3f}" for n, t in got.items()), flush=True)
        fns.clear()
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
