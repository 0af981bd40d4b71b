// KVBuffer: the prefill KV staging struct (after MAX's KVBuffer). DRAM -> shared memory through a ring of
// STAGES elements filled by cp.async (zero fill for rows past the sequence and for the pad columns of a
// partial atom), handed to wgmma as 128-byte-swizzled tiles.
//
// One ring element is BN rows x BK dims, stored as num_repeats = BK / 64 swizzle atoms (columns of 64
// dims, BN rows of 128 bytes, atoms BN * 128 bytes apart). The same element serves both roles:
//   K (transpose = true):  B operand of S = Q K^T, K-major; a k16 step is +32 bytes inside an atom.
//   V (transpose = false): B operand of O = P V, MN-major (wgmma's transposed B); the atoms of the
//                          element are the N direction (LBO = BN * 128), 8-token groups are 1 KB apart.
// full_kv: one element covers the whole head (depth <= 256); otherwise a K tile is num_k_tiles elements
// of BK dims streamed one after another (depth 512), and V is read from column head_dim_offset on.
#pragma once
#include "hopper.cuh"
#include "kv_operand.cuh"
#include "fp8.cuh"

namespace cukv {

template <typename T, int BN_, int BK_, int DEPTH_, int STAGES_, int CACHE_DEPTH_ = DEPTH_>
struct KVBuffer {
  static constexpr int BN = BN_;
  static constexpr int BK = BK_;
  static constexpr int depth = DEPTH_;
  static constexpr int cache_depth = CACHE_DEPTH_;
  static constexpr int stages = STAGES_;
  static constexpr int MMA_M = 64, MMA_K = 16;
  static constexpr int bk_smem = kAtomCols;
  static constexpr int num_repeats = BK / bk_smem;                  // swizzle atoms per element
  static constexpr bool full_kv = BK >= DEPTH_;
  static constexpr int smem_cols = BK;
  static constexpr int smem_stage_size = BN * smem_cols;             // elements per ring element
  static constexpr int stage_bytes = smem_stage_size * (int)sizeof(T);
  static constexpr int num_k_tiles = (DEPTH_ + BK - 1) / BK;         // K elements per KV tile
  static constexpr int num_k_mmas2 = BK / MMA_K;                     // k16 steps in a full K element
  static constexpr int chunks_per_row = BK / 8;                      // 16-byte chunks per element row
  static_assert(BK % bk_smem == 0, "an element is whole swizzle atoms");
  static_assert(BN % 8 == 0 && BN >= 16 && BN <= 256, "BN: whole 8-row groups, at most one wgmma N");
  static_assert(sizeof(T) == 2, "16-bit elements (FP8 is dequantized before it reaches here)");

  u32 ring;  // shared address of element 0 (1 KB aligned)

  __device__ __forceinline__ u32 element(int stage) const { return ring + (u32)(stage * stage_bytes); }

  // Producer side, one of 4 warps: rows r = warp_rows * pw + lane / 8 + 4 * i (i < kRowsPerLane) of
  // element `stage`, columns [col0, col0 + ncols) of the cache; chunk lane % 8 of every atom. row_off(i) is
  // the element offset of that row (head and dim 0 included) or -1 for a row that must read as zeros.
  // Columns past ncols in the last atom are zero-filled: the seed's zero_partial_tile_pad, done once in
  // shared memory instead of in registers.
  static constexpr int kProducerWarps = 4;
  static constexpr int kRowsPerLane = BN / (kProducerWarps * 4);
  static_assert(BN % (kProducerWarps * 4) == 0, "BN splits over the producer warps");

  template <typename RowOffset>
  __device__ __forceinline__ void load_from_dram(int stage, const T* base, RowOffset row_off, int col0, int ncols, int pw,
                                                 int lane) const {
    const u32 dst0 = element(stage);
    const int chunk = lane % 8;
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      const int r = pw * (BN / kProducerWarps) + lane / 8 + 4 * i;
      const i64 off = row_off(i);  // computed once per row, reused across the atoms
#pragma unroll
      for (int atom = 0; atom < num_repeats; ++atom) {
        const int col = atom * bk_smem + chunk * 8;
        const bool ok = off >= 0 && col < ncols;
        const T* src = ok ? base + off + col0 + col : base;
        cp_async16(dst0 + (u32)(atom * BN * kAtomRowBytes) + swizzle128(r, chunk), src, ok ? 16 : 0);
      }
    }
  }

  // FP8 scores (prefill's e4m3 S = Q K^T): a K element holds the cache's codes as they are, rows of
  // code_atoms atoms of 128 codes in the same 128-byte swizzle, so a k32 step of the e4m3 wgmma is +32 bytes
  // like a k16 step of T and k_desc serves both. Only the chunks the k32 steps read are copied (the ones
  // past the head dim as zeros: an e4m3 NaN code times a zero query dim would still be NaN).
  static constexpr int code_atoms = (BK + 127) / 128;
  static_assert(code_atoms * 128 <= BK * (int)sizeof(T), "an element of codes fits the ring element");

  template <typename RowOffset>
  __device__ __forceinline__ void load_codes_from_dram(int stage, const unsigned char* base, RowOffset row_off,
                                                       int pw, int lane) const {
    const u32 dst0 = element(stage);
    const int chunk = lane % 8;
    constexpr int kBytes = (DEPTH_ + 31) / 32 * 32;  // what the k32 steps read
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      const int r = pw * (BN / kProducerWarps) + lane / 8 + 4 * i;
      const i64 off = row_off(i);
#pragma unroll
      for (int atom = 0; atom < code_atoms; ++atom) {
        const int col = atom * 128 + chunk * 16;
        if (col < kBytes) {
          const bool ok = off >= 0 && col < DEPTH_;
          cp_async16(dst0 + (u32)(atom * BN * kAtomRowBytes) + swizzle128(r, chunk), ok ? base + off + col : base,
                     ok ? 16 : 0);
        }
      }
    }
  }

  // FP8 cache, in two steps, over a raw element of BN rows x BK codes (row-major, 16-byte chunks) followed by
  // the rows' scales (kScalesPerRow floats a row; none per tensor). copy_raw_fp8: producer warp pw copies its
  // BN / 4 rows, chunk c = lane + 32 t of the warp's rows being row c / kChunksPerRow, so a warp's copies and
  // reads are consecutive 512-byte runs; lane j < BN / 4 copies row j's scales itself (it formed that row's
  // offsets). Rows that read as zeros, and dims past ncols, get zero codes and a zero scale. CODE_BYTES: where
  // the scales start (convert-once gives each converter warp its own quarter: its rows' codes, then their scales).
  // convert_raw_fp8 (after this lane's cp.async.wait_group and a __syncwarp for the scales other lanes copied):
  // 16 codes times their scale, stored as two swizzled 16-byte chunks of T in the ring element. A lane converts
  // the chunks it copied, or with PAIRS the chunks conv_chunk gives it (the raw slot came by TMA). The caller fences
  // the generic-proxy stores before handing the element to wgmma.
  static constexpr int kChunksPerRow = BK / 16;
  static constexpr int kWarpRows = BN / kProducerWarps;
  static constexpr int kWarpChunks = kWarpRows * kChunksPerRow;
  static constexpr int kChunkPasses = (kWarpChunks + 31) / 32;
  template <int SB> static constexpr int scales_per_row() { return SB == 0 ? 0 : (BK + SB - 1) / SB; }
  static constexpr int raw_code_bytes = BN * BK;
  template <int SB> static constexpr int raw_elem_bytes() { return raw_code_bytes + BN * scales_per_row<SB>() * 4; }
  static_assert(kWarpRows <= 32, "a producer lane forms each row's offsets");

  template <int SB, int CODE_BYTES = raw_code_bytes, typename RowOffset>
  __device__ __forceinline__ void copy_raw_fp8(u32 dst, const unsigned char* base, const float* scales, RowOffset row_off,
                                               i64 lane_row, i64 lane_scale, int col0, int ncols, int pw, int lane) const {
#pragma unroll
    for (int t = 0; t < kChunkPasses; ++t) {
      const int c = lane + 32 * t, r = c / kChunksPerRow, col = (c % kChunksPerRow) * 16;
      const i64 off = row_off(r % kWarpRows);  // every lane shuffles; only lanes with c < kWarpChunks copy
      if (kWarpChunks % 32 == 0 || c < kWarpChunks) {
        const bool ok = off >= 0 && col < ncols;
        const u32 to = dst + (u32)((pw * kWarpChunks + c) * 16);
        const unsigned char* from = ok ? base + off + col0 + col : base;
        cp_async16(to, from, ok ? 16 : 0);
      }
    }
    copy_raw_scales<SB, CODE_BYTES>(dst, scales, lane_row, lane_scale, col0, ncols, pw, lane);
  }
  // The scale part of copy_raw_fp8 (the TMA producer copies only this; its codes come by tensor copies).
  template <int SB, int CODE_BYTES = raw_code_bytes>
  __device__ __forceinline__ void copy_raw_scales(u32 dst, const float* scales, i64 lane_row, i64 lane_scale, int col0,
                                                  int ncols, int pw, int lane) const {
    if constexpr (SB > 0) {
      if (lane < kWarpRows) {
        const u32 sdst = dst + (u32)(CODE_BYTES + (pw * kWarpRows + lane) * scales_per_row<SB>() * 4);
#pragma unroll
        for (int s = 0; s < scales_per_row<SB>(); ++s) {
          const bool ok = lane_row >= 0 && s * SB < ncols;
          cp_async4(sdst + 4 * s, ok ? scales + lane_scale + col0 / SB + s : scales, ok ? 4 : 0);
        }
      }
    }
  }

  // Which chunk of the warp's rows (row, 16-code column) conversion pass slot c takes. With 8 or 16 chunks a row
  // (BK 128 or 256), an 8-lane phase of a pass takes 4 chunks of one row and 4 of the next row: the raw loads stay
  // on 8 distinct 16-byte bank groups, and the two rows' chunk pairs land on opposite parities of the ring's 128-byte
  // swizzle. Row-major order (8 chunks of one row a phase) put the phase's two atoms on the same bank groups, a
  // 2-way conflict on every store (Nsight Compute). c < kWarpChunks maps onto the same set of chunks.
  template <bool PAIRS>
  static constexpr bool pair_rows() { return PAIRS && (kChunksPerRow == 8 || kChunksPerRow == 16); }
  static_assert(kWarpRows % 2 == 0, "row pairs");
  template <bool PAIRS>
  static __device__ __forceinline__ int2 conv_chunk(int c) {
    if constexpr (pair_rows<PAIRS>())
      return make_int2(2 * (c / (2 * kChunksPerRow)) + (((c >> 2) ^ (c >> 3)) & 1),
                       8 * ((c % (2 * kChunksPerRow)) / 16) + c % 8);
    return make_int2(c / kChunksPerRow, c % kChunksPerRow);
  }

  // The shared loads of up to kLoadBatch passes are issued before their conversions (the asm statements are
  // volatile, so a load written after a store stays after it): one shared-memory round trip per batch, not
  // one per pass (the default tiles have 3-4 passes, so one per element). wait_slot() runs between the first
  // batch's loads and its stores (the caller's wait for the ring element).
  static constexpr int kLoadBatch = 4;  // 4 x 5 registers held: the FP8 producer's 72-80 (prefill.cuh)
  // MASK_ROWS (the TMA producer's last tile): rows from valid_rows on read as zero codes, since tensor copies
  // bring whatever the cache holds past the sequence (unused slots may be NaN) where cp.async zero-fills.
  // CODES (V with a per-tensor scale): the element holds the codes' exact values as f16, unscaled.
  // PAIRS: take chunks in conv_chunk's row pairs (the caller opts in where it measured no spill).
  template <int SB, bool MASK_ROWS = false, bool CODES = false, bool PAIRS = false, typename WaitSlot>
  __device__ __forceinline__ void convert_raw_fp8(int stage, u32 src, float tensor_scale, int pw, int lane,
                                                  WaitSlot wait_slot, int valid_rows = BN) const {
    static_assert(!CODES || SB == 0, "codes go in unscaled only when one scale serves the tensor");
    const u32 dst0 = element(stage);
    constexpr int kBatch = kLoadBatch < kChunkPasses ? kLoadBatch : kChunkPasses;
#pragma unroll
    for (int t0 = 0; t0 < kChunkPasses; t0 += kBatch) {
      uint4 raw[kBatch];
      float sc[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int t = t0 + j, c = lane + 32 * t;
        const int2 rc = conv_chunk<PAIRS>(c);  // (row, chunk) of the warp's rows
        const int r = rc.x, col = rc.y * 16;
        sc[j] = tensor_scale;
        // the raw slot is row-major, so chunk (r, rc.y) is at r * kChunksPerRow + rc.y, which is c itself without
        // PAIRS: c keeps that path's addressing as it was (spelled as r * kChunksPerRow + rc.y it spilled 4 bytes)
        if (t < kChunkPasses && (kWarpChunks % 32 == 0 || c < kWarpChunks)) {
          asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                       : "=r"(raw[j].x), "=r"(raw[j].y), "=r"(raw[j].z), "=r"(raw[j].w)
                       : "r"(src + (u32)((pw * kWarpChunks + (pair_rows<PAIRS>() ? r * kChunksPerRow + rc.y : c)) * 16))
                       : "memory");
          if constexpr (SB > 0)
            asm volatile("ld.shared.f32 %0, [%1];"
                         : "=f"(sc[j])
                         : "r"(src + (u32)(raw_code_bytes + ((pw * kWarpRows + r) * scales_per_row<SB>() + col / SB) * 4))
                         : "memory");
        }
      }
      if (t0 == 0) wait_slot();
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int t = t0 + j, c = lane + 32 * t;
        const int2 rc = conv_chunk<PAIRS>(c);
        const int r = rc.x, col = rc.y * 16;
        if (t < kChunkPasses && (kWarpChunks % 32 == 0 || c < kWarpChunks)) {
          const int row = pw * kWarpRows + r;
          if (MASK_ROWS && row >= valid_rows) raw[j] = make_uint4(0, 0, 0, 0);
          uint4 lo, hi;
          if constexpr (CODES) {
            codes16_f16(raw[j], lo, hi);
          } else {
            lo = dequant8<T>(make_uint2(raw[j].x, raw[j].y), sc[j]);
            hi = dequant8<T>(make_uint2(raw[j].z, raw[j].w), sc[j]);
          }
          const int chunk8 = (col % bk_smem) / 8;
          const u32 dst = dst0 + (u32)((col / bk_smem) * BN * kAtomRowBytes);
          asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};"
                       :: "r"(dst + swizzle128(row, chunk8)), "r"(lo.x), "r"(lo.y), "r"(lo.z), "r"(lo.w) : "memory");
          asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};"
                       :: "r"(dst + swizzle128(row, chunk8 + 1)), "r"(hi.x), "r"(hi.y), "r"(hi.z), "r"(hi.w) : "memory");
        }
      }
    }
  }

  // convert_raw_fp8's values to global memory instead of the ring: row r of the warp's rows of the raw element at
  // src goes to dst + r * row_stride (elements), dims below ncols (the prefill's convert-once workspace). Each lane
  // converts 8 codes and writes one 16-byte piece, so a warp store covers whole rows (full 32-byte sectors).
  template <int SB, int CODE_BYTES = raw_code_bytes>
  __device__ __forceinline__ void convert_raw_fp8_to_global(u32 src, T* dst, i64 row_stride, float tensor_scale,
                                                            int ncols, int pw, int lane) const {
    constexpr int kHalves = 2 * kWarpChunks, kPasses = (kHalves + 31) / 32;
#pragma unroll 2  // passes in flight per converter warp (72 registers; 4 at 88 measured no faster)
    for (int t = 0; t < kPasses; ++t) {
      const int h = lane + 32 * t, r = h / (2 * kChunksPerRow), col = (h % (2 * kChunksPerRow)) * 8;
      if ((kHalves % 32 == 0 || h < kHalves) && col < ncols) {
        uint2 raw;
        float sc = tensor_scale;
        asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(raw.x), "=r"(raw.y)
                     : "r"(src + (u32)((pw * kWarpChunks) * 16 + h * 8)) : "memory");
        if constexpr (SB > 0)
          asm volatile("ld.shared.f32 %0, [%1];"
                       : "=f"(sc)
                       : "r"(src + (u32)(CODE_BYTES + ((pw * kWarpRows + r) * scales_per_row<SB>() + col / SB) * 4))
                       : "memory");
        uint4 v = dequant8<T>(raw, sc);
        *reinterpret_cast<uint4*>(dst + r * row_stride + col) = v;
      }
    }
  }

  // K role: descriptor of atom `atom`, k16 step `k` (within the atom) of element `stage`.
  __device__ __forceinline__ u64 k_desc(int stage, int atom, int k) const {
    return desc_add(sw128_desc(element(stage), 1, 1024), (u32)(atom * BN * kAtomRowBytes + k * 32));
  }
  // V role: descriptor of tokens [16k, 16k + 16) across every atom of element `stage`.
  __device__ __forceinline__ u64 v_desc(int stage, int k) const {
    return desc_add(sw128_desc(element(stage), BN * kAtomRowBytes, 1024), (u32)(k * 16 * kAtomRowBytes));
  }
};

}  // namespace cukv
