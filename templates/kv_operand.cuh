// KVCacheOperand: the kernel-side view of a paged (or contiguous) KV cache, after MAX's KVCacheMHAOperand.
//
// The Python twin (cukv/operand.py) packs KVCacheParams field by field; every field is 8 bytes so the
// two layouts cannot drift apart. PAGE_SIZE 0 is the ragged contiguous form used by prefill: K/V are
// [total_tokens, H, D] and block_table holds kv_offsets[B + 1] (sequence b owns rows offsets[b] ..
// offsets[b + 1] - 1); only the token, head and dim strides are used.
#pragma once
#include "common.cuh"

namespace cukv {

struct alignas(8) KVCacheParams {
  const void* k;              // element (page, tok, head, dim) at k + dot(k_stride, idx)
  const void* v;
  const float* k_scales;      // FP8 caches only (nullptr otherwise); strided like k, dim index = block
  const float* v_scales;
  const int* block_table;     // [batch, bt_stride]: logical page -> physical page
  const int* cache_lengths;   // [batch]: tokens visible to the kernel
  i64 k_stride[4];            // elements: page, token-in-page, kv head, dim
  i64 v_stride[4];
  i64 ks_stride[4];
  i64 vs_stride[4];
  i64 bt_stride;              // elements between block_table rows
  i64 max_pages_per_seq;      // columns of block_table that may be read
  i64 num_pages;              // physical pages in the cache; larger ids are treated as holes
  i64 batch_size;
};
static_assert(sizeof(KVCacheParams) == 8 * 6 + 8 * 16 + 8 * 4, "KVCacheParams layout is fixed by cukv/operand.py");

template <typename T, int PAGE_SIZE, bool QUANTIZED = false>
struct KVCacheOperand {
  static constexpr int page_size = PAGE_SIZE;
  static constexpr bool quantization_enabled = QUANTIZED;
  typedef T dtype;
  KVCacheParams p;

  __device__ __forceinline__ explicit KVCacheOperand(const KVCacheParams& params) : p(params) {}

  static constexpr bool contiguous = PAGE_SIZE == 0;

  __device__ __forceinline__ int cache_length(int batch_idx) const {
    if constexpr (contiguous) return p.block_table[batch_idx + 1] - p.block_table[batch_idx];
    else return p.cache_lengths[batch_idx];
  }

  __device__ __forceinline__ i64 num_kv_rows() const {
    if constexpr (contiguous) return p.num_pages;  // rows of the contiguous K/V
    else return p.num_pages * (i64)PAGE_SIZE;
  }

  // Row index when the cache is viewed as a [num_pages * PAGE_SIZE, ...] matrix (-1: a hole, or a table entry
  // pointing outside the cache: never dereferenced).
  __device__ __forceinline__ i64 row_idx(int batch_idx, int tok_idx) const {
    return row_from_key(row_key(batch_idx, tok_idx), tok_idx);
  }
  // row_idx in two steps: row_key is the table load (a page, or a contiguous sequence's kv offset), issued
  // ahead; row_from_key checks it where the row is used, so the load's latency is not waited for at the lookup.
  // row_key never reads past the table's columns.
  __device__ __forceinline__ i64 row_key(int batch_idx, int tok_idx) const {
    if constexpr (contiguous) {
      return (i64)__ldg(p.block_table + batch_idx);
    } else {
      const int lp = tok_idx / PAGE_SIZE;
      return lp < p.max_pages_per_seq ? (i64)__ldg(p.block_table + (i64)batch_idx * p.bt_stride + lp) : (i64)-1;
    }
  }
  __device__ __forceinline__ i64 row_from_key(i64 key, int tok_idx) const {
    if constexpr (contiguous) {
      // kv_offsets come from the user: a row outside k/v reads as a hole, never out of bounds
      const i64 row = key + tok_idx;
      return (row >= 0 && row < p.num_pages) ? row : (i64)-1;
    } else {
      return (key >= 0 && key < p.num_pages) ? key * PAGE_SIZE + tok_idx % PAGE_SIZE : (i64)-1;
    }
  }

  __device__ __forceinline__ static i64 offset(const i64 (&s)[4], i64 row, int head, int dim) {
    if constexpr (contiguous) return row * s[1] + (i64)head * s[2] + (i64)dim * s[3];
    else return (row / PAGE_SIZE) * s[0] + (row % PAGE_SIZE) * s[1] + (i64)head * s[2] + (i64)dim * s[3];
  }

  // Pointer to K (is_k) or V at a physical row; callers get rows from row_idx.
  __device__ __forceinline__ const T* row_ptr(bool is_k, i64 row, int head, int dim = 0) const {
    return is_k ? static_cast<const T*>(p.k) + offset(p.k_stride, row, head, dim)
                : static_cast<const T*>(p.v) + offset(p.v_stride, row, head, dim);
  }

  __device__ __forceinline__ const T* block_paged_ptr(bool is_k, int batch_idx, int start_tok_idx, int head_idx,
                                                      int head_dim_idx = 0) const {
    i64 row = row_idx(batch_idx, start_tok_idx);
    return row < 0 ? nullptr : row_ptr(is_k, row, head_idx, head_dim_idx);
  }

  // Scale of the granule holding (row, head, dim); BLOCK is the granule width in dims, 0 for one scale per
  // tensor (its strides are all zero, so every granule reads the one scalar).
  template <int BLOCK>
  __device__ __forceinline__ const float* scale_ptr(bool is_k, i64 row, int head, int dim) const {
    const float* base = is_k ? p.k_scales : p.v_scales;
    const i64(&s)[4] = is_k ? p.ks_stride : p.vs_stride;
    return base + offset(s, row, head, BLOCK > 0 ? dim / BLOCK : 0);
  }
  template <int BLOCK>
  __device__ __forceinline__ float load_scale(bool is_k, i64 row, int head, int dim) const {
    return __ldg(scale_ptr<BLOCK>(is_k, row, head, dim));
  }
};

}  // namespace cukv
