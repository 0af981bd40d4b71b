"""Prefill launches at one shape for Nsight Compute: cukv paged on the bf16 cache and on the same tokens quantized
into an FP8 cache (per-token scales), two warm-up rounds, then the round to profile, e.g.

    ncu -k regex:cukv_prefill --launch-skip 4 --launch-count 2 --section WarpStateStats \
        python3 benchmarks/ncu_prefill.py 2x4096x128
"""
import argparse

import cupy as cp

import cukv
from cukv.bench.prefill import DTYPE, PAGE_SIZE, _build, fp8_cache_like

from probe_lib import once_variant

ap = argparse.ArgumentParser()
ap.add_argument("shape", nargs="?", default="2x4096x128", help="batch x seq_len x head_dim")
ap.add_argument("--heads", default="32/8")
ap.add_argument("--gran", default="token")
ap.add_argument("--strategy", default="auto", help="fp8_prefill of the FP8 plan")
args = ap.parse_args()
batch, seq_len, d = map(int, args.shape.split("x"))
hq, hkv = map(int, args.heads.split("/"))
q, k, v, cache, pt, offsets, lengths = _build(batch, seq_len, hq, hkv, d)
fcache = fp8_cache_like((q, k, v, cache, pt, offsets, lengths), args.gran)
out = cp.empty_like(q)
bf = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE).plan(offsets, lengths, mask="causal")
fp8_prefill, once_persistent, max_blocks = once_variant(args.strategy)  # "convert_once:np" / ":gN"
f8 = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE, kv_dtype="fp8_e4m3", scale_granularity=args.gran,
                       fp8_prefill=fp8_prefill, once_persistent=once_persistent,
                       max_blocks=max_blocks).plan(offsets, lengths, mask="causal")
print("configs:", bf.config.name, f8.config.name, flush=True)
for _ in range(3):  # rounds 1-2 warm up, round 3 is the one to profile
    bf.run(q, (cache, pt), out=out)
    f8.run(q, (fcache, pt), out=out)
cp.cuda.Device().synchronize()
