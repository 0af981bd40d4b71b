"""One decode launch per kernel for Nsight Compute (bf16 and FP8 at one cell), e.g.

    ncu -k regex:cukv_decode --launch-skip 2 --section WarpStateStats python3 benchmarks/ncu_decode.py 64x4096
"""
import sys

import cupy as cp

import cukv
from cukv.bench.decode import _build, _fp8_cache

batch, ctx = map(int, (sys.argv[1] if len(sys.argv) > 1 else "64x4096").split("x"))
hq, hkv, d, ps = 32, 8, 128, 16
cache, pt, q, _ = _build(batch, ctx, hq, hkv, d, ps)
fcache = _fp8_cache(batch, ctx, hkv, d, ps, "token")
out = cp.empty_like(q)
dec = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16").plan(batch, ctx)
fdec = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16", kv_dtype="fp8_e4m3", scale_granularity="token").plan(batch, ctx)
for _ in range(2):  # launches 1-2 warm up, 3-4 are the ones to profile
    dec.run(q, cache, pt, out=out)
    fdec.run(q, fcache, pt, out=out)
cp.cuda.Device().synchronize()
