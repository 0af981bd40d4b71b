"""FP8 prefill tile shapes beside the bf16 default on the bench shapes, in interleaved rounds (medians).

    PYTHONPATH=. python3 benchmarks/probe_prefill_fp8.py --shapes 4x4096x32x8x128 --configs 192:64:4:0,192:64:6:1

A candidate is BM:BN:stages[:fp8_scores[:tma[:pingpong]]] (1 or 0, default 0: K dequantized by the producer;
codes by cp.async; S issued in any order). The default FP8 config is timed beside its cp.async twin when it uses TMA (--cp-async-twin 0: not).
"""
import argparse
import dataclasses

import cupy as cp

import cukv
from cukv.bench.decode import interleaved_medians
from cukv.bench.prefill import DTYPE, PAGE_SIZE, _build, fp8_cache_like
from cukv.bench.timing import Timer
from cukv.configs.prefill import PrefillConfig
from cukv.policy.prefill import default_config


def variant_configs(base, variants):
    """Named variants of the FP8 default (see --variants)."""
    out = []
    for v in (v for v in variants.split(",") if v):
        for stages in range(base.stages, 1, -1):  # the dequantized K element needs more shared memory
            try:
                out.append(dataclasses.replace(base, fp8_scores=False, pingpong=(v == "dqpp"), stages=stages))
                break
            except ValueError as e:
                print(f"skipping {v} stages {stages}: {e}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4x4096x32x8x128", help="batch x L x hq x hkv x d, comma-separated")
    ap.add_argument("--configs", default="", help="BM:BN:stages[:fp8_scores[:tma[:pingpong]]] per FP8 candidate (empty: the default only)")
    ap.add_argument("--variants", default="", help="dq, dqpp: the FP8 default with K dequantized by the producer "
                    "(fp8_scores=False), without or with pingpong")
    ap.add_argument("--gran", default="token")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cp-async-twin", type=int, default=1, help="1: also time the default with tma=False")
    args = ap.parse_args()
    timer = Timer()
    for shape in args.shapes.split(","):
        batch, seq_len, hq, hkv, d = map(int, shape.split("x"))
        q, k, v, cache, pt, offsets, lengths = _build(batch, seq_len, hq, hkv, d)
        sb = d if args.gran == "token" else (0 if args.gran == "tensor" else int(args.gran))
        gran = args.gran if args.gran in ("token", "tensor") else sb
        fcache = fp8_cache_like((q, k, v, cache, pt, offsets, lengths), gran)
        out = cp.empty_like(q)
        bf = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE).plan(offsets, lengths, mask="causal")
        fns = {"bf16 " + bf.config.name: lambda: bf.run(q, (cache, pt), out=out)}
        base = default_config(DTYPE, d, PAGE_SIZE, "fp8_e4m3", sb)
        cfgs = [base] + ([dataclasses.replace(base, tma=False)] if base.tma and args.cp_async_twin else [])
        cfgs += variant_configs(base, args.variants)
        for f in (c.split(":") for c in args.configs.split(",") if c):
            try:
                cfgs.append(PrefillConfig(DTYPE, d, PAGE_SIZE, int(f[0]), int(f[1]), base.BK, int(f[2]),
                                          kv_dtype="fp8_e4m3", scale_block=sb, fp8_scores=len(f) > 3 and f[3] == "1",
                                          tma=len(f) > 4 and f[4] == "1", pingpong=len(f) > 5 and f[5] == "1"))
            except ValueError as e:
                print(f"{shape}: skipping {':'.join(f)}: {e}")
        for cfg in cfgs:
            pf = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE, kv_dtype="fp8_e4m3",
                                   scale_granularity=fcache.scale_granularity, config=cfg)
            pf.plan(offsets, lengths, mask="causal")
            fns["fp8 " + cfg.name] = (lambda pf=pf: pf.run(q, (fcache, pt), out=out))
        got = interleaved_medians(timer, fns, reps=5 * args.rounds, rounds=args.rounds)
        t0 = next(iter(got.values()))
        print(shape, " | ".join(f"{n} {t:.3f} ms bf16/x {t0 / t:.2f}" for n, t in got.items()), flush=True)
        fns.clear()
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
