// FP8 e4m3 conversions (sm_89+ cvt instructions): quantize pairs of floats, dequantize 8 codes to T.
//
// Quantized caches read back as e4m3(code) * scale (design.md section 2). cvt.rn.f16x2.e4m3x2 is exact (every
// e4m3 value is an fp16 value), so the only rounding of a dequantized value is the final one to T.
#pragma once
#include "common.cuh"

namespace cukv {

typedef unsigned short u16;

// Round-to-nearest-even, saturating to +-448 (NaN stays NaN): the quantizer of cukv/fp8.py.
__device__ __forceinline__ u16 e4m3x2_from_floats(float lo, float hi) {
  u16 r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));  // the first source goes high
  return r;
}

__device__ __forceinline__ u32 f16x2_from_e4m3x2(u16 x) {
  u32 r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(x));
  return r;
}

// Two codes (low byte first) -> two floats.
__device__ __forceinline__ float2 floats_from_e4m3x2(u16 x) {
  const u32 h = f16x2_from_e4m3x2(x);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// Four codes of a word, scaled, packed as two pairs of T.
template <typename T>
__device__ __forceinline__ void dequant4(u32 w, float scale, u32& lo, u32& hi) {
  const float2 a = floats_from_e4m3x2((u16)(w & 0xffffu));
  const float2 b = floats_from_e4m3x2((u16)(w >> 16));
  lo = ElemTraits<T>::pack(a.x * scale, a.y * scale);
  hi = ElemTraits<T>::pack(b.x * scale, b.y * scale);
}

// Eight codes (8 bytes, dims in order) -> eight T values (16 bytes, same order).
template <typename T>
__device__ __forceinline__ uint4 dequant8(uint2 raw, float scale) {
  uint4 r;
  dequant4<T>(raw.x, scale, r.x, r.y);
  dequant4<T>(raw.y, scale, r.z, r.w);
  return r;
}

__device__ __forceinline__ uint2 ldg_stream8(const void* p) {
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

}  // namespace cukv
