// MLAKVProducerPipeline: the K/V producer of the non-absorbed MLA prefill (MAX's SM100 MLA prefill, in cukv's Hopper
// ring). Each key tile is one ring element of BN rows x 192 dims, three 128-byte swizzle atoms: atoms 0-1 are this
// head's k_nope rows (BN x 128, from the caller's up-projected [Tk, H, 128] buffer, ragged by kv_offsets), atom 2 is
// the k_rope rows (BN x 64, shared by every head: columns 512..575 of the paged MLA latent cache through its page
// table, or a contiguous [Tk, 64] array). V (BN x 128 of the same buffer layout) passes through the same stage slots,
// in atoms 0-1 of the next element. The consumer (prefill_consumer.cuh) reads K as a 192-deep operand and V as a
// 128-wide one, so no per-head copy of k_rope ever exists.
//
// The seed's vocabulary: acquire_kv waits for a free stage, get_k / get_v issue a tile's copies into it, commit_kv_step
// hands the stage to the consumers (its full barrier completes when every producer lane's copies land) and steps the
// ring. num_qk_stages is 1: one element holds the whole 192-deep K.
//
// TMA_ROWS > 0 (tensor copies): a tile wholly inside its sequence comes as boxes straight into the ring (128-byte
// swizzle, the ring's layout): k_nope and v in boxes of TMA_ROWS tokens x one head x 64 dims from 3-d tensor maps
// over the caller's [Tk, H, 128] arrays; the rope rows in boxes of ROPE_ROWS tokens of one page (ROPE_ROWS 0: a page
// smaller than a swizzle group, the rope rows by cp.async beside the boxes). The tile holding a sequence's end keeps
// the cp.async path: its zero fill keeps rows past the sequence (which may be NaN) out of P V.
#pragma once
#include "kv_buffer.cuh"

namespace cukv {

// The MLA prefill's own arguments, beside PrefillArgs (whose kv describes the rope source), as cukv/operand.py packs
// them (MLA_PREFILL_ARGS).
struct alignas(8) MLAPrefillArgs {
  const void* k_nope;     // [Tk, H, 128]
  const void* v;          // [Tk, H, 128]
  const int* kv_offsets;  // [B + 1]: sequence b's k_nope / v rows
  i64 kn_stride[2];       // elements: token, head
  i64 v_stride[2];
};

// TMA_ROWS > 0: the tensor maps, encoded by cukv/ops/mla_prefill.py over bytes: k_nope and v as [1][Tk][H][256]
// (boxes of 128 bytes x 1 head x TMA_ROWS tokens), the rope rows as [pages][page_size][1][128] (boxes of ROPE_ROWS
// tokens; a contiguous k_rope is one page), all with the 128-byte swizzle
struct alignas(64) MLAPrefillMaps {
  CUtensorMap k_nope, v, k_rope;
};

template <typename T, int BN_, int STAGES_, int PAGE_SIZE_, int TMA_ROWS = 0, int ROPE_ROWS = 0>
struct MLAKVProducerPipeline {
  static constexpr int BN = BN_, num_kv_stages = STAGES_, num_qk_stages = 1;
  static constexpr bool kTma = TMA_ROWS > 0, kRopeByCpAsync = !kTma || ROPE_ROWS == 0;
  static constexpr int kTmaRows = kTma ? TMA_ROWS : 1;  // a divisor where TMA_ROWS is 0
  static constexpr int k_nope_depth = 128, k_rope_depth = 64, v_depth = 128, depth = k_nope_depth + k_rope_depth;
  // the seed's derived sizes (cukv/configs/mla_prefill.py computes the same; the rendered source compares them)
  static constexpr int k_nope_elements = BN * k_nope_depth, k_rope_elements = BN * k_rope_depth;
  static constexpr int k_elements = k_nope_elements + k_rope_elements, v_elements = BN * v_depth;
  static constexpr int k_nope_bytes = k_nope_elements * (int)sizeof(T), k_rope_bytes = k_rope_elements * (int)sizeof(T);
  static constexpr int k_bytes = k_nope_bytes + k_rope_bytes, v_bytes = v_elements * (int)sizeof(T);

  typedef KVBuffer<T, BN, depth, depth, STAGES_> Buf;  // one element: the whole 192-deep K, or V in its first atoms
  typedef RingState<STAGES_> Ring;
  typedef KVCacheOperand<T, PAGE_SIZE_, false> RopeCache;  // PAGE_SIZE_ 0: contiguous [Tk, 64] rows
  static constexpr int kNopeAtoms = k_nope_depth / kAtomCols, kRopeAtom = kNopeAtoms, kVAtoms = v_depth / kAtomCols;
  static constexpr int kWarpRows = BN / Buf::kProducerWarps;
  static_assert(k_bytes == Buf::stage_bytes && v_bytes <= Buf::stage_bytes, "K fills an element; V fits in one");
  static_assert(kWarpRows <= 32, "BN <= 128: one row per producer lane");
  static_assert(!kTma || (TMA_ROWS % 8 == 0 && kWarpRows % TMA_ROWS == 0 &&
                          (ROPE_ROWS == 0 || (ROPE_ROWS % 8 == 0 && TMA_ROWS % ROPE_ROWS == 0 &&
                                              (PAGE_SIZE_ == 0 || PAGE_SIZE_ % ROPE_ROWS == 0)))),
                "TMA boxes: whole 8-row swizzle groups within a producer warp's rows (the rope's: within a page)");

  Buf buf;
  u32 full, empty;  // the ring's barriers (element s at + 8 s)
  Ring ring;

  __device__ __forceinline__ MLAKVProducerPipeline(u32 ring_base, u32 full_bars, u32 empty_bars)
      : full(full_bars), empty(empty_bars), ring{0} {
    buf.ring = ring_base;
  }

  // wait until the consumers have released the next stage
  __device__ __forceinline__ void acquire_kv() const { mbar_wait(empty + 8 * ring.stage(), ring.empty_phase()); }

  // K of one tile into the acquired stage. Producer warp pw's lane copies 16-byte chunk lane % 8 of its rows
  // (KVBuffer's layout); the row's element offsets come from the lane that formed them (nope(i), rope(i): -1 reads
  // as zeros, which a row past the sequence or a page hole does).
  template <typename NopeOffset, typename RopeOffset>
  __device__ __forceinline__ void get_k(const T* k_nope, NopeOffset nope, const T* k_rope, RopeOffset rope, int pw,
                                        int lane) const {
    const u32 dst0 = buf.element(ring.stage());
    const int chunk = lane % 8;
#pragma unroll
    for (int i = 0; i < Buf::kRowsPerLane; ++i) {
      const int r = pw * kWarpRows + lane / 8 + 4 * i;
      const i64 kn = nope(i), kr = rope(i);
#pragma unroll
      for (int atom = 0; atom < kNopeAtoms; ++atom)
        cp_async16(dst0 + (u32)(atom * BN * kAtomRowBytes) + swizzle128(r, chunk),
                   kn >= 0 ? k_nope + kn + atom * kAtomCols + chunk * 8 : k_nope, kn >= 0 ? 16 : 0);
      cp_async16(dst0 + (u32)(kRopeAtom * BN * kAtomRowBytes) + swizzle128(r, chunk),
                 kr >= 0 ? k_rope + kr + chunk * 8 : k_rope, kr >= 0 ? 16 : 0);
    }
  }

  // V of one tile into atoms 0..kVAtoms-1 of the acquired stage (the third atom is never read for V)
  template <typename VOffset>
  __device__ __forceinline__ void get_v(const T* v, VOffset voff, int pw, int lane) const {
    const u32 dst0 = buf.element(ring.stage());
    const int chunk = lane % 8;
#pragma unroll
    for (int i = 0; i < Buf::kRowsPerLane; ++i) {
      const int r = pw * kWarpRows + lane / 8 + 4 * i;
      const i64 vo = voff(i);
#pragma unroll
      for (int atom = 0; atom < kVAtoms; ++atom)
        cp_async16(dst0 + (u32)(atom * BN * kAtomRowBytes) + swizzle128(r, chunk),
                   vo >= 0 ? v + vo + atom * kAtomCols + chunk * 8 : v, vo >= 0 ? 16 : 0);
    }
  }

  // K of a tile wholly inside the sequence by tensor copies: lane % TMA_ROWS == 0 leads the k_nope boxes of its
  // TMA_ROWS rows (token nope_row of the [Tk, H, 128] map, head `head`), lane % ROPE_ROWS == 0 the rope box at
  // rope_box (page, token in the page; page -1 reads as zeros). ROPE_ROWS 0: the rope rows by cp.async (get_k's).
  template <typename RopeOffset>
  __device__ __forceinline__ void get_k_tma(const MLAPrefillMaps& maps, int head, int nope_row, int2 rope_box,
                                            const T* k_rope, RopeOffset rope, int pw, int lane) const {
    const u32 dst0 = buf.element(ring.stage()), bar = full + 8 * ring.stage();
    const int r = pw * kWarpRows + lane;
    const bool lead_nope = lane < kWarpRows && lane % kTmaRows == 0;
    const bool lead_rope = ROPE_ROWS > 0 && lane < kWarpRows && lane % (ROPE_ROWS > 0 ? ROPE_ROWS : 1) == 0;
    const int bytes = (lead_nope ? kNopeAtoms * TMA_ROWS * kAtomRowBytes : 0) + (lead_rope ? ROPE_ROWS * kAtomRowBytes : 0);
    if (bytes) mbar_expect_tx(bar, bytes);
    if (lead_nope) {
#pragma unroll
      for (int atom = 0; atom < kNopeAtoms; ++atom)
        tma_load_4d(dst0 + (u32)((atom * BN + r) * kAtomRowBytes), &maps.k_nope, atom * kAtomRowBytes, head, nope_row, 0,
                    bar);
    }
    if (lead_rope)
      tma_load_4d(dst0 + (u32)((kRopeAtom * BN + r) * kAtomRowBytes), &maps.k_rope, 0, 0, rope_box.y, rope_box.x, bar);
    if constexpr (ROPE_ROWS == 0) {
      const int chunk = lane % 8;
#pragma unroll
      for (int i = 0; i < Buf::kRowsPerLane; ++i) {
        const int rr = pw * kWarpRows + lane / 8 + 4 * i;
        const i64 kr = rope(i);
        cp_async16(dst0 + (u32)(kRopeAtom * BN * kAtomRowBytes) + swizzle128(rr, chunk),
                   kr >= 0 ? k_rope + kr + chunk * 8 : k_rope, kr >= 0 ? 16 : 0);
      }
    }
  }

  // V of a tile wholly inside the sequence by tensor copies (get_k_tma's k_nope boxes, from the v map)
  __device__ __forceinline__ void get_v_tma(const MLAPrefillMaps& maps, int head, int v_row, int pw, int lane) const {
    const u32 dst0 = buf.element(ring.stage()), bar = full + 8 * ring.stage();
    if (lane < kWarpRows && lane % kTmaRows == 0) {
      mbar_expect_tx(bar, kVAtoms * TMA_ROWS * kAtomRowBytes);
#pragma unroll
      for (int atom = 0; atom < kVAtoms; ++atom)
        tma_load_4d(dst0 + (u32)((atom * BN + pw * kWarpRows + lane) * kAtomRowBytes), &maps.v, atom * kAtomRowBytes,
                    head, v_row, 0, bar);
    }
  }

  // the stage is the consumers' once this lane's copies land (each of the 128 producer lanes arrives; a lane whose
  // part came only by tensor copies, counted on the barrier's bytes, arrives at once: by_cp_async false); next stage
  __device__ __forceinline__ void commit_kv_step(bool by_cp_async = true) {
    if (by_cp_async)
      mbar_arrive_cp_async(full + 8 * ring.stage());
    else
      mbar_arrive(full + 8 * ring.stage());
    ring.advance();
  }
};

}  // namespace cukv
