// MLA cache append: one 576-wide row per new token (512 latent kv_c + 64 rope k_pe) into its slot.
//
// 16-bit caches take the row as it is (T in, T stored). FP8 rows (656 bytes, FlashMLA's / vLLM's fp8_ds_mla)
// hold 512 e4m3 codes, 4 float32 scales (one per 128 latent values) and the 64 rope values as bf16:
//   scale = max(amax, 448 * floor) / 448        (float32; POW2: rounded up to a power of two)
//   code  = e4m3_rn_satfinite(x / scale)        (IEEE float32 division)
// exactly cukv.reference.mla_quantize_fp8. A slot outside [0, num_pages * page_size) is skipped.
#pragma once
#include "common.cuh"
#include "fp8.cuh"

namespace cukv {

constexpr int kMlaNope = 512, kMlaRope = 64, kMlaDim = 576, kMlaFp8RowBytes = 656;

struct MLAAppendArgs {
  const void* kv_c;        // [T, 512] of T (row stride kv_c_stride elements)
  const void* k_pe;        // [T, 64] of T (row stride k_pe_stride elements)
  const long long* slots;  // [T] int64: physical_page * page_size + offset; -1 / out of range: skip
  char* cache;             // the cache's first byte
  i64 kv_c_stride, k_pe_stride;
  i64 page_stride, row_stride;  // bytes
  int num_tokens, num_pages, page_size, pad;
};

// The row of slot s, or null when the slot is outside the cache.
__device__ __forceinline__ char* mla_slot_row(const MLAAppendArgs& a, long long s) {
  if (s < 0 || s >= (long long)a.num_pages * a.page_size) return nullptr;
  const long long page = s / a.page_size, off = s % a.page_size;
  return a.cache + page * a.page_stride + off * a.row_stride;
}

template <typename T>
__device__ void mla_append_16bit(const MLAAppendArgs& a) {
  for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
    T* row = reinterpret_cast<T*>(mla_slot_row(a, a.slots[t]));
    if (row == nullptr) continue;
    const T* c = reinterpret_cast<const T*>(a.kv_c) + (i64)t * a.kv_c_stride;
    const T* p = reinterpret_cast<const T*>(a.k_pe) + (i64)t * a.k_pe_stride;
    for (int i = threadIdx.x; i < kMlaDim; i += blockDim.x) row[i] = i < kMlaNope ? c[i] : p[i - kMlaNope];
  }
}

// 128 threads per token: thread t quantizes latent values 4t .. 4t + 3; warp w owns scale block w.
template <typename T, bool POW2>
__device__ void mla_append_fp8(const MLAAppendArgs& a) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
    char* row = mla_slot_row(a, a.slots[t]);
    if (row == nullptr) continue;
    const T* c = reinterpret_cast<const T*>(a.kv_c) + (i64)t * a.kv_c_stride;
    float x[4];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[i] = ElemTraits<T>::to_float(c[4 * tid + i]);
      amax = fmaxf(amax, fabsf(x[i]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float scale = __fdiv_rn(fmaxf(amax, 448.f * 0x1p-32f), 448.f);
    if (POW2) scale = __uint_as_float((__float_as_uint(scale) + 0x7fffffu) & 0xff800000u);  // up to 2^k
    const u32 lo = e4m3x2_from_floats(__fdiv_rn(x[0], scale), __fdiv_rn(x[1], scale));
    const u32 hi = e4m3x2_from_floats(__fdiv_rn(x[2], scale), __fdiv_rn(x[3], scale));
    *reinterpret_cast<u32*>(row + 4 * tid) = lo | (hi << 16);
    if (lane == 0) *reinterpret_cast<float*>(row + kMlaNope + 4 * warp) = scale;
    if (tid < kMlaRope) {
      const T* p = reinterpret_cast<const T*>(a.k_pe) + (i64)t * a.k_pe_stride;
      const __nv_bfloat16 r = __float2bfloat16_rn(ElemTraits<T>::to_float(p[tid]));
      *reinterpret_cast<__nv_bfloat16*>(row + kMlaNope + 16 + 2 * tid) = r;
    }
  }
}

}  // namespace cukv
