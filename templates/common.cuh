// Small building blocks shared by every cukv kernel: element types, 16-byte loads, mma.sync wrappers.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef CUKV_INF
#define CUKV_INF __int_as_float(0x7f800000)
#endif

namespace cukv {

typedef long long i64;
typedef unsigned int u32;

// A if C else B (NVRTC has no <type_traits> without the CUDA standard library headers).
template <bool C, typename A, typename B> struct Select { typedef A type; };
template <typename A, typename B> struct Select<false, A, B> { typedef B type; };
// A compile-time bool as a value: picks a template argument inside an unrolled loop's branch.
template <bool B> struct Bool { static constexpr bool value = B; };

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <typename T> struct ElemTraits;
template <> struct ElemTraits<__half> {
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
  }
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};
template <> struct ElemTraits<__nv_bfloat16> {
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
  }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

// Read-only 16-byte load that does not allocate in L1: KV rows are read exactly once per kernel.
__device__ __forceinline__ uint4 ldg_stream16(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// D += A * B for m16n8k16 with f32 accumulators; A, B are packed pairs of T.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The smallest power of two >= x, for finite x > 0 (2^-126 for anything at or below it).
__device__ __forceinline__ float pow2_at_least(float x) {
  const int bits = __float_as_int(x);
  const int e = ((bits >> 23) & 0xff) + ((bits & 0x7fffff) != 0);
  return __int_as_float(min(254, max(1, e)) << 23);
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace cukv
