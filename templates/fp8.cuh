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

// Sixteen codes (16 bytes, dims in order) -> their exact values as sixteen f16 (two 16-byte chunks): one cvt a
// pair. Prefill's V with a per-tensor scale: the scale multiplies the output instead (prefill.cuh).
__device__ __forceinline__ void codes16_f16(uint4 raw, uint4& lo, uint4& hi) {
  lo = make_uint4(f16x2_from_e4m3x2((u16)(raw.x & 0xffffu)), f16x2_from_e4m3x2((u16)(raw.x >> 16)),
                  f16x2_from_e4m3x2((u16)(raw.y & 0xffffu)), f16x2_from_e4m3x2((u16)(raw.y >> 16)));
  hi = make_uint4(f16x2_from_e4m3x2((u16)(raw.z & 0xffffu)), f16x2_from_e4m3x2((u16)(raw.z >> 16)),
                  f16x2_from_e4m3x2((u16)(raw.w & 0xffffu)), f16x2_from_e4m3x2((u16)(raw.w >> 16)));
}

// Two codes as an mma operand pair holding their exact values: f16 (cvt), or bf16 scaled by 2^-112 (the
// f16 bits moved into bf16 position: every e4m3 value is a normal f16 whose low 7 mantissa bits are zero,
// so dropping 3 bits is exact and the exponent bias moves from 15 to 127; zero stays zero).
template <typename T> __device__ __forceinline__ u32 codes_to_mma(u16 x);
template <> __device__ __forceinline__ u32 codes_to_mma<__half>(u16 x) { return f16x2_from_e4m3x2(x); }
template <> __device__ __forceinline__ u32 codes_to_mma<__nv_bfloat16>(u16 x) {
  const u32 h = f16x2_from_e4m3x2(x);
  return ((h & 0x7fff7fffu) >> 3) | (h & 0x80008000u);
}
// What a product with code operands of type T must be multiplied by (2^112 for bf16, 1 for f16), and the
// power of two a bf16 query is multiplied by first so that q * code * 2^-112 stays a normal float.
template <typename T> struct CodeScale { static constexpr float value = 1.f, q_pre = 1.f; };
template <> struct CodeScale<__nv_bfloat16> { static constexpr float value = 0x1p112f, q_pre = 0x1p56f; };

// Eight From values times f, rounded to To.
template <typename To, typename From>
__device__ __forceinline__ uint4 convert8(uint4 x, float f) {
  const From* e = reinterpret_cast<const From*>(&x);
  uint4 r;
  r.x = ElemTraits<To>::pack(ElemTraits<From>::to_float(e[0]) * f, ElemTraits<From>::to_float(e[1]) * f);
  r.y = ElemTraits<To>::pack(ElemTraits<From>::to_float(e[2]) * f, ElemTraits<From>::to_float(e[3]) * f);
  r.z = ElemTraits<To>::pack(ElemTraits<From>::to_float(e[4]) * f, ElemTraits<From>::to_float(e[5]) * f);
  r.w = ElemTraits<To>::pack(ElemTraits<From>::to_float(e[6]) * f, ElemTraits<From>::to_float(e[7]) * f);
  return r;
}

// Eight T values times a power of two (exact).
template <typename T>
__device__ __forceinline__ uint4 scale8(uint4 x, float f) {
  return f == 1.f ? x : convert8<T, T>(x, f);
}

// A float as three bf16 terms, hi + mid + lo == x exactly (hi and mid truncate; what is left after them has at
// most 8 significant bits): {hi | mid << 16, lo}, for a tensor-core sum that restores x in float32.
__device__ __forceinline__ uint2 bf16x3_from_float(float x) {
  const u32 b = __float_as_uint(x);
  const float r = x - __uint_as_float(b & 0xffff0000u);
  const u32 m = __float_as_uint(r) & 0xffff0000u;
  const float lo = r - __uint_as_float(m);
  return make_uint2((b >> 16) | m, __float_as_uint(lo) >> 16);
}

__device__ __forceinline__ uint2 ldg_stream8(const void* p) {
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

}  // namespace cukv
