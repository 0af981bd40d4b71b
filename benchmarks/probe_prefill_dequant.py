"""Dequantize-then-attend against the fused FP8 prefill: a one-pass kernel turns the FP8 cache's codes into a bf16
cache of the same pages (code * scale in float32, rounded to bf16), then the bf16 prefill runs on it. Times the
fused FP8 kernel, the pass alone, and pass + bf16 prefill beside bf16 prefill on the original cache, in interleaved
rounds (the bench's timer, L2 flushed before every call).

    PYTHONPATH=. python3 benchmarks/probe_prefill_dequant.py --gran token
"""
import argparse

import cupy as cp

import cukv
from cukv.bench.prefill import DTYPE, PAGE_SIZE, _maxdiff
from cukv.bench.timing import Timer

from probe_lib import probe_cases, probe_report

# over the combined storage [pages, 2, page_size, H, D], 8 codes per thread; token scales [pages, 2, page_size, H, 1]
# are one per row in the same order, tensor scales one for K (index 0) and one for V
_SRC = r"""
#include <cuda_bf16.h>
extern "C" __global__ void dq(const uint2* codes, const float* scales, uint4* out, long long n8, int row8, int per_row,
                              int half_rows) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= n8) return;
  const long long row = i / row8;
  const float s = per_row ? scales[row] : scales[(row / half_rows) % 2];
  const uint2 c = codes[i];
  unsigned r[4];
  #pragma unroll
  for (int h = 0; h < 4; ++h) {
    const unsigned w = h < 2 ? c.x : c.y, sh = 16 * (h % 2);
    __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)((w >> sh) & 0xffff), __NV_E4M3);
    const float2 f = __half22float2(*reinterpret_cast<__half2*>(&hr));
    __nv_bfloat162 b = __floats2bfloat162_rn(f.x * s, f.y * s);
    r[h] = *reinterpret_cast<unsigned*>(&b);
  }
  out[i] = make_uint4(r[0], r[1], r[2], r[3]);
}
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4x4096x32x8x128,1x16384x32x8x128,8x2048x32x32x128,4x4096x16x16x256,"
                                        "8x2048x32x8x64")
    ap.add_argument("--gran", default="token", choices=("token", "tensor"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    kern = cp.RawKernel("#include <cuda_fp8.h>\n" + _SRC, "dq", options=("-std=c++17",))
    timer = Timer()
    for shape, (batch, seq_len, hq, hkv, d), data, fcache, _ in probe_cases(args.shapes, args.gran):
        q, k, v, cache, pt, offsets, lengths = data
        dcache = cukv.PagedKVCache(cache.num_pages, cache.page_size, hkv, d, dtype=DTYPE)
        n8 = fcache.storage.size // 8
        per_row = int(args.gran == "token")
        assert fcache.storage.flags.c_contiguous and fcache.scale_storage.flags.c_contiguous and dcache.layout == "combined"

        def dequant():
            kern(((n8 + 255) // 256,), (256,), (fcache.storage, fcache.scale_storage, dcache.storage, cp.int64(n8),
                                               cp.int32(d // 8), cp.int32(per_row), cp.int32(PAGE_SIZE * hkv)))

        out_b, out_f, out_d = (cp.empty_like(q) for _ in range(3))
        bf = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE).plan(offsets, lengths, mask="causal")
        ff = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE, kv_dtype="fp8_e4m3",
                               scale_granularity=args.gran).plan(offsets, lengths, mask="causal")
        fns = {
            "bf16": lambda: bf.run(q, (cache, pt), out=out_b),
            "fp8 fused": lambda: ff.run(q, (fcache, pt), out=out_f),
            "dequant pass": dequant,
            "dequant + bf16": lambda: (dequant(), bf.run(q, (dcache, pt), out=out_d)),
        }
        for fn in fns.values():
            fn()
        cp.cuda.Device().synchronize()
        probe_report(shape, timer, fns, args.rounds, {"fused-vs-dequant": _maxdiff(out_f, out_d)},
                     reps=5 * args.rounds)
        fns.clear()


if __name__ == "__main__":
    main()
