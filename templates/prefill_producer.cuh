// The prefill's producer warpgroup for a paged (or contiguous) cache: the query, then each visited tile's K and V
// elements into the KVBuffer ring (kv_buffer.cuh), by cp.async or by tensor copies, converting FP8 codes on the way
// (16-bit and FP8 caches); and the persistent 16-bit grid's walk over work items.
#pragma once
#include "prefill_scheduler.cuh"

namespace cukv {

// Q: BM rows x all atoms, rows past the sequence and columns past DEPTH as zeros (FP8 scores: the consumers stage
// their own rows as e4m3 terms instead)
// (every producer lane arrives on q_full when its copies land)
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::load_query(const PrefillArgs& a, const Smem& sm, int head,
                                                                  int q_begin, int q0, int rows, int pw, int lane) {
  const T* q = static_cast<const T*>(a.q);
  for (int i = pw * 32 + lane; i < BM * kQAtoms * 8; i += 128) {
    const int chunk = i % 8, r = (i / 8) % BM, atom = i / (8 * BM);
    const int col = atom * 64 + chunk * 8;
    const bool ok = r < rows && col < DEPTH;
    const T* src = ok ? q + (i64)(q_begin + q0 + r) * a.q_stride[0] + (i64)head * a.q_stride[1] + col : q;
    cp_async16(sm.q + (u32)(atom * BM * kAtomRowBytes) + swizzle128(r, chunk), src, ok ? 16 : 0);
  }
  mbar_arrive_cp_async(sm.q_full);
}

// Producer warp pw of one work item: its rows of the query (unless the consumers or the persistent feeder stage it),
// then of every visited tile, the last tile first (16-bit caches: produce_16; `ring` carries the ring's position
// across the persistent grid's items).
// FP8: tile it + 1's codes and scales land in raw slot (it + 1) % 2 while tile it is converted from slot
// it % 2 into the ring (tile t's elements are ring positions t * (kKElems + 1) + e, V last). FP8_SCORES: the
// raw slot holds V only; the K element's codes go straight into the ring, with its rows' scales beside it,
// when the tile is issued (a tile ahead of V's conversion: the ring fills out of order, which the
// per-element barriers allow). The codes come one of two ways:
// - kTma: lane j looks up row j (lookup below), and every TMA_ROWS-th lane issues a tensor copy of the box starting
//   at its row (a box stays within a page and within the warp's rows). The lanes still copy their rows'
//   scales with cp.async, so raw_full[t % 2] (and a K element's full barrier) completes when the boxes'
//   bytes and every lane's scale copies have landed. Rows past the sequence arrive as the cache holds them
//   (unused slots may be NaN): the last tile's conversion zeroes them and the consumers' mask drops their K
//   columns (a select). Holes, and boxes wholly past the sequence, take page -1: outside the tensor, which
//   TMA reads as zeros. A __syncwarp orders the refill of a warp's rows after its lanes' reads of them.
// - cp.async: each lane copies 16-code chunks and converts exactly the codes it copied (its own
//   cp.async.wait_group orders those); a row's scales come from the row's lane, so a __syncwarp follows the
//   wait. Refilling a slot is ordered after every lane's reads of it by the full-warp shuffles at the start
//   of copy_raw_fp8 (before its scale copies), which no lane passes before all have finished converting.
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::produce(const PrefillArgs& a, const PrefillMaps* maps,
                                                               const Smem& sm, const Buf& buf, const Cache& cache,
                                                               int b, int kv_head, int head, int q_begin, int q0,
                                                               int rows, int kv_len, int n_first, int n_tiles,
                                                               int vslice, int pw, int lane, Ring& ring) {
  if constexpr (!FP8_SCORES && !PERSISTENT) load_query(a, sm, head, q_begin, q0, rows, pw, lane);

  if constexpr (QUANTIZED) {
    produce_fp8(a, maps, sm, buf, cache, b, kv_head, kv_len, n_first, n_tiles, vslice, pw, lane);
  } else {
    const KVT* kbase = static_cast<const KVT*>(a.kv.k);
    const KVT* vbase = static_cast<const KVT*>(a.kv.v);
    constexpr int kWarpRows = BN / Buf::kProducerWarps;
    // this lane's row's table entry for the last tile (produce_16 looks up the rest one tile ahead)
    auto lookup = [&](int n) -> i64 {
      const int tok = n * BN + pw * kWarpRows + lane;
      return (lane < kWarpRows && tok < kv_len) ? cache.row_key(b, tok) : (i64)-1;
    };
    static_assert(kWarpRows <= 32, "BN <= 128: one row per producer lane");
    i64 key_next = n_tiles > 0 ? lookup(n_first + n_tiles - 1) : (i64)-1;
    produce_16(a, maps, sm, buf, cache, b, kv_head, kv_len, n_first, n_tiles, vslice, pw, lane, key_next, kbase, vbase, ring);
  }
  // leave only after every copy has landed (PERSISTENT: the ring's position carries into the next item)
  if constexpr (!PERSISTENT) asm volatile("cp.async.wait_all;" ::: "memory");
}

// FP8 cache: tile n's codes and scales into raw slot t % 2 (FP8_SCORES: its K codes straight into the ring), by
// tensor copies or cp.async (produce's protocol above); key_lane: this lane's table entry of tile n (lookup);
// kKsMma: this lane's row's K scale comes back in ks_held, for ring element ks_stage.
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::issue_fp8(const PrefillArgs& a, const PrefillMaps* maps,
                                                                 const Smem& sm, const Buf& buf, const Cache& cache,
                                                                 int b, int kv_head, int kv_len, int vslice, int pw,
                                                                 int lane, const KVT* kbase, const KVT* vbase, int n,
                                                                 i64 key_lane, int t, float& ks_held, int& ks_stage) {
  constexpr int kWarpRows = BN / Buf::kProducerWarps;
  auto lane_tok = [&](int n) -> int { return n * BN + pw * kWarpRows + lane; };  // this lane's token of tile n
  // this lane's row of tile n (a cache row), or -1 when it reads as zeros
  auto lane_row = [&](int n, i64 key_lane) -> i64 {
    const int tok_lane = lane_tok(n);
    return (lane < kWarpRows && tok_lane < kv_len) ? cache.row_from_key(key_lane, tok_lane) : (i64)-1;
  };
  // TMA: (page, token in the page) of the box that starts at this lane's row of tile n. Paged: from the checked
  // row `row` (a box stays in one page, so its rows share the entry's check; page -1 is outside the tensor and
  // reads as zeros). Contiguous (k/v seen as one page): the unchecked row, whose rows outside k/v read as zeros,
  // as cp.async's holes do.
  auto box_coords = [&](int n, i64 key_lane, i64 row) -> int2 {
    if constexpr (PAGE_SIZE > 0)
      return row >= 0 ? make_int2((int)(row / PAGE_SIZE), (int)(row % PAGE_SIZE)) : make_int2(-1, 0);
    else
      return make_int2(0, (int)(key_lane + lane_tok(n)));
  };
  // TMA straight into ring element `stage` (the leading lane of a box): one box of this lane's TMA_ROWS rows per
  // 128-byte swizzle atom, from byte column `col_bytes` of the map's rows, counted on the element's full barrier
  auto ring_boxes = [&](int stage, const CUtensorMap* map, int col_bytes, int atoms, int2 box) {
    const u32 bar = sm.full + 8 * stage;
    mbar_expect_tx(bar, atoms * TMA_ROWS * kAtomRowBytes);
#pragma unroll
    for (int atom = 0; atom < atoms; ++atom)
      tma_load_4d(buf.element(stage) + (u32)((atom * BN + pw * kWarpRows + lane) * kAtomRowBytes), map,
                  col_bytes + atom * kAtomRowBytes, kv_head, box.y, box.x, bar);
  };
  auto row_offsets = [&](int n, i64 key_lane, i64& k_lane, i64& v_lane, i64& ks_lane, i64& vs_lane) {
    k_lane = -1, v_lane = -1, ks_lane = 0, vs_lane = 0;
    const i64 row = lane_row(n, key_lane);
    if (row >= 0) {
      k_lane = Cache::offset(a.kv.k_stride, row, kv_head, 0);
      v_lane = Cache::offset(a.kv.v_stride, row, kv_head, 0);
      if constexpr (QUANTIZED && SCALE_BLOCK > 0) {
        ks_lane = cache.template scale_ptr<SCALE_BLOCK>(true, row, kv_head, 0) - a.kv.k_scales;
        vs_lane = cache.template scale_ptr<SCALE_BLOCK>(false, row, kv_head, 0) - a.kv.v_scales;
      }
    }
  };
  auto row_of = [&](i64 x, int i) -> i64 { return __shfl_sync(0xffffffffu, x, (lane / 8 + 4 * i) % 32); };
  // FP8_SCORES with token scales: the lane's row's K scale beside the K element in ring slot `stage` (zero for
  // a row that reads as zeros)
  auto copy_k_scale = [&](int stage, bool ok, const float* src) {
    if (lane < kWarpRows)
      cp_async4(sm.kscale + (u32)((stage * BN + pw * kWarpRows + lane) * 4), ok ? src : a.kv.k_scales, ok ? 4 : 0);
  };
  const u32 slot = sm.raw + (u32)((t & 1) * kRawTileBytes);
  const u32 vdst = slot + (u32)((FP8_SCORES ? 0 : kKElems) * kRawElemBytes);
  const Ring at{t * (kKElems + 1)};  // FP8_SCORES: the K element's ring position
  const int stage = at.stage();
  if constexpr (kTma) {
    const int r0 = pw * kWarpRows + lane;
    const i64 row = lane_row(n, key_lane);
    const u32 raw_bar = sm.raw_full + 8 * (t & 1);
    __syncwarp();  // the warp's lanes have read their rows of this slot (tile t - 2) before it is refilled
    // the scales first: their offsets die before the boxes' coordinates are formed
    if constexpr (FP8_SCORES) {
      mbar_wait(sm.empty + 8 * stage, at.empty_phase());
      if constexpr (kKsMma) {
        // held in a register until split_k_scales, after the next raw wait has hidden the load
        ks_held = row >= 0 ? __ldg(cache.template scale_ptr<SCALE_BLOCK>(true, row, kv_head, 0)) : 0.f;
        ks_stage = stage;
      } else if constexpr (SCALE_BLOCK > 0)
        copy_k_scale(stage, row >= 0, cache.template scale_ptr<SCALE_BLOCK>(true, row, kv_head, 0));
    } else if constexpr (SCALE_BLOCK > 0) {
      const i64 ks_lane =
          row >= 0 ? cache.template scale_ptr<SCALE_BLOCK>(true, row, kv_head, 0) - a.kv.k_scales : 0;
#pragma unroll
      for (int e = 0; e < kKElems; ++e)
        buf.template copy_raw_scales<SCALE_BLOCK>(slot + (u32)(e * kRawElemBytes), a.kv.k_scales, row, ks_lane,
                                                  e * BK, min(BK, DEPTH - e * BK), pw, lane);
    }
    if constexpr (SCALE_BLOCK > 0) {
      const i64 vs_lane =
          row >= 0 ? cache.template scale_ptr<SCALE_BLOCK>(false, row, kv_head, 0) - a.kv.v_scales : 0;
      buf.template copy_raw_scales<SCALE_BLOCK>(vdst, a.kv.v_scales, row, vs_lane, vslice * kVCols, kVCols, pw,
                                                lane);
    }
    if (lane < kWarpRows && lane % TMA_ROWS == 0) {
      const int2 box = box_coords(n, key_lane, row);
      const int page = box.x, tip = box.y;
      if constexpr (FP8_SCORES) {
        ring_boxes(stage, &maps->k, 0, Buf::code_atoms, box);
      } else {
#pragma unroll
        for (int e = 0; e < kKElems; ++e) {
          mbar_expect_tx(raw_bar, TMA_ROWS * BK);
          tma_load_4d(slot + (u32)(e * kRawElemBytes + r0 * BK), &maps->k, e * BK, kv_head, tip, page, raw_bar);
        }
      }
      mbar_expect_tx(raw_bar, TMA_ROWS * BK);
      tma_load_4d(vdst + (u32)(r0 * BK), &maps->v, vslice * kVCols, kv_head, tip, page, raw_bar);
    }
    if constexpr (FP8_SCORES && !kKsMma) mbar_arrive_cp_async(sm.full + 8 * stage);
    mbar_arrive_cp_async(raw_bar);
  } else {
    i64 k_lane, v_lane, ks_lane, vs_lane;
    row_offsets(n, key_lane, k_lane, v_lane, ks_lane, vs_lane);
    if constexpr (FP8_SCORES) {
      mbar_wait(sm.empty + 8 * stage, at.empty_phase());
      buf.load_codes_from_dram(stage, kbase, [&](int i) { return row_of(k_lane, i); }, pw, lane);
      if constexpr (SCALE_BLOCK > 0) copy_k_scale(stage, k_lane >= 0, a.kv.k_scales + ks_lane);
      mbar_arrive_cp_async(sm.full + 8 * stage);
    } else {
#pragma unroll
      for (int e = 0; e < kKElems; ++e)
        buf.template copy_raw_fp8<SCALE_BLOCK>(slot + (u32)(e * kRawElemBytes), kbase, a.kv.k_scales,
                                               [&](int r) { return __shfl_sync(0xffffffffu, k_lane, r); }, k_lane,
                                               ks_lane, e * BK, min(BK, DEPTH - e * BK), pw, lane);
    }
    buf.template copy_raw_fp8<SCALE_BLOCK>(vdst, vbase, a.kv.v_scales,
                                           [&](int r) { return __shfl_sync(0xffffffffu, v_lane, r); }, v_lane,
                                           vs_lane, vslice * kVCols, kVCols, pw, lane);
  }
}

// FP8 cache (produce's protocol above): the K/V codes and scales of every visited tile, the last tile first:
// tile it + 1 is issued (issue_fp8) while tile it is converted into the ring.
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::produce_fp8(const PrefillArgs& a, const PrefillMaps* maps,
                                                                   const Smem& sm, const Buf& buf, const Cache& cache,
                                                                   int b, int kv_head, int kv_len, int n_first,
                                                                   int n_tiles, int vslice, int pw, int lane) {
  const KVT* kbase = static_cast<const KVT*>(a.kv.k);
  const KVT* vbase = static_cast<const KVT*>(a.kv.v);
  float k_tensor_scale = 0.f, v_tensor_scale = 0.f;
  if constexpr (QUANTIZED && SCALE_BLOCK == 0) {
    k_tensor_scale = cache.template load_scale<0>(true, 0, 0, 0);
    v_tensor_scale = cache.template load_scale<0>(false, 0, 0, 0);
  }
  constexpr int kWarpRows = BN / Buf::kProducerWarps;
  // Lane j of a producer warp loads the table entry of the warp's j-th row one tile ahead (row_key: the
  // load's latency hides behind this tile's copies) and forms that row's 64-bit K and V offsets (and FP8
  // scale offsets) from it once (row_from_key checks the entry there); every lane that copies a chunk of
  // that row takes them by shuffle, so the address math is not repeated.
  auto lane_tok = [&](int n) -> int { return n * BN + pw * kWarpRows + lane; };  // this lane's token of tile n
  auto lookup = [&](int n) -> i64 {
    const int tok = lane_tok(n);
    return (lane < kWarpRows && tok < kv_len) ? cache.row_key(b, tok) : (i64)-1;
  };
  static_assert(kWarpRows <= 32, "BN <= 128: one row per producer lane");
  i64 key_next = n_tiles > 0 ? lookup(n_first + n_tiles - 1) : (i64)-1;
  float ks_held = 0.f;  // kKsMma: this lane's row's K scale of the tile issued last, for ring element ks_stage
  int ks_stage = 0;
  // kKsMma: B of the K-scale wgmma (see kKsMma) for the K element issued last, then its full barrier
  auto split_k_scales = [&] {
    if constexpr (kKsMma) {
      const int r = pw * kWarpRows + lane;
      if (lane < kWarpRows) {
        const uint2 t = bf16x3_from_float(ks_held);
        const u32 dst = sm.kscale + (u32)(kKsOnesBytes + (ks_stage * (BN / 2) + r % (BN / 2)) * kKsRowBytes +
                                          (r / (BN / 2)) * 8);
        asm volatile("st.shared.v2.u32 [%0], {%1,%2};" ::"r"(dst), "r"(t.x), "r"(t.y) : "memory");
        fence_proxy_async();
      }
      mbar_arrive(sm.full + 8 * ks_stage);
    }
  };
  if (n_tiles > 0) {
    const i64 key_lane = key_next;
    if (n_tiles > 1) key_next = lookup(n_first + n_tiles - 2);
    issue_fp8(a, maps, sm, buf, cache, b, kv_head, kv_len, vslice, pw, lane, kbase, vbase, n_first + n_tiles - 1,
              key_lane, 0, ks_held, ks_stage);
    split_k_scales();  // the first tile's: nothing to hide its load behind
  }
  if constexpr (!kTma) cp_async_commit();
  for (int it = 0; it < n_tiles; ++it) {
    const int n = n_first + n_tiles - 1 - it;
    trace_mark(it, 0);
    if (it + 1 < n_tiles) {
      const i64 key_lane = key_next;
      if (it + 2 < n_tiles) key_next = lookup(n - 2);
      issue_fp8(a, maps, sm, buf, cache, b, kv_head, kv_len, vslice, pw, lane, kbase, vbase, n - 1, key_lane, it + 1,
                ks_held, ks_stage);
    }
    trace_mark(it, 1);
    if constexpr (kTma) {
      mbar_wait(sm.raw_full + 8 * (it & 1), (it >> 1) & 1);
    } else {
      cp_async_commit();
      cp_async_wait<1>();  // this lane's copies of tile it have landed
      __syncwarp();        // and the scales its row's lane copied
    }
    if (it + 1 < n_tiles) split_k_scales();
    trace_mark(it, 2);
    const u32 slot = sm.raw + (u32)((it & 1) * kRawTileBytes);
    const int valid = kv_len - n * BN;  // rows of this tile inside the sequence (TMA: the rest must be zeroed)
#pragma unroll
    for (int e = FP8_SCORES ? kKElems : 0; e <= kKElems; ++e) {
      const Ring at{it * (kKElems + 1) + e};
      const int stage = at.stage();
      const u32 src = slot + (u32)((FP8_SCORES ? 0 : e) * kRawElemBytes);
      const float ts = e < kKElems ? k_tensor_scale : v_tensor_scale;
      auto wait_slot = [&] {
        mbar_wait(sm.empty + 8 * stage, at.empty_phase());
        trace_mark(it, 3);
      };
      // V with a per-tensor scale goes in as its codes (kVCodes); the TMA producer's last tile zeroes the rows
      // past the sequence, full tiles pay nothing for that
      auto convert = [&](auto codes) {
        constexpr bool kCodes = decltype(codes)::value;
        if (kTma && valid < BN)
          buf.template convert_raw_fp8<SCALE_BLOCK, true, kCodes, kConvPairs>(stage, src, ts, pw, lane, wait_slot, valid);
        else
          buf.template convert_raw_fp8<SCALE_BLOCK, false, kCodes, kConvPairs>(stage, src, ts, pw, lane, wait_slot);
      };
      if (e == kKElems)
        convert(Bool<kVCodes>());
      else
        convert(Bool<false>());
      fence_proxy_async();  // generic-proxy stores -> the consumers' wgmma reads
      mbar_arrive(sm.full + 8 * stage);
    }
    trace_mark(it, 4);
  }
}

// 16-bit cache: each tile's K elements and V element straight into the ring
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::produce_16(const PrefillArgs& a, const PrefillMaps* maps,
                                                                  const Smem& sm, const Buf& buf, const Cache& cache,
                                                                  int b, int kv_head, int kv_len, int n_first,
                                                                  int n_tiles, int vslice, int pw, int lane,
                                                                  i64 key_next, const KVT* kbase, const KVT* vbase,
                                                                  Ring& ring) {
  constexpr int kWarpRows = BN / Buf::kProducerWarps;
  // Lane j of a producer warp loads the table entry of the warp's j-th row one tile ahead (row_key: the
  // load's latency hides behind this tile's copies) and forms that row's 64-bit K and V offsets (and FP8
  // scale offsets) from it once (row_from_key checks the entry there); every lane that copies a chunk of
  // that row takes them by shuffle, so the address math is not repeated.
  auto lane_tok = [&](int n) -> int { return n * BN + pw * kWarpRows + lane; };  // this lane's token of tile n
  auto lookup = [&](int n) -> i64 {
    const int tok = lane_tok(n);
    return (lane < kWarpRows && tok < kv_len) ? cache.row_key(b, tok) : (i64)-1;
  };
  static_assert(kWarpRows <= 32, "BN <= 128: one row per producer lane");
  // this lane's row of tile n (a cache row), or -1 when it reads as zeros
  auto lane_row = [&](int n, i64 key_lane) -> i64 {
    const int tok_lane = lane_tok(n);
    return (lane < kWarpRows && tok_lane < kv_len) ? cache.row_from_key(key_lane, tok_lane) : (i64)-1;
  };
  // TMA: (page, token in the page) of the box that starts at this lane's row of tile n. Paged: from the checked
  // row `row` (a box stays in one page, so its rows share the entry's check; page -1 is outside the tensor and
  // reads as zeros). Contiguous (k/v seen as one page): the unchecked row, whose rows outside k/v read as zeros,
  // as cp.async's holes do.
  auto box_coords = [&](int n, i64 key_lane, i64 row) -> int2 {
    if constexpr (PAGE_SIZE > 0)
      return row >= 0 ? make_int2((int)(row / PAGE_SIZE), (int)(row % PAGE_SIZE)) : make_int2(-1, 0);
    else
      return make_int2(0, (int)(key_lane + lane_tok(n)));
  };
  // TMA straight into ring element `stage` (the leading lane of a box): one box of this lane's TMA_ROWS rows per
  // 128-byte swizzle atom, from byte column `col_bytes` of the map's rows, counted on the element's full barrier
  auto ring_boxes = [&](int stage, const CUtensorMap* map, int col_bytes, int atoms, int2 box) {
    const u32 bar = sm.full + 8 * stage;
    mbar_expect_tx(bar, atoms * TMA_ROWS * kAtomRowBytes);
#pragma unroll
    for (int atom = 0; atom < atoms; ++atom)
      tma_load_4d(buf.element(stage) + (u32)((atom * BN + pw * kWarpRows + lane) * kAtomRowBytes), map,
                  col_bytes + atom * kAtomRowBytes, kv_head, box.y, box.x, bar);
  };
  auto row_offsets = [&](int n, i64 key_lane, i64& k_lane, i64& v_lane, i64& ks_lane, i64& vs_lane) {
    k_lane = -1, v_lane = -1, ks_lane = 0, vs_lane = 0;
    const i64 row = lane_row(n, key_lane);
    if (row >= 0) {
      k_lane = Cache::offset(a.kv.k_stride, row, kv_head, 0);
      v_lane = Cache::offset(a.kv.v_stride, row, kv_head, 0);
      if constexpr (QUANTIZED && SCALE_BLOCK > 0) {
        ks_lane = cache.template scale_ptr<SCALE_BLOCK>(true, row, kv_head, 0) - a.kv.k_scales;
        vs_lane = cache.template scale_ptr<SCALE_BLOCK>(false, row, kv_head, 0) - a.kv.v_scales;
      }
    }
  };
  auto row_of = [&](i64 x, int i) -> i64 { return __shfl_sync(0xffffffffu, x, (lane / 8 + 4 * i) % 32); };
  for (int it = 0; it < n_tiles; ++it) {
    const int n = n_first + n_tiles - 1 - it;
    const i64 key_lane = key_next;
    if (it + 1 < n_tiles) key_next = lookup(n - 1);
    // kTma: a tile wholly inside the sequence comes as tensor copies straight into the ring (every TMA_ROWS-th
    // lane issues one box of its rows per 64-dim atom). The tile holding the sequence's end keeps the
    // cp.async path below: its zero fill past the sequence is what keeps unused (possibly NaN) slots out of
    // P V, where a masked score's zero weight would still multiply them.
    if constexpr (kTma) {
      if ((n + 1) * BN <= kv_len) {
        const int2 box = box_coords(n, key_lane, PAGE_SIZE > 0 ? lane_row(n, key_lane) : (i64)-1);
        const bool lead = lane < kWarpRows && lane % TMA_ROWS == 0;
#pragma unroll
        for (int e = 0; e <= kKElems; ++e) {
          const int stage = ring.stage();
          trace_mark(it, 2 * min(e, 1));
          mbar_wait(sm.empty + 8 * stage, ring.empty_phase());
          trace_mark(it, 2 * min(e, 1) + 1);
          if (lead) {
            // dims of this element: a K element's BK, or V's slice; boxes past the head read as zeros
            const int col0 = e < kKElems ? e * BK : vslice * kVCols;
            const int ncols = e < kKElems ? min(BK, DEPTH - e * BK) : kVCols;
            ring_boxes(stage, e < kKElems ? &maps->k : &maps->v, col0 * (int)sizeof(T), (ncols + 63) / 64, box);
          }
          mbar_arrive(sm.full + 8 * stage);
          ring.advance();
        }
        trace_mark(it, 4);
        continue;
      }
    }
    i64 k_lane, v_lane, ks_lane, vs_lane;
    row_offsets(n, key_lane, k_lane, v_lane, ks_lane, vs_lane);
    auto koff = [&](int i) -> i64 { return row_of(k_lane, i); };
    auto voff = [&](int i) -> i64 { return row_of(v_lane, i); };
#pragma unroll
    for (int e = 0; e <= kKElems; ++e) {
      const int stage = ring.stage();
      trace_mark(it, 2 * min(e, 1));  // events 0-1: the (last) K element's slot; 2-3: V's
      mbar_wait(sm.empty + 8 * stage, ring.empty_phase());
      trace_mark(it, 2 * min(e, 1) + 1);
      if (e < kKElems)
        buf.load_from_dram(stage, kbase, koff, e * BK, min(BK, DEPTH - e * BK), pw, lane);
      else
        buf.load_from_dram(stage, vbase, voff, vslice * kVCols, kVCols, pw, lane);
      mbar_arrive_cp_async(sm.full + 8 * stage);
      ring.advance();
    }
    trace_mark(it, 4);
  }
}

// PERSISTENT, 16-bit cache: the producer warpgroup walks the work items as convert-once's warp 0 does
// (feed_persistent), all four warps issuing each tile's boxes as the launch-per-item producer does (produce). Warp 0
// stages each item's query once the consumers are done with the last one and takes the next item from the counter
// once this one's tiles are issued; the other warps read its index from shared memory after the producers' named
// barrier (two slots, so a slot is rewritten only after every warp has passed the barrier that follows its read).
// The counter resets itself: the last block to finish zeroes it, so a launch needs no memset (CUDA graphs replay it).
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::feed_persistent_16(const PrefillArgs& a, const PrefillMaps* maps,
    const OnceArgs& o, const CUtensorMap* qmap, const Smem& sm, const Buf& buf, const Cache& cache, int pw, int lane) {
  Ring ring{0};
  feed_items(a, o, qmap, sm, cache, pw, lane, [&](const Item& t) {
    produce(a, maps, sm, buf, cache, t.b, t.kv_head, t.head, t.q_begin, t.q0, t.rows, t.kv_len, t.n_first,
            t.n_tiles, 0, pw, lane, ring);
  });
}

// The walk itself (feed_persistent_16's, and the MLA prefill's with its own producer): item by item from the
// counter, each staged for the consumers by warp 0, then produce_item(t) by all four producer warps.
template <class Traits>
template <class ProduceItem>
__device__ __forceinline__ void PrefillKernel<Traits>::feed_items(const PrefillArgs& a, const OnceArgs& o,
                                                                  const CUtensorMap* qmap, const Smem& sm,
                                                                  const Cache& cache, int pw, int lane,
                                                                  ProduceItem&& produce_item) {
  const int total = o.num_work * a.num_qo_heads;
  int idx = blockIdx.x;
  for (int i = 0;; ++i) {
    Item t;
    t.b = -1;
    if (idx < total) t = make_item(a, &o, cache, idx);
    if (pw == 0) {
      if (i > 0) mbar_wait(sm.q_empty, (i - 1) & 1);  // the consumers are done with the staged query and item
      if (lane == 0) stage_item(sm, qmap, t);
    }
    if (t.b < 0) break;
    produce_item(t);
    const u32 slot = sm.next + (u32)(4 * (i & 1));
    if (pw == 0 && lane == 0)
      asm volatile("st.shared.u32 [%0], %1;" :: "r"(slot), "r"((int)gridDim.x + atomicAdd(o.flags - 2, 1)) : "memory");
    asm volatile("bar.sync 15, 128;" ::: "memory");  // the producer warpgroup (15: no other user)
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(idx) : "r"(slot) : "memory");
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  if (pw == 0 && lane == 0) {
    __threadfence();  // this block's last take of the counter, before its count of finished blocks
    if (atomicAdd(o.flags - 3, 1) == (int)gridDim.x - 1) {
      atomicExch(o.flags - 2, 0);
      atomicExch(o.flags - 3, 0);
    }
  }
}

}  // namespace cukv
