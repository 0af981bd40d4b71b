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
