// The prefill's tile scheduler: which keys a query position sees, the work item (BM query rows of one sequence and
// head, and the key tiles they see), and the persistent grid's staging of an item for the consumers. The launch-per-
// item grid takes item (blockIdx.x, blockIdx.y); the persistent grids take items from a counter (feed_persistent,
// feed_persistent_16), in the same heaviest-first order.
#pragma once
#include "prefill_kernel.cuh"

namespace cukv {

// Visible key range [lo, hi) of query positions [p_lo, p_hi] (inclusive), and per-position limits.
template <class Traits>
__device__ __forceinline__ int PrefillKernel<Traits>::key_hi(const PrefillArgs& a, int p, int kv_len) {
  int hi = kv_len;
  if (a.causal) hi = min(hi, p + 1);
  if (a.chunk > 0) hi = min(hi, (p / a.chunk + 1) * a.chunk);
  return hi;
}

template <class Traits>
__device__ __forceinline__ int PrefillKernel<Traits>::key_lo(const PrefillArgs& a, int p) {
  int lo = 0;
  if (a.window > 0) lo = max(lo, p - a.window + 1);
  if (a.chunk > 0) lo = max(lo, (p / a.chunk) * a.chunk);
  return lo;
}

template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::store_item(u32 addr, const Item& t) {
  const int* w = reinterpret_cast<const int*>(&t);
#pragma unroll
  for (int i = 0; i < kItemInts; ++i) asm volatile("st.shared.u32 [%0], %1;" :: "r"(addr + 4 * i), "r"(w[i]) : "memory");
}

template <class Traits>
__device__ __forceinline__ auto PrefillKernel<Traits>::load_item(u32 addr) -> Item {
  Item t;
  int* w = reinterpret_cast<int*>(&t);
#pragma unroll
  for (int i = 0; i < kItemInts; ++i) asm volatile("ld.shared.u32 %0, [%1];" : "=r"(w[i]) : "r"(addr + 4 * i) : "memory");
  return t;
}

// work item w of the heaviest-first list for query head `head`
template <class Traits>
__device__ __forceinline__ auto PrefillKernel<Traits>::make_item(const PrefillArgs& a, const OnceArgs* once,
                                                                 const Cache& cache, int w, int head) -> Item {
  Item t;
  t.head = head;
  t.kv_head = head / a.group;
  t.b = a.work[2 * w];
  const int qtile = a.work[2 * w + 1];
  t.q_begin = a.q_offsets[t.b];
  const int q_len = a.q_offsets[t.b + 1] - t.q_begin;
  // convert once: the FP8 table's keys, within the rows the workspace holds for the sequence
  t.kv_len = kOnce ? min(Fp8Cache(once->fp8).cache_length(t.b), cache.cache_length(t.b)) : cache.cache_length(t.b);
  t.q0 = qtile * BM;
  t.rows = min(BM, q_len - t.q0);
  t.shift = t.kv_len - q_len;  // query i sits at position shift + i
  // the item's key range: union over its rows (positions shift+q0 .. shift+q0+rows-1)
  const int p_first = t.shift + t.q0, p_last = t.shift + t.q0 + t.rows - 1;
  const int lo = max(0, key_lo(a, p_first));
  const int hi = min(t.kv_len, key_hi(a, p_last, t.kv_len));
  t.n_first = lo / BN;
  t.n_tiles = hi > lo ? (hi - 1) / BN - t.n_first + 1 : 0;
  return t;
}

// PERSISTENT: item index i runs along the work items (heaviest first) of one head after another; the last
// a.tail_heads heads run as one section, its items heaviest first with the heads innermost, so that the last heads'
// long items start early instead of running alone at the end of the grid (tail_heads 0 or 1: no section).
template <class Traits>
__device__ __forceinline__ auto PrefillKernel<Traits>::make_item(const PrefillArgs& a, const OnceArgs* once,
                                                                 const Cache& cache, int i) -> Item {
  const int n = once->num_work, first = a.num_qo_heads - a.tail_heads;
  if (a.tail_heads <= 1 || i < first * n) return make_item(a, once, cache, i % n, i / n);
  const int r = i - first * n;
  return make_item(a, once, cache, r / a.tail_heads, first + r % a.tail_heads);
}

// Warp 0's lane 0: the item and its query on q_full (BM rows of the head by tensor copies: rows past the sequence
// read the next one's or zeros, and their outputs are never stored); b < 0 tells the consumers to stop.
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::stage_item(const Smem& sm, const CUtensorMap* qmap,
                                                                  const Item& t) {
  store_item(sm.item, t);
  if (t.b >= 0) {
    mbar_expect_tx(sm.q_full, kQAtoms * BM * kAtomRowBytes);
    for (int atom = 0; atom < kQAtoms; ++atom)
      tma_load_4d(sm.q + (u32)(atom * BM * kAtomRowBytes), qmap, atom * kAtomRowBytes, t.head, t.q_begin + t.q0, 0,
                  sm.q_full);
  }
  mbar_arrive(sm.q_full);  // release: the item
}

}  // namespace cukv
