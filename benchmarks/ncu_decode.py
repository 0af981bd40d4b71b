"""Decode launches at one cell for Nsight Compute: cukv on bf16 and FP8 caches and, with ``--peers``, the SDPA
peers (cuDNN, flash) on the same K/V. Two warm-up rounds, then the round to profile, e.g.

    ncu -k regex:cukv_decode --launch-skip 2 --section WarpStateStats python3 benchmarks/ncu_decode.py 64x4096
    ncu --section SpeedOfLight python3 benchmarks/ncu_decode.py 1x512 --peers
"""
import argparse

import cupy as cp

import cukv
from cukv.bench.decode import _build, _fp8_cache, _peer_fns, _torch

ap = argparse.ArgumentParser()
ap.add_argument("cell", nargs="?", default="64x4096")
ap.add_argument("--peers", action="store_true")
args = ap.parse_args()
batch, ctx = map(int, args.cell.split("x"))
hq, hkv, d, ps = 32, 8, 128, 16
cache, pt, q, table = _build(batch, ctx, hq, hkv, d, ps)
fcache = _fp8_cache(batch, ctx, hkv, d, ps, "token")
out = cp.empty_like(q)
dec = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16").plan(batch, ctx)
fdec = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16", kv_dtype="fp8_e4m3", scale_granularity="token").plan(batch, ctx)
fns = [lambda: dec.run(q, cache, pt, out=out), lambda: fdec.run(q, fcache, pt, out=out)]
if args.peers and _torch() is not None:
    dec.run(q, cache, pt, out=out)
    fns += list(_peer_fns(_torch(), cache, table, q, out, batch, ctx, hq, d, {}).values())
for _ in range(3):  # rounds 1-2 warm up, round 3 is the one to profile
    for fn in fns:
        fn()
cp.cuda.Device().synchronize()
