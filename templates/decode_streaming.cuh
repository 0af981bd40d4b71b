// DecodeStreamingKVBuffer: decode-time staging of one warp's BN-token strip of K and V.
//
// MAX's version stages strips through one shared-memory buffer. On Hopper the strip is consumed by the
// same warp that loads it, so cukv stages it in registers, already in mma.sync m16n8k16 operand order:
// - K (transpose=True): BN x depth, loaded as BK-wide column strips; lane (g, c) = (lane/4, lane%4) reads
//   16 bytes of token g (and 8+g) at dims [BK*s + 8c, +8). The mma's reduction index is permuted within a
//   strip; Q is read with the same permutation, so Q.K is unchanged.
// - V (transpose=False): rows 2c, 2c+1, 2c+8, 2c+9 of the strip, 16 bytes at dims [64*grp + 8g, +8); pairs of
//   rows are interleaved with byte_perm into the B fragment. The output columns come out permuted too:
//   lane (g, c) holds dims [64*grp + 16c, +16) of its row, so stores stay 16-byte wide.
// Tokens outside [start, end) or on a page the table does not map are never loaded: their registers are
// zero, so NaN garbage in unused slots cannot reach an output (0 * NaN would).
#pragma once
#include "kv_operand.cuh"

namespace cukv {

template <typename Op, int DEPTH, int BN = 16>
struct DecodeStreamingKVBuffer {
  typedef typename Op::dtype T;
  static constexpr int MMA_M = 16, MMA_N = 8, MMA_K = 16;
  static constexpr int BK = 32;                           // dims per K strip (4 lanes x 8 dims)
  static constexpr int num_k_strips = DEPTH / BK;
  static constexpr int num_k_mmas2 = BK / MMA_K;          // mma k-steps per strip
  static constexpr int num_n_tiles = BN / MMA_N;          // token tiles of the score block
  static constexpr int V_GROUP = 64;                       // dims per V load group (8 lanes x 8 dims)
  static constexpr int num_v_groups = (DEPTH + V_GROUP - 1) / V_GROUP;
  static constexpr int num_mmas = num_v_groups * (V_GROUP / MMA_N);  // n-tiles of the output
  static constexpr int input_frag_size = MMA_K * MMA_N / 32;
  static_assert(BN == 16, "one m16n8k16 k-step of P.V covers 16 tokens");
  static_assert(DEPTH % BK == 0, "depth must be a multiple of 32");

  uint4 k[num_n_tiles][num_k_strips];
  uint4 v[num_v_groups][4];

  // Row index of token t (or -1) when all of [t0, t0+BN) lies on one page (page_size % BN == 0).
  __device__ __forceinline__ static i64 rows_base(const Op& op, int b, int t0) { return op.row_idx(b, t0); }

  __device__ __forceinline__ static i64 row_of(const Op& op, int b, int t0, i64 base, int t) {
    if constexpr (Op::page_size % BN == 0) {
      return base < 0 ? (i64)-1 : base + (t - t0);
    } else {
      return op.row_idx(b, t);
    }
  }

  __device__ __forceinline__ void load_k(const Op& op, int b, int head, int t0, int start, int end, i64 base) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int nt = 0; nt < num_n_tiles; ++nt) {
      const int t = t0 + nt * MMA_N + g;
      const i64 row = (t >= start && t < end) ? row_of(op, b, t0, base, t) : (i64)-1;
      const T* p = row >= 0 ? op.row_ptr(true, row, head, 8 * c) : nullptr;
#pragma unroll
      for (int s = 0; s < num_k_strips; ++s)
        k[nt][s] = p ? ldg_stream16(p + s * BK) : make_uint4(0, 0, 0, 0);
    }
  }

  __device__ __forceinline__ void load_v(const Op& op, int b, int head, int t0, int start, int end, i64 base) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int t = t0 + 2 * c + (r & 1) + (r >> 1) * 8;
      const i64 row = (t >= start && t < end) ? row_of(op, b, t0, base, t) : (i64)-1;
      const T* p = row >= 0 ? op.row_ptr(false, row, head, 8 * g) : nullptr;
#pragma unroll
      for (int grp = 0; grp < num_v_groups; ++grp) {
        const bool in_depth = (grp * V_GROUP + 8 * g) < DEPTH;
        v[grp][r] = (p && in_depth) ? ldg_stream16(p + grp * V_GROUP) : make_uint4(0, 0, 0, 0);
      }
    }
  }

  // B fragment of the score mma for token tile nt, strip s, k-step ks.
  __device__ __forceinline__ void k_frag(int nt, int s, int ks, u32& b0, u32& b1) const {
    b0 = ks == 0 ? k[nt][s].x : k[nt][s].z;
    b1 = ks == 0 ? k[nt][s].y : k[nt][s].w;
  }

  // B fragment of the P.V mma for output n-tile j of group grp.
  __device__ __forceinline__ void v_frag(int grp, int j, u32& b0, u32& b1) const {
    const u32 sel = (j & 1) ? 0x7632u : 0x5410u;
    const int i = j >> 1;
    b0 = __byte_perm(comp(v[grp][0], i), comp(v[grp][1], i), sel);
    b1 = __byte_perm(comp(v[grp][2], i), comp(v[grp][3], i), sel);
  }

  __device__ __forceinline__ static u32 comp(const uint4& x, int i) {
    return i == 0 ? x.x : i == 1 ? x.y : i == 2 ? x.z : x.w;
  }
};

}  // namespace cukv
