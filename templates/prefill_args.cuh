// The prefill kernel's arguments, as cukv/operand.py packs them (the rendered source checks their sizes), and the
// kernel's options, which prefill.cu.j2 renders into a traits struct (PrefillKernel<Traits>, prefill_kernel.cuh).
//
// quantized: an FP8 e4m3 cache (scales per scale_block dims, 0 = per tensor). The producer dequantizes V to T on the
// way into shared memory (per tensor: V's codes as exact f16, P V in f16, the V scale applied to the output). K either
// takes the same path, or, with fp8_scores (bf16 queries, scales per token or per tensor, heads up to 256), goes into
// the ring as the cache's codes and S = Q K^T runs on the e4m3 tensor cores: each consumer warpgroup splits its query
// rows once into two e4m3 terms, q * 2^k = hi + lo (2^k per row), so S = (hi K + lo K) * k_scale / 2^k keeps about
// bf16's precision at the bf16 rate (an e4m3 wgmma is twice as fast) and the producer converts only V.
// tma_rows > 0: K/V come by tensor copies (TMA) instead of per-lane cp.async, one box of tma_rows rows (within a page;
// contiguous K/V is one page) per leading lane; maps->k and maps->v describe the cache as 4-d tensors
// [pages][token][head][dim]. 16-bit caches: bytes, boxes of one 128-byte atom straight into the ring (128-byte
// swizzle); the tile holding a sequence's end keeps cp.async. FP8: codes into raw slots (K into the ring when
// fp8_scores), and the scales keep their per-lane copies (token K scales: a register per lane, see kKsMma).
// pv_wait: each tile's P V completes before the next tile's S is issued (cuDNN's order), so S and P are never live
// together (a 128-key tile at d256 fits the consumers' registers) and the V element is released a tile earlier, which
// a ring of one tile needs; elsewhere P V(t) overlapping S(t + 1) measured faster (docs/tuning.md).
// pingpong: the consumer warpgroups issue their S wgmmas in a fixed ring order (named barriers 4 + wg), so the tensor
// cores finish one warpgroup's scores before the next one's and the softmax phases drift apart instead of running in
// lock-step (faster for FP8 at d128/d256 on H100, docs/tuning.md).
// once_page > 0 (convert once): the block reads 16-bit K/V from a workspace (a.kv: contiguous rows, each sequence's
// first row a multiple of BN, maps->k / maps->v its tensor maps), which the blocks fill themselves from an FP8 cache
// of once_page tokens per page (OnceArgs::fp8); see prefill_once.cuh.
// persistent: one block per SM walks the work items from a counter (prefill_scheduler.cuh).
#pragma once
#include "kv_buffer.cuh"

namespace cukv {

struct alignas(8) PrefillArgs {
  KVCacheParams kv;     // paged cache, or contiguous K/V (block_table = kv_offsets[B + 1], PAGE_SIZE 0)
  const void* q;        // [tokens, Hq, D]
  void* out;            // [tokens, Hq, D]
  float* lse;           // [tokens, Hq] natural log, or nullptr
  const float* sink;    // [Hq] or nullptr
  const int* q_offsets; // [B + 1]
  const int* work;      // [num_work, 2]: (sequence, q tile), heaviest first
  i64 q_stride[2];      // elements: token, head
  i64 o_stride[2];
  float sm_scale;
  float softcap;        // 0: off
  int window;           // 0: off; keys in (p - window, p]
  int chunk;            // 0: off; keys in the query's chunk of `chunk` positions
  int num_qo_heads;
  int group;
  int causal;
  int tail_heads;       // PERSISTENT: the last heads, whose items run as one section (prefill_scheduler.cuh); 0: none
};


// tensor maps of the K and V rows (tma_rows > 0; convert once: of the workspace)
struct alignas(64) PrefillMaps {
  CUtensorMap k, v;
};

// Convert once: each (workspace tile, KV head, quarter of BN / 4 rows) has a flag: 0 free, 1 claimed, 2 ready (zeroed
// before the launch).
struct alignas(8) OnceArgs {
  KVCacheParams fp8;    // the FP8 cache and its page table (lengths: the keys per sequence)
  int* flags;           // [workspace tiles, kv heads, 4], after 32 ints: statistics, [29..31] PERSISTENT's counters
  const int* tile_seq;  // [workspace tiles]: the sequence whose rows a tile holds (PERSISTENT's converters)
  i64 num_kv_heads;
  int num_work;         // work items per head (PERSISTENT)
  int ws_tiles;         // workspace tiles
};

}  // namespace cukv
