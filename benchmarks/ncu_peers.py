"""One shape's prefill kernels beside the peers' for Nsight Compute: cukv on the bf16 cache, cukv on the same tokens
in an FP8 cache ('auto'), and PyTorch SDPA's cuDNN and flash kernels, two warm rounds, then one round between
cudaProfilerStart/Stop, e.g. (benchmarks/ncu_peers.sh wraps it)

    ncu --profile-from-start off --section LaunchStats python3 benchmarks/ncu_peers.py 4x4096x16x16x256
"""
import argparse

import cupy as cp

import cukv
from cukv.bench.prefill import DTYPE, PAGE_SIZE, _build, fp8_cache_like

ap = argparse.ArgumentParser()
ap.add_argument("shape", nargs="?", default="4x4096x16x16x256", help="batch x seq_len x hq x hkv x head_dim")
ap.add_argument("--gran", default="token")
args = ap.parse_args()
batch, seq_len, hq, hkv, d = map(int, args.shape.split("x"))
data = _build(batch, seq_len, hq, hkv, d)
q, k, v, cache, pt, offsets, lengths = data
fcache = fp8_cache_like(data, args.gran)
out = cp.empty_like(q)
bf = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE).plan(offsets, lengths, mask="causal")
f8 = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE, kv_dtype="fp8_e4m3",
                       scale_granularity=args.gran).plan(offsets, lengths, mask="causal")
print("cukv configs:", bf.config.name, "|", f8.kernel_config.name, f"({f8.strategy})", flush=True)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402


def bhld(x, h):
    return torch.from_dlpack(x).view(torch.bfloat16).reshape(batch, seq_len, h, d).transpose(1, 2).contiguous()


tq, tk, tv = bhld(q, hq), bhld(k, hkv), bhld(v, hkv)
kw = {"is_causal": True, **({"enable_gqa": True} if hq != hkv else {})}
peers = {}
for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
    def call(be=be):
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(tq, tk, tv, **kw)
    peers[name] = call

for r in range(3):  # rounds 0-1 warm up; round 2 is profiled
    if r == 2:
        torch.cuda.synchronize()
        cp.cuda.runtime.profilerStart()
    bf.run(q, (cache, pt), out=out)
    f8.run(q, (fcache, pt), out=out)
    for call in peers.values():
        call()
    torch.cuda.synchronize()
    cp.cuda.Device().synchronize()
cp.cuda.runtime.profilerStop()
print("done", flush=True)
