// Convert once (ONCE_PAGE > 0): the block reads 16-bit K/V from a workspace that the blocks fill themselves from an
// FP8 cache. Each (workspace tile, KV head, quarter of BN / 4 rows) has a flag: 0 free, 1 claimed, 2 ready (zeroed
// before the launch). The producer warpgroup splits: warp 0 feeds the ring by TMA from the workspace once a tile's
// four flags read ready, and warps 1-3 claim free quarters, convert them from the FP8 cache (rows past the sequence as
// zeros) into the workspace and release them. Each quarter is converted once per call instead of once per visiting
// query tile (docs/tuning.md).
//
// PERSISTENT: one block per SM walks the work items (query tile, head) in the launch grid's order. Warp 0 takes the
// next item from a counter (the first is blockIdx.x), stages its query once the consumers are done with the previous
// one (q_empty: their last S of the item has completed) and publishes the item (Item, in shared memory) with it
// (q_full); the ring's position carries over, so the next item's tiles load while the consumers finish the last one.
// Warps 1-3 take quarters from a second counter in the order the items need them (KV head, then workspace tile),
// until none is left: nobody claims by compare-and-swap, and no converter holds an SM whose consumers are done.
#pragma once
#include "prefill_scheduler.cuh"

namespace cukv {

// kOnce's producer. Warp 0 only feeds the ring: per visited tile it waits
// until the tile's four quarters are ready in the workspace and loads them by TMA, so nothing it does waits on a
// conversion's copies or stores (a producer that converted between its ring loads passed each step's latency on to
// the consumers). Warps 1-3 convert, one quarter at a time through their own quarter of the raw tile. A claimed
// quarter is released once its rows are in the workspace; its claimer never waits on anything but its own copies
// and stores, so warp 0's unbounded wait always ends.

// Warp 0's ring loads of one item's tiles, the last first (`count`: ring elements issued so far, kept across
// items by the persistent kernel).
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::feed_once(const PrefillMaps* maps, const OnceArgs& o,
                                                                 const Smem& sm, const Buf& buf, int ws0, int kv_head,
                                                                 int n_first, int n_tiles, Ring& ring, int lane) {
  const int n_last = n_first + n_tiles - 1;
  int ready_to = 0;  // tiles [it, ready_to) of the walk are known ready
  const bool first_item = CUKV_ONCE_STATS && ring.count == 0;
  u64 first_wait = 0;
  for (int it = 0; it < n_tiles; ++it) {
    const int n = n_last - it;
    if (CUKV_ONCE_UB != 1 && it >= ready_to) {
      // lane l acquires quarter l % 4 of the walk's tile it + l / 4: one round trip covers the next 8 tiles (a
      // flag per tile cost a round trip and a proxy fence on the ring's path each). The ballot orders those
      // acquires before lane 0's copies, as __syncwarp would.
      const int t = it + lane / 4;
      int ready = t >= n_tiles, polls = 0;
      const u64 t0 = CUKV_ONCE_STATS ? globaltimer_ns() : 0;
      for (;;) {
        if (!ready) ready = ld_acquire_gpu(once_flag(o, ws0, n_last - t, kv_head, lane % 4)) == 2;
        const unsigned late = __ballot_sync(0xffffffffu, !ready);
        const int upto = late ? (__ffs(late) - 1) / 4 : 8;  // whole tiles ready from it on
        if (upto > 0) {
          ready_to = min(n_tiles, it + upto);
          break;
        }
        __nanosleep(128);
        ++polls;
      }
      if (CUKV_ONCE_STATS && lane == 0) {
        atomicAdd(o.flags - 32 + (polls ? 3 : 2), 1);
        atomicAdd(o.flags - 32 + 4, polls);
        if (polls) atomicAdd(o.flags - 32 + 5, (int)((globaltimer_ns() - t0) >> 6));
        if (polls && first_item) first_wait += globaltimer_ns() - t0;
      }
      if (lane == 0) fence_proxy_async_global();  // the acquired rows -> this thread's tensor copies
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int stage = ring.stage();
      mbar_wait(sm.empty + 8 * stage, ring.empty_phase());
      if (lane == 0) {
        const u32 bar = sm.full + 8 * stage;
        mbar_expect_tx(bar, kQAtoms * BN * kAtomRowBytes);
        // one box of the tile's BN rows per atom (the four quarters' flags are all acquired): a quarter's box
        // each made warp 0 issue four times the tensor copies
#pragma unroll
        for (int atom = 0; atom < kQAtoms; ++atom)
          tma_load_4d(buf.element(stage) + (u32)(atom * BN * kAtomRowBytes), e ? &maps->v : &maps->k,
                      atom * kAtomRowBytes, kv_head, ws0 + n * BN, 0, bar);
      }
      mbar_arrive_n(sm.full + 8 * stage, Buf::kProducerWarps);  // the full barrier counts 128 producer arrivals
      ring.advance();
    }
    // tiles issued so far, for the converters' stop rule (the first word of warp 0's raw quarter, which it never
    // uses; the persistent converters have no stop rule)
    if (!PERSISTENT && lane == 0) asm volatile("st.volatile.shared.u32 [%0], %1;" :: "r"(sm.raw), "r"(it + 1) : "memory");
  }
  if (CUKV_ONCE_STATS && first_item && lane == 0) {  // [7] the first items' waits, [8] the longest (64 ns units)
    atomicAdd(o.flags - 32 + 7, (int)(first_wait >> 6));
    atomicMax(o.flags - 32 + 8, (int)(first_wait >> 6));
  }
}

// what the converters multiply a per-tensor cache's codes by: its K or V scale, or 1 where the workspace holds the
// codes (kOnceCodes); token and block scales: 0, unused (each row's scales come with its codes)
template <class Traits>
__device__ __forceinline__ float PrefillKernel<Traits>::tensor_scale(const Fp8Cache& f, bool is_k) {
  return SCALE_BLOCK > 0 ? 0.f : kOnceCodes ? 1.f : f.template load_scale<0>(is_k, 0, 0, 0);
}

// the flag of quarter q of the sequence's workspace tile n (its first row ws0) for KV head k
template <class Traits>
__device__ __forceinline__ int* PrefillKernel<Traits>::once_flag(const OnceArgs& o, int ws0, int n, int k, int q) {
  return o.flags + ((i64)(ws0 / BN + n) * o.num_kv_heads + k) * 4 + q;
}

// A converter warp: quarter q of sequence b's tile n for KV head k (rows past kv_len as zeros) through its raw
// quarter (raw_quarter) into the workspace, then its flag released (2).
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::convert_quarter(const PrefillArgs& a, const OnceArgs& o,
    const Smem& sm, const Buf& buf, const Fp8Cache& f, float k_scale, float v_scale, int b, int kv_len, int ws0, int n,
    int k, int q, u32 quarter, int lane) {
  constexpr int kWarpRows = BN / Buf::kProducerWarps;
  const u64 t0 = CUKV_ONCE_STATS ? globaltimer_ns() : 0;
  const int tok_lane = n * BN + q * kWarpRows + lane;
  const i64 row = (lane < kWarpRows && tok_lane < kv_len) ? f.row_idx(b, tok_lane) : (i64)-1;
  auto copy = [&](auto is_k) {
    constexpr bool IS_K = decltype(is_k)::value;
    i64 lane_off = -1, lane_scale = 0;
    if (row >= 0) {
      lane_off = Fp8Cache::offset(IS_K ? o.fp8.k_stride : o.fp8.v_stride, row, k, 0);
      if constexpr (SCALE_BLOCK > 0)
        lane_scale = f.template scale_ptr<SCALE_BLOCK>(IS_K, row, k, 0) - (IS_K ? o.fp8.k_scales : o.fp8.v_scales);
    }
    buf.template copy_raw_fp8<SCALE_BLOCK, kOnceCodeBytes>(
        quarter + (u32)(IS_K ? 0 : kOnceElemBytes), static_cast<const unsigned char*>(IS_K ? o.fp8.k : o.fp8.v),
        IS_K ? o.fp8.k_scales : o.fp8.v_scales, [&](int r) { return __shfl_sync(0xffffffffu, lane_off, r); },
        lane_off, lane_scale, 0, DEPTH, 0, lane);
  };
  copy(Bool<true>());
  copy(Bool<false>());
  cp_async_commit();
  cp_async_wait<0>();
  __syncwarp();  // and the scales the rows' lanes copied
  const i64 row0 = ws0 + n * BN + q * kWarpRows;
  buf.template convert_raw_fp8_to_global<SCALE_BLOCK, kOnceCodeBytes>(
      quarter, static_cast<T*>(const_cast<void*>(a.kv.k)) + Cache::offset(a.kv.k_stride, row0, k, 0),
      a.kv.k_stride[1], k_scale, DEPTH, 0, lane);
  buf.template convert_raw_fp8_to_global<SCALE_BLOCK, kOnceCodeBytes>(
      quarter + (u32)kOnceElemBytes,
      static_cast<T*>(const_cast<void*>(a.kv.v)) + Cache::offset(a.kv.v_stride, row0, k, 0), a.kv.v_stride[1],
      v_scale, DEPTH, 0, lane);
  __threadfence();  // this lane's workspace rows are visible
  __syncwarp();     // every lane's, and every lane has read its raw chunks before the next copy
  if (lane == 0) st_release_gpu(once_flag(o, ws0, n, k, q), 2);
  if (CUKV_ONCE_STATS && lane == 0) {
    atomicAdd(o.flags - 32 + 1, 1);
    atomicAdd(o.flags - 32 + 6, (int)((globaltimer_ns() - t0) >> 6));
  }
}

// The launch-per-item producer: warp 0 feeds the item's tiles; warps 1-3 convert any free quarter of the tiles the
// block visits (the first KV head, or keys nobody converted ahead), then greedily the free quarters of the
// sequence's next KV head, whose blocks the grid launches next (heads along y).
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::produce_once(const PrefillArgs& a, const PrefillMaps* maps,
                                                                    const OnceArgs& o, const Smem& sm, const Buf& buf,
                                                                    const Cache& ws, int b, int kv_head, int head,
                                                                    int q_begin, int q0, int rows, int kv_len,
                                                                    int n_first, int n_tiles, int pw, int lane) {
  const int ws0 = (int)ws.row_key(b, 0);  // the sequence's first workspace row, a multiple of BN
  const int n_last = n_first + n_tiles - 1;
  if (pw == 0 && lane == 0) asm volatile("st.volatile.shared.u32 [%0], 0;" :: "r"(sm.raw) : "memory");
  asm volatile("bar.sync 15, 128;" ::: "memory");  // the producer warpgroup (15: no other user): the count is 0 before converters look
  load_query(a, sm, head, q_begin, q0, rows, pw, lane);
  if (pw == 0) {
    Ring ring{0};
    feed_once(maps, o, sm, buf, ws0, kv_head, n_first, n_tiles, ring, lane);
    asm volatile("cp.async.wait_all;" ::: "memory");  // the query's copies have landed
    return;
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  if (CUKV_ONCE_UB == 1) return;
  const Fp8Cache f(o.fp8);
  const float k_scale = tensor_scale(f, true), v_scale = tensor_scale(f, false);
  // claims quarter q of tile n of KV head k if it is free (relaxed look first: most are taken or ready)
  auto claim = [&](int n, int k, int q) {
    int won = 0;
    int* flag = once_flag(o, ws0, n, k, q);
    if (lane == 0 && ld_relaxed_gpu(flag) == 0) won = atomicCAS(flag, 0, 1) == 0;
    return __shfl_sync(0xffffffffu, won, 0) != 0;
  };
  constexpr int kConverters = Buf::kProducerWarps - 1;
  // The free quarters of KV head k's tiles top, top - 1, ... (tiles of them), in that order: 32 flags looked at in
  // one round trip, quarter i of the walk goes to warp 1 + i % 3. With `ahead`, it stops once warp 0 has fewer than
  // kOnceMinLeft tiles left to issue: a quarter takes a converter about as long as a few tiles take the
  // consumers, and a block whose consumers are done waits for its converters.
  auto convert_free = [&](int k, int top, int tiles, bool ahead) {
    auto stop = [&] {
      if (!ahead) return false;
      int fed;  // tiles warp 0 has issued
      asm volatile("ld.volatile.shared.u32 %0, [%1];" : "=r"(fed) : "r"(sm.raw) : "memory");
      return n_tiles - fed < kOnceMinLeft;
    };
    for (int base = 0; base < 4 * tiles; base += 32) {
      if (stop()) return;
      const int i = base + lane;
      const bool mine = i < 4 * tiles && i % kConverters == pw - 1;
      unsigned free = __ballot_sync(0xffffffffu, mine && ld_relaxed_gpu(once_flag(o, ws0, top - i / 4, k, i % 4)) == 0);
      for (; free; free &= free - 1) {
        if (stop()) return;
        const int j = base + __ffs(free) - 1;
        if (claim(top - j / 4, k, j % 4))
          convert_quarter(a, o, sm, buf, f, k_scale, v_scale, b, kv_len, ws0, top - j / 4, k, j % 4,
                          raw_quarter(sm, pw), lane);
      }
    }
  };
  // First the visited tiles, in the order warp 0 needs them; then, greedily, the sequence's tiles for the next KV
  // head, top tile first (the heaviest query tiles, which visit the top tiles first, launch first).
  convert_free(kv_head, n_last, n_tiles, false);
  const int seq_tiles = (kv_len + BN - 1) / BN;
  if (kv_head + 1 < o.num_kv_heads) convert_free(kv_head + 1, seq_tiles - 1, seq_tiles, true);
}

template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::feed_persistent(const PrefillArgs& a, const PrefillMaps* maps,
    const OnceArgs& o, const CUtensorMap* qmap, const Smem& sm, const Buf& buf, const Cache& ws, int lane) {
  const int total = o.num_work * a.num_qo_heads;
  Ring ring{0};
  Item t;
  t.b = -1;
  if ((int)blockIdx.x < total) t = make_item(a, &o, ws, blockIdx.x);
  for (int i = 0;; ++i) {
    if (i > 0) mbar_wait(sm.q_empty, (i - 1) & 1);  // the consumers are done with the staged query and item
    if (lane == 0) stage_item(sm, qmap, t);
    if (t.b < 0) return;
    if (t.n_tiles > 0)
      feed_once(maps, o, sm, buf, (int)ws.row_key(t.b, 0), t.kv_head, t.n_first, t.n_tiles, ring, lane);
    // The next item, taken only now that this one's tiles are issued (its consumers are a ring behind): a block
    // takes work when it is about to be free, as the hardware hands out blocks, so the heaviest-first order holds.
    // Taken at the item's start, a block that had just begun a long item held the next one back for its whole length
    // (slower, docs/tuning.md).
    int next = 0;
    if (lane == 0) next = gridDim.x + atomicAdd(o.flags - 2, 1);
    next = __shfl_sync(0xffffffffu, next, 0);
    t.b = -1;
    if (next < total) t = make_item(a, &o, ws, next);
  }
}

// Converter warp pw's raw quarter.
template <class Traits>
__device__ __forceinline__ u32 PrefillKernel<Traits>::raw_quarter(const Smem& sm, int pw) {
  return sm.raw + (u32)((pw - kOnceFirstQuarter) * kOnceQuarterBytes);
}

template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::convert_persistent(const PrefillArgs& a, const OnceArgs& o,
    const Smem& sm, const Buf& buf, const Cache& ws, u32 quarter, int lane) {
  if (CUKV_ONCE_UB == 1) return;
  const Fp8Cache f(o.fp8);
  const float k_scale = tensor_scale(f, true), v_scale = tensor_scale(f, false);
  const int per_head = 4 * o.ws_tiles, total = per_head * (int)o.num_kv_heads;
  for (;;) {
    int i = 0;
    if (lane == 0) i = atomicAdd(o.flags - 1, 1);
    i = __shfl_sync(0xffffffffu, i, 0);
    if (i >= total) return;
    const int k = i / per_head, q = i % 4;
    const int tile = (i % per_head) / 4;  // sequence by sequence, bottom up (docs/tuning.md)
    const int b = __ldg(o.tile_seq + tile);
    const int ws0 = (int)ws.row_key(b, 0);
    const int kv_len = min(f.cache_length(b), ws.cache_length(b));
    convert_quarter(a, o, sm, buf, f, k_scale, v_scale, b, kv_len, ws0, tile - ws0 / BN, k, q, quarter, lane);
  }
}

}  // namespace cukv
