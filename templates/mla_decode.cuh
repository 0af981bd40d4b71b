// Absorbed MLA decode on Hopper: the parameters, the work item and the shared-memory plan.
//
// A block owns one work item: 64 query rows (heads and the s_q new tokens folded together, row R = i * H + h)
// of one sequence, against one chunk of its cached tokens. Warpgroup 0 produces: it stages the query block
// once and streams K tiles of BN tokens x 576 values through a ring of shared-memory stages (cp.async,
// completion on mbarriers). Warpgroups 1 and 2 consume: each computes S = Q K^T for half of the tile's tokens
// (wgmma from shared-memory descriptors), the two exchange row maxima and their P through shared memory, and
// each accumulates O[:, its 256 columns] += P V, V being the first 512 columns of the same K rows (the "split"
// schedule; mla_decode_consumer_alt.cuh gives each warpgroup every other tile whole instead). A chunk
// that covers its whole sequence writes the output; the others write float32 partials that the combine
// kernel (mla_decode_combine.cuh) merges by LSE.
#pragma once
#include "hopper.cuh"

#ifndef CUKV_MLA_LAZY_RESCALE  // set by the rendered source (MLADecodeConfig.lazy_rescale)
#define CUKV_MLA_LAZY_RESCALE 0
#endif

// CUKV_MLA_TIMELINE (probe only: benchmarks/probe_mla_timeline.py): per block, the global timer at entry (0), after
// the barriers' set-up (1), when each consumer warpgroup has finished its item (2, 3), at exit (4), and (slice
// consumers) when the query block has landed (5) and warpgroup 0's last tile is done (6); the SM in slot 7. Persistent
// sparse blocks stamp 2, 3, 5 and 6 (and 7) of each item in the row of its (token, row block), the prefill's item order.
#ifdef CUKV_MLA_TIMELINE
extern "C" __device__ unsigned long long cukv_mla_timeline[16384 * 8];
// stamp k of row `row`, with the SM it ran on
#define MLA_TIMELINE_AT_ROW(row, k)                                       \
  do {                                                                    \
    cukv_mla_timeline[(row) * 8 + (k)] = cukv::globaltimer_ns();          \
    unsigned sm_;                                                         \
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_));                      \
    cukv_mla_timeline[(row) * 8 + 7] = sm_;                               \
  } while (0)
#define MLA_TIMELINE_AT(k) MLA_TIMELINE_AT_ROW(blockIdx.x, k)
#define MLA_TIMELINE(k)                                                   \
  do {                                                                    \
    if (threadIdx.x == 0) MLA_TIMELINE_AT(k);                             \
  } while (0)
// the row of work item w in a persistent sparse block (its (token, row block): the prefill's item order)
#define MLA_TIMELINE_ITEM_ROW(a, w) ((w).batch * (a).row_blocks + (w).row_block)
#else
#define MLA_TIMELINE_AT_ROW(row, k) ((void)0)
#define MLA_TIMELINE_AT(k) ((void)0)
#define MLA_TIMELINE(k) ((void)0)
#endif

namespace cukv {

constexpr int kMlaDim = 576, kMlaNope = 512, kMlaRope = 64;
constexpr int kMlaBlockM = 64;  // query rows per block (one wgmma M)

struct MLADecodeParams {
  const void* q_nope;    // [B, s_q, H, 512] of T, strides q_nope_stride (elements)
  const void* q_pe;      // [B, s_q, H, 64] of T
  void* out;             // [B, s_q, H, 512] of T, contiguous
  float* lse;            // [B, s_q, H] or null
  float* part_o;         // [items, 64, 512] partial outputs (normalized), for split items
  float* part_lse;       // [items, 64]
  const float* sink;     // [H] or null
  const char* cache;     // page 0, token 0 of the MLA cache
  const int* block_table;
  const int* seq_lens;   // [B]
  const int* items;      // [capacity, 8]: batch, row block, first token, end token, partial slot (-1: direct)
  const int* num_items;  // [2]: the items (blocks past them return at once), the row blocks listed in comb_rbs
  const int* rb_indptr;  // [B * row_blocks + 1]: the items of each (sequence, row block) ...
  const int* rb_slots;   // ... as partial slots, for the combine kernel
  const int4* comb_rbs;  // the (sequence, row block)s split into chunks, for the combine kernel: sequence *
                         // row_blocks + row block, its first entry in rb_slots, its chunks, 0
  long long q_nope_stride[3], q_pe_stride[3];
  long long page_stride, row_stride, table_stride;  // bytes, bytes, elements
  int num_pages, page_size, table_width, batch;
  int s_q, heads, rows, row_blocks;
  float scale_log2, pad;
  // sparse MLA (MLAPrefillSparse, sparse_mla.cu.j2); the dense kernels never read these. "Sequence" b is query
  // token b (s_q = 1) and its key j is cache row indices[b * indices_stride + j] = page * page_size + offset.
  const int* indices;       // int32 (or uint32: the same test) row numbers; valid when 0 <= idx < num_rows
  const int* topk_lengths;  // [tokens / lengths_div] valid prefix of each list, or null (all topk)
  float* max_logits;        // [tokens, H] max scaled logit over valid keys (natural units), or null
  float* part_max;          // [parts, 64] per split item
  long long indices_stride;  // elements between consecutive tokens' lists
  int num_rows, topk, lengths_div, pad2;
};

struct MLAWorkItem {
  int batch, row_block, begin, end, part;
};

// Sparse: the item's keys stop at the token's valid prefix (topk_lengths, clamped to topk), so tiles wholly
// past it are neither loaded nor scored.
__device__ __forceinline__ int mla_sparse_end(const MLADecodeParams& a, const MLAWorkItem& w) {
  int len = a.topk_lengths != nullptr ? a.topk_lengths[w.batch / a.lengths_div] : a.topk;
  len = len < w.end ? len : w.end;
  return len > w.begin ? len : w.begin;
}

__device__ __forceinline__ MLAWorkItem mla_load_item(const MLADecodeParams& a, int idx) {
  const int* p = a.items + 8 * idx;
  return MLAWorkItem{p[0], p[1], p[2], p[3], p[4]};
}

// Query row R (0 .. rows) of sequence b: its new-token index, its head, and the keys it may see in [begin, end).
__device__ __forceinline__ int mla_row_limit(const MLADecodeParams& a, const MLAWorkItem& w, int len, int R) {
  if (R >= a.rows) return w.begin;  // padding row: sees nothing
  const int i = R / a.heads;
  const int lim = len - (a.s_q - 1 - i);
  return lim < w.end ? lim : w.end;
}

// MLADecodeConfig.persistent: this block's work items blockIdx.x, blockIdx.x + gridDim.x, ... below n_items, each
// given to f(item, its tiles, ring0: the tiles of the block's earlier items, its index among the block's items);
// SPARSE: each item cut at its token's valid prefix (mla_sparse_end).
template <int BN, bool SPARSE = false, typename F>
__device__ __forceinline__ void mla_for_block_items(const MLADecodeParams& a, int n_items, F&& f) {
#pragma unroll 1
  for (int idx = blockIdx.x, ring0 = 0, j = 0; idx < n_items; idx += gridDim.x, ++j) {
    MLAWorkItem w = mla_load_item(a, idx);
    if constexpr (SPARSE) w.end = mla_sparse_end(a, w);
    const int n_tiles = (w.end - w.begin + BN - 1) / BN;
    f(w, n_tiles, ring0, j);
    ring0 += n_tiles;
  }
}

}  // namespace cukv
