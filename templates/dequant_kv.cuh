// dequantize_kv: gather each sequence's FP8 keys and values through its page table into ragged 16-bit
// K/V [total_kv, H, D] (sequence b owns rows kv_offsets[b] .. kv_offsets[b + 1] - 1), code * scale in float32
// rounded to T: the values cache.dequantize() gives, in the order a contiguous prefill reads them.
// Only the kv_offsets[b + 1] - kv_offsets[b] tokens of each sequence are read, so unused slots (NaN or not)
// never reach the output; a hole (no page, or a page id outside the cache) writes zeros.
#pragma once
#include "kv_operand.cuh"
#include "fp8.cuh"

namespace cukv {

struct alignas(8) DequantArgs {
  KVCacheParams kv;
  void* k_out;             // [total_kv, num_heads, depth] of T, contiguous
  void* v_out;
  const int* kv_offsets;   // [batch + 1] device, rows of the output per sequence
  i64 num_heads;
};

// One thread per 8 codes of one (token, head) row of K (blockIdx.z 0) or V (1); blockIdx.y is the sequence,
// blockIdx.x walks its tokens. 8 codes stay inside one scale granule (granules are 32+ dims). K or V is a
// template argument: a runtime choice between the operand's stride arrays would put the operand on the stack.
template <typename T, int PAGE_SIZE, int DEPTH, int SCALE_BLOCK, bool IS_K>
__device__ __forceinline__ void dequantize_rows(const DequantArgs& a) {
  typedef KVCacheOperand<unsigned char, PAGE_SIZE, true> Op;
  constexpr int VECS = DEPTH / 8;
  static_assert(DEPTH % 16 == 0, "FP8 rows are whole 16-byte chunks");
  static_assert(SCALE_BLOCK == 0 || SCALE_BLOCK % 8 == 0, "8 codes share one scale");
  const Op op(a.kv);
  const int b = blockIdx.y;
  const i64 first = a.kv_offsets[b], len = a.kv_offsets[b + 1] - first;
  const i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
  const i64 tok = i / (a.num_heads * VECS);
  if (tok >= len) return;
  const int head = (int)(i / VECS % a.num_heads), vec = (int)(i % VECS);
  const i64 row = op.row_idx(b, (int)tok);
  uint4 val = make_uint4(0u, 0u, 0u, 0u);
  if (row >= 0) {
    const uint2 raw = *reinterpret_cast<const uint2*>(op.row_ptr(IS_K, row, head, vec * 8));
    val = dequant8<T>(raw, op.template load_scale<SCALE_BLOCK>(IS_K, row, head, vec * 8));
  }
  T* out = static_cast<T*>(IS_K ? a.k_out : a.v_out) + ((first + tok) * a.num_heads + head) * DEPTH + vec * 8;
  *reinterpret_cast<uint4*>(out) = val;
}

template <typename T, int PAGE_SIZE, int DEPTH, int SCALE_BLOCK>
__device__ __forceinline__ void dequantize_kv(const DequantArgs& a) {
  if (blockIdx.z == 0) dequantize_rows<T, PAGE_SIZE, DEPTH, SCALE_BLOCK, true>(a);
  else dequantize_rows<T, PAGE_SIZE, DEPTH, SCALE_BLOCK, false>(a);
}

}  // namespace cukv
