// append_kv: scatter new K/V tokens into their cache slots (slot = physical_page * page_size + offset).
// Slots outside [0, num_pages * page_size) -- -1 marks padding -- are skipped, so a bad slot mapping can
// never write outside the cache.
#pragma once
#include "kv_operand.cuh"

namespace cukv {

struct alignas(8) AppendArgs {
  KVCacheParams kv;
  const void* k_new;    // [num_tokens, num_heads, depth], contiguous
  const void* v_new;
  const i64* slots;     // [num_tokens]
  i64 num_tokens;
  i64 num_heads;
};

template <typename T, int PAGE_SIZE, int DEPTH>
__device__ __forceinline__ void append_kv(const AppendArgs& a) {
  typedef KVCacheOperand<T, PAGE_SIZE> Op;
  constexpr int VEC = 8;                       // 16 bytes of T
  constexpr int PER_ROW = DEPTH / VEC;
  static_assert(DEPTH % VEC == 0, "depth must be a multiple of 8");
  const Op op(a.kv);
  const i64 total = a.num_tokens * a.num_heads * PER_ROW;
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    const int vec = (int)(i % PER_ROW);
    const i64 th = i / PER_ROW;
    const int head = (int)(th % a.num_heads);
    const i64 tok = th / a.num_heads;
    const i64 slot = a.slots[tok];
    if (slot < 0 || slot >= op.num_kv_rows()) continue;
    const i64 src = th * DEPTH + vec * VEC;
    const uint4 kx = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.k_new) + src);
    const uint4 vx = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.v_new) + src);
    *reinterpret_cast<uint4*>(const_cast<T*>(op.row_ptr(true, slot, head, vec * VEC))) = kx;
    *reinterpret_cast<uint4*>(const_cast<T*>(op.row_ptr(false, slot, head, vec * VEC))) = vx;
  }
}

}  // namespace cukv

#include "fp8.cuh"

namespace cukv {

// Quantizing append into an FP8 e4m3 cache: one warp per (token, head) row; lane l holds dims [8i, 8i + 8)
// for i = l + 32 j. A granule's scale is max(amax, 448 * 2^-32) / 448 (IEEE division), each code
// e4m3_rn_satfinite(x / scale): bit for bit the NumPy quantizer in cukv/fp8.py. SCALE_BLOCK 0 reads the
// caller's per-tensor scalars instead of computing scales.
template <typename T, int PAGE_SIZE, int DEPTH, int SCALE_BLOCK>
__device__ __forceinline__ void append_kv_fp8(const AppendArgs& a) {
  typedef KVCacheOperand<unsigned char, PAGE_SIZE, true> Op;
  constexpr int VECS = DEPTH / 8, PER_LANE = (VECS + 31) / 32;
  constexpr int LANES_PER_GRANULE = SCALE_BLOCK == 0 ? 1 : SCALE_BLOCK / 8;
  static_assert(DEPTH % 16 == 0, "FP8 rows are whole 16-byte chunks");
  static_assert(SCALE_BLOCK == 0 || SCALE_BLOCK == DEPTH || (DEPTH % SCALE_BLOCK == 0 && SCALE_BLOCK % 32 == 0), "scale block divides depth");
  static_assert(SCALE_BLOCK == DEPTH || LANES_PER_GRANULE <= 32, "a granule spans at most one warp's vectors");
  const Op op(a.kv);
  const int lane = threadIdx.x & 31;
  const i64 rows = a.num_tokens * a.num_heads;
  const i64 warps = (i64)gridDim.x * (blockDim.x / 32);
  for (i64 th = blockIdx.x * (i64)(blockDim.x / 32) + threadIdx.x / 32; th < rows; th += warps) {
    const int head = (int)(th % a.num_heads);
    const i64 slot = a.slots[th / a.num_heads];
    if (slot < 0 || slot >= op.num_kv_rows()) continue;
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      const T* src = static_cast<const T*>(kv == 0 ? a.k_new : a.v_new) + th * DEPTH;
      float x[PER_LANE][8];
      float amax[PER_LANE];
#pragma unroll
      for (int j = 0; j < PER_LANE; ++j) {
        const int i = lane + 32 * j;
        uint4 w = i < VECS ? *reinterpret_cast<const uint4*>(src + 8 * i) : make_uint4(0, 0, 0, 0);
        const T* e = reinterpret_cast<const T*>(&w);
        amax[j] = 0.f;
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          x[j][t] = ElemTraits<T>::to_float(e[t]);
          amax[j] = fmaxf(amax[j], fabsf(x[j][t]));
        }
      }
      float scale[PER_LANE];
      if constexpr (SCALE_BLOCK == 0) {
        const float s = *op.template scale_ptr<0>(kv == 0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) scale[j] = s;
      } else {
        if constexpr (SCALE_BLOCK == DEPTH) {
          float m = 0.f;
#pragma unroll
          for (int j = 0; j < PER_LANE; ++j) m = fmaxf(m, amax[j]);
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
#pragma unroll
          for (int j = 0; j < PER_LANE; ++j) amax[j] = m;
        } else {
#pragma unroll
          for (int j = 0; j < PER_LANE; ++j)
#pragma unroll
            for (int o = LANES_PER_GRANULE / 2; o > 0; o >>= 1) amax[j] = fmaxf(amax[j], __shfl_xor_sync(0xffffffffu, amax[j], o));
        }
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
          scale[j] = __fdiv_rn(fmaxf(amax[j], 448.f * 0x1p-32f), 448.f);
          const int i = lane + 32 * j;
          if (i < VECS && (8 * i) % SCALE_BLOCK == 0)
            *const_cast<float*>(op.template scale_ptr<SCALE_BLOCK>(kv == 0, slot, head, 8 * i)) = scale[j];
        }
      }
#pragma unroll
      for (int j = 0; j < PER_LANE; ++j) {
        const int i = lane + 32 * j;
        if (i >= VECS) continue;
        u32 w[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const u16 lo = e4m3x2_from_floats(__fdiv_rn(x[j][4 * h], scale[j]), __fdiv_rn(x[j][4 * h + 1], scale[j]));
          const u16 hi = e4m3x2_from_floats(__fdiv_rn(x[j][4 * h + 2], scale[j]), __fdiv_rn(x[j][4 * h + 3], scale[j]));
          w[h] = (u32)lo | ((u32)hi << 16);
        }
        *reinterpret_cast<uint2*>(const_cast<unsigned char*>(op.row_ptr(kv == 0, slot, head, 8 * i))) = make_uint2(w[0], w[1]);
      }
    }
  }
}

}  // namespace cukv
