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

  // FP8 cache, in two steps. copy_raw_fp8: the same rows and chunks as load_from_dram, but each lane copies
  // its 8 codes (8 bytes) and, with SB > 0, its granule's scale (4 bytes) by cp.async into a raw element,
  // laid out [row i][atom][producer thread] so that a warp's reads of it are contiguous. Rows that read as
  // zeros get zero codes and a zero scale. convert_raw_fp8 (after this lane's cp.async.wait_group): codes
  // times scale, stored as 8 values of T into the swizzled ring element. A lane converts only what it
  // copied itself. The caller fences the generic-proxy stores before handing the element to wgmma.
  static constexpr int kProducerThreads = kProducerWarps * 32;
  static constexpr int raw_code_bytes = kRowsPerLane * num_repeats * kProducerThreads * 8;
  static constexpr int raw_elem_bytes = raw_code_bytes + kRowsPerLane * num_repeats * kProducerThreads * 4;

  template <int SB, typename RowOffset, typename ScaleRow>
  __device__ __forceinline__ void copy_raw_fp8(u32 dst, const unsigned char* base, const float* scales, RowOffset row_off,
                                               ScaleRow scale_row, int col0, int ncols, int pw, int lane) const {
    const int chunk = lane % 8, tid = pw * 32 + lane;
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      const i64 off = row_off(i);
      const i64 loc = SB > 0 ? scale_row(i) : 0;
#pragma unroll
      for (int atom = 0; atom < num_repeats; ++atom) {
        const int col = atom * bk_smem + chunk * 8;
        const bool ok = off >= 0 && col < ncols;
        const int slot = (i * num_repeats + atom) * kProducerThreads + tid;
        cp_async8(dst + (u32)(slot * 8), ok ? base + off + col0 + col : base, ok ? 8 : 0);
        if constexpr (SB > 0)
          cp_async4(dst + (u32)(raw_code_bytes + slot * 4), ok ? scales + loc + (col0 + col) / SB : scales, ok ? 4 : 0);
      }
    }
  }

  template <int SB>
  __device__ __forceinline__ void convert_raw_fp8(int stage, u32 src, float tensor_scale, int pw, int lane) const {
    const u32 dst0 = element(stage);
    const int chunk = lane % 8, tid = pw * 32 + lane;
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      const int r = pw * (BN / kProducerWarps) + lane / 8 + 4 * i;
#pragma unroll
      for (int atom = 0; atom < num_repeats; ++atom) {
        const int slot = (i * num_repeats + atom) * kProducerThreads + tid;
        uint2 raw;
        asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(raw.x), "=r"(raw.y) : "r"(src + (u32)(slot * 8)) : "memory");
        float sc = tensor_scale;
        if constexpr (SB > 0)
          asm volatile("ld.shared.f32 %0, [%1];" : "=f"(sc) : "r"(src + (u32)(raw_code_bytes + slot * 4)) : "memory");
        const uint4 v = dequant8<T>(raw, sc);
        const u32 dst = dst0 + (u32)(atom * BN * kAtomRowBytes) + swizzle128(r, chunk);
        asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" :: "r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
      }
    }
  }

  // K role: descriptor of atom `atom`, k16 step `k` (within the atom) of element `stage`.
  __device__ __forceinline__ u64 k_desc(int stage, int atom, int k) const {
    return sw128_desc(element(stage) + (u32)(atom * BN * kAtomRowBytes + k * 32), 1, 1024);
  }
  // V role: descriptor of tokens [16k, 16k + 16) across every atom of element `stage`.
  __device__ __forceinline__ u64 v_desc(int stage, int k) const {
    return sw128_desc(element(stage) + (u32)(k * 16 * kAtomRowBytes), BN * kAtomRowBytes, 1024);
  }
};

}  // namespace cukv
