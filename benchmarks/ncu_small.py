import cupy as cp, cukv, sys
from cukv.bench.decode import _build, _peer_fns, _torch
hq,hkv,d,ps=32,8,128,16
cache, pt, q, table = _build(1, 512, hq, hkv, d, ps)
out = cp.empty_like(q)
dec = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16").plan(1, 512)
fns = _peer_fns(_torch(), cache, table, q, out, 1, 512, hq, d, {})
for i in range(3):
    dec.run(q, cache, pt, out=out); fns["cudnn"](); fns["flash"]()
cp.cuda.Device().synchronize()
