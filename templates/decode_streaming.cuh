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
//
// FP8 caches (Op::quantization_enabled): the same lanes load 8 codes (8 bytes) where the 16-bit cache has
// 8 values (16 bytes), with the scale of their granule; k_val / v_group dequantize to T in registers right
// before the mma, so the fragments and the mma code are the same for both. Rows that are not loaded get
// scale 0 (a scale slot may hold NaN too).
//
// Shared-memory ring (FP8 caches; DecodeKernel with STAGES > 0): issue() copies a strip's K and V rows and
// their scales into a ring slot with cp.async, 16-byte chunks covering whole rows (so each copy instruction
// asks L2 for full lines, where the register form's 8-byte loads ask for 32-byte pieces), and
// fetch_k/fetch_v read back exactly the registers load_k/load_v would have loaded. Rows are XOR-swizzled
// by 16-byte chunk, differently for K and V, so both read patterns are free of bank conflicts. Skipped rows
// are zero-filled (src size 0): zero codes and zero scales, as in the register form.
//
// TMA (the ring's tensor-copy form, DecodeConfig.tma; FP8 rows of a multiple of 128 bytes): the code rows of a slot
// are atom columns of BN rows x 128 bytes in the 128-byte swizzle's pattern (hopper.cuh swizzle128), what one tensor
// copy per atom writes (issue_tma); cut strips and the scales still go by cp.async (issue_codes into the same layout,
// issue_scales into the slot's scale block, kept apart so the code slots stay on 1024 bytes). V's reads are free of
// bank conflicts in that layout as they are; K's take the strip's pieces in a lane-dependent order (fetch_k).
#pragma once
#include "kv_operand.cuh"
#include "fp8.cuh"
#include "hopper.cuh"

namespace cukv {

// %laneid, read where it is used: asm volatile keeps the compiler from hoisting what is computed from it out of the strip
// loop, so per-lane slot offsets are recomputed per strip rather than held in registers (the FP8 tma ring: 175 -> 167
// registers at d128 g4, a third block per SM; docs/tuning.md)
__device__ __forceinline__ int lane_here() {
  int lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

template <typename Op, typename T, int DEPTH, int SCALE_BLOCK = 0, int BN = 16, bool TMA = false>
struct DecodeStreamingKVBuffer {
  static constexpr bool quantized = Op::quantization_enabled;
  typedef typename Select<quantized, uint2, uint4>::type Raw;  // 8 elements as stored
  static constexpr int elem_bytes = quantized ? 1 : 2;
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
  // FP8: the mma sees the codes' exact values (f16 exactly; for bf16 scores, value * 2^-112, all normal numbers)
  // and the scales are applied outside the reduction: K's to the scores (per granule: one partial score
  // per block of dims), V's to P (per granule: one P per block). Each lane needs the scales of the tokens
  // of its score columns, t0 + 8 nt + 2c + {0, 1}, which are also its V rows r = 2 nt + {0, 1}.
  static constexpr int SB = SCALE_BLOCK == 0 ? DEPTH : SCALE_BLOCK;
  static constexpr int num_k_scales = quantized ? DEPTH / SB : 1;   // K blocks
  static constexpr int num_v_scales = quantized ? (DEPTH + SB - 1) / SB : 1;
  static_assert(!quantized || SCALE_BLOCK == 0 || (DEPTH % SCALE_BLOCK == 0 && (SCALE_BLOCK % 32 == 0 || SCALE_BLOCK == DEPTH)),
                "scale block divides the head");
  static_assert(!quantized || SB % BK == 0, "a K strip lies in one scale block");

  Raw k[num_n_tiles][num_k_strips];
  Raw v[num_v_groups][4];
  float ks[4][num_k_scales];
  float vs[4][num_v_scales];
  float tensor_scale_k, tensor_scale_v;  // SCALE_BLOCK 0

  __device__ __forceinline__ void set_tensor_scales(const Op& op) {
    if constexpr (quantized && SCALE_BLOCK == 0) {
      tensor_scale_k = op.template load_scale<0>(true, 0, 0, 0);
      tensor_scale_v = op.template load_scale<0>(false, 0, 0, 0);
    }
  }

  static __device__ __forceinline__ Raw load_raw(const typename Op::dtype* p) {
    if constexpr (quantized) return ldg_stream8(p);
    else return ldg_stream16(p);
  }
  static __device__ __forceinline__ Raw zero_raw() {
    if constexpr (quantized) return make_uint2(0, 0);
    else return make_uint4(0, 0, 0, 0);
  }

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
      const typename Op::dtype* p = row >= 0 ? op.row_ptr(true, row, head, 8 * c) : nullptr;
#pragma unroll
      for (int s = 0; s < num_k_strips; ++s)
        k[nt][s] = p ? load_raw(p + s * BK) : zero_raw();
    }
    if constexpr (quantized) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int t = t0 + 2 * c + (r & 1) + (r >> 1) * 8;
        const i64 row = (t >= start && t < end) ? row_of(op, b, t0, base, t) : (i64)-1;
#pragma unroll
        for (int i = 0; i < num_k_scales; ++i) {
          if constexpr (SCALE_BLOCK == 0) ks[r][i] = row >= 0 ? tensor_scale_k : 0.f;
          else ks[r][i] = row >= 0 ? op.template load_scale<SB>(true, row, head, i * SB) : 0.f;
        }
      }
    }
  }

  __device__ __forceinline__ void load_v(const Op& op, int b, int head, int t0, int start, int end, i64 base) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int t = t0 + 2 * c + (r & 1) + (r >> 1) * 8;
      const i64 row = (t >= start && t < end) ? row_of(op, b, t0, base, t) : (i64)-1;
      const typename Op::dtype* p = row >= 0 ? op.row_ptr(false, row, head, 8 * g) : nullptr;
#pragma unroll
      for (int grp = 0; grp < num_v_groups; ++grp) {
        const bool in_depth = (grp * V_GROUP + 8 * g) < DEPTH;
        v[grp][r] = (p && in_depth) ? load_raw(p + grp * V_GROUP) : zero_raw();
      }
      if constexpr (quantized) {
#pragma unroll
        for (int i = 0; i < num_v_scales; ++i) {
          if constexpr (SCALE_BLOCK == 0) vs[r][i] = row >= 0 ? tensor_scale_v : 0.f;
          else vs[r][i] = row >= 0 ? op.template load_scale<SB>(false, row, head, i * SB) : 0.f;
        }
      }
    }
  }

  // ---- the shared-memory ring (FP8): slot = K rows [BN][ROW_PITCH], V rows, K scales [num_k_scales][BN],
  // V scales [num_v_scales][BN]
  static constexpr int ROW_BYTES = DEPTH * elem_bytes;
  static constexpr int ROW_PITCH = ROW_BYTES > 128 ? 256 : 128;  // 8 or 16 chunks: the swizzles stay in the row
  static constexpr int CHUNKS = ROW_BYTES / 16;                  // 16-byte chunks of a row
  static constexpr int ROW_COPIES = BN * CHUNKS / 32;            // per lane, for K and again for V
  static constexpr int L2_PREFETCH = ROW_BYTES >= 256 ? 256 : ROW_BYTES >= 128 ? 128 : 64;  // rows read whole
  static constexpr int K_SCALES_AT = 2 * BN * ROW_PITCH;
  static constexpr int V_SCALES_AT = K_SCALES_AT + 4 * BN * num_k_scales;
  static constexpr int SLOT_BYTES = V_SCALES_AT + 4 * BN * num_v_scales;
  static_assert(!quantized || (ROW_BYTES <= ROW_PITCH && ROW_BYTES % 16 == 0 && (BN * CHUNKS) % 32 == 0),
                "whole 16-byte copies");
  // TMA: a slot's code rows (CODE_BYTES, K then V, each ATOMS atom columns) and, elsewhere, its scales (SCALE_BYTES:
  // K's [num_k_scales][BN] then V's); together SLOT_BYTES, as without TMA
  static constexpr int CODE_BYTES = K_SCALES_AT;
  static constexpr int SCALE_BYTES = SLOT_BYTES - CODE_BYTES;
  static constexpr int ATOMS = ROW_BYTES / kAtomRowBytes;    // 128-byte atom columns per row (one tensor copy each)
  static constexpr int ATOM_BYTES = BN * kAtomRowBytes;
  static_assert(!TMA || (quantized && ROW_BYTES % kAtomRowBytes == 0 && ROW_PITCH == ROW_BYTES && CODE_BYTES % 1024 == 0),
                "tensor copies: FP8 rows of whole 128-byte atoms (head dim a multiple of 128)");
  // K is read as rows g (4 consecutive per half warp), V as rows 2c + const (4 with stride 2): each pattern's
  // eight 16-byte pieces land in distinct bank groups (TMA: see fetch_k)
  static __device__ __forceinline__ u32 k_at(int row, int chunk) {
    if constexpr (TMA) return (u32)((chunk >> 3) * ATOM_BYTES) + swizzle128(row, chunk & 7);
    else return row * ROW_PITCH + ((chunk ^ ((row & 3) << 1)) << 4);
  }
  static __device__ __forceinline__ u32 v_at(int row, int chunk) {
    if constexpr (TMA) return (u32)(BN * ROW_PITCH + (chunk >> 3) * ATOM_BYTES) + swizzle128(row, chunk & 7);
    else return BN * ROW_PITCH + row * ROW_PITCH + ((chunk ^ (((row >> 1) & 3) << 1)) << 4);
  }

  // Copies strip t0 of (b, head) into the slot at shared address `slot`; every lane of the warp calls it.
  static __device__ __forceinline__ void issue(const Op& op, int b, int head, int t0, int start, int end, i64 base, u32 slot) {
    issue_codes(op, b, head, t0, start, end, base, slot);
    issue_scales(op, b, head, t0, start, end, base, slot + K_SCALES_AT);
  }
  // The strip's K and V code rows into the slot's rows at `slot` (skipped rows zero-filled).
  static __device__ __forceinline__ void issue_codes(const Op& op, int b, int head, int t0, int start, int end, i64 base,
                                                     u32 slot) {
    static_assert(quantized, "16-bit caches have their own ring (decode_ring.cuh)");
    const int lane = TMA ? lane_here() : threadIdx.x & 31;
    // A strip on one page (page_size % BN == 0) is BN rows at the token stride from its first row: one
    // address computation per strip instead of one per copy.
    constexpr bool ONE_PAGE = Op::page_size % BN == 0;
    const bool mapped = !ONE_PAGE || base >= 0;
    typedef typename Op::dtype E;
    const E* k0 = static_cast<const E*>(op.p.k);  // any valid address: copies of skipped rows read nothing
    const E* v0 = static_cast<const E*>(op.p.v);
    const E* pk0 = (ONE_PAGE && mapped) ? op.row_ptr(true, base, head) : k0;
    const E* pv0 = (ONE_PAGE && mapped) ? op.row_ptr(false, base, head) : v0;
    const i64 kst = op.p.k_stride[1], vst = op.p.v_stride[1];
#pragma unroll
    for (int i = 0; i < ROW_COPIES; ++i) {
      const int idx = lane + 32 * i, row = idx / CHUNKS, chunk = idx % CHUNKS;
      const int t = t0 + row;
      const bool ok = mapped && t >= start && t < end;
      const E *pk, *pv;
      bool live;
      if constexpr (ONE_PAGE) {
        pk = pk0 + row * kst + 16 * chunk;
        pv = pv0 + row * vst + 16 * chunk;
        live = ok;
      } else {
        const i64 r = ok ? op.row_idx(b, t) : (i64)-1;
        live = r >= 0;
        pk = live ? op.row_ptr(true, r, head, 16 * chunk) : k0;
        pv = live ? op.row_ptr(false, r, head, 16 * chunk) : v0;
      }
      cp_async16_l2<L2_PREFETCH>(slot + k_at(row, chunk), live ? pk : k0, live ? 16 : 0);
      cp_async16_l2<L2_PREFETCH>(slot + v_at(row, chunk), live ? pv : v0, live ? 16 : 0);
    }
  }
  // The strip's scales into the scale block at `scales` (K's [num_k_scales][BN], then V's): lane j copies token
  // j % BN of block j / BN (per tensor: the one scalar for every token); skipped tokens get zeros.
  static __device__ __forceinline__ void issue_scales(const Op& op, int b, int head, int t0, int start, int end,
                                                      i64 base, u32 scales) {
    const int lane = TMA ? lane_here() : threadIdx.x & 31;
    constexpr bool ONE_PAGE = Op::page_size % BN == 0;
    const bool mapped = !ONE_PAGE || base >= 0;
    const i64 kss = op.p.ks_stride[1], vss = op.p.vs_stride[1];
#pragma unroll
    for (int j0 = 0; j0 < BN * (num_k_scales > num_v_scales ? num_k_scales : num_v_scales); j0 += 32) {
      const int j = j0 + lane, tok = j % BN, i = j / BN;
      const int t = t0 + tok;
      const bool ok = mapped && t >= start && t < end;
      const float *sk, *sv;
      bool live;
      if constexpr (ONE_PAGE) {
        sk = op.template scale_ptr<SCALE_BLOCK>(true, mapped ? base : 0, head, i * SB) + tok * kss;
        sv = op.template scale_ptr<SCALE_BLOCK>(false, mapped ? base : 0, head, i * SB) + tok * vss;
        live = ok;
      } else {
        const i64 r = ok ? op.row_idx(b, t) : (i64)-1;
        sk = op.template scale_ptr<SCALE_BLOCK>(true, r >= 0 ? r : 0, head, i * SB);
        sv = op.template scale_ptr<SCALE_BLOCK>(false, r >= 0 ? r : 0, head, i * SB);
        live = r >= 0;
      }
      if (i < num_k_scales) cp_async4(scales + 4 * j, sk, live ? 4 : 0);
      if (i < num_v_scales) cp_async4(scales + (V_SCALES_AT - K_SCALES_AT) + 4 * j, sv, live ? 4 : 0);
    }
  }

  // TMA: strip t0 into the code slot at `codes` and the scale block at `scales`, every lane arriving once on the slot's
  // barrier `bar` when its copies have landed. A strip wholly inside [start, end) on a mapped page (warp-uniform)
  // comes by 2 * ATOMS tensor copies (boxes of 128 bytes x 1 head x BN tokens of one page, 128-byte swizzle), one per
  // lane, each lane first adding its box's bytes to the barrier's transaction count; any other strip by
  // issue_codes's zero-filling cp.async copies. The scales go by cp.async either way (a box row would be one float).
  // maps: K's tensor map, V's right after it (DecodeMaps).
  static __device__ __forceinline__ void issue_tma(const Op& op, const CUtensorMap* maps, int b, int head, int t0,
                                                   int start, int end, i64 base, u32 codes, u32 scales, u32 bar) {
    static_assert(TMA && Op::page_size % BN == 0, "tensor copies take BN tokens of one page");
    if (base >= 0 && t0 >= start && t0 + BN <= end) {
      const int lane = threadIdx.x & 31;
      if (lane < 2 * ATOMS) {
        // lane l: atom l % ATOMS of K (l < ATOMS) or V; V's atoms follow K's in the slot as V's map follows K's
        mbar_expect_tx(bar, ATOM_BYTES);
        tma_load_4d(codes + (u32)(lane * ATOM_BYTES), maps + lane / ATOMS, (lane % ATOMS) * kAtomRowBytes, head,
                    (int)(base % Op::page_size), (int)(base / Op::page_size), bar);
      }
    } else {
      issue_codes(op, b, head, t0, start, end, base, codes);
    }
    issue_scales(op, b, head, t0, start, end, base, scales);
    mbar_arrive_cp_async(bar);
  }

  // Scales [N][BN] of a slot -> the lane's tokens 2c + (r & 1) + 8 (r >> 1), as load_k / load_v hold them.
  template <int N>
  static __device__ __forceinline__ void fetch_scales(const unsigned char* at, int c, float (&dst)[4][N]) {
    const float* sc = reinterpret_cast<const float*>(at);
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int i = 0; i < N; ++i) dst[r][i] = sc[i * BN + 2 * c + (r & 1) + (r >> 1) * 8];
  }
  // The registers load_k / load_v would have loaded, from the slot at `sl` (after wait_group + __syncwarp):
  // K (and its scales) first, V once the scores have freed K's registers.
  __device__ __forceinline__ void fetch_k(const unsigned char* sl) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int nt = 0; nt < num_n_tiles; ++nt)
#pragma unroll
      for (int s = 0; s < num_k_strips; ++s)
        k[nt][s] = *reinterpret_cast<const Raw*>(sl + k_at(nt * MMA_N + g, 2 * s + (c >> 1)) + 8 * (c & 1));
    if constexpr (quantized) fetch_scales(sl + K_SCALES_AT, c, ks);
  }
  // TMA: the same registers from the code slot `sl` and the scale block `sc`. In the swizzle's pattern rows g and g ^ 1
  // hold piece s (32 bytes) in the same banks, so odd rows read the pieces in the order s ^ 2: each half warp's eight
  // 16-byte reads then land in eight different bank groups; selects put the pieces back in place.
  __device__ __forceinline__ void fetch_k(const unsigned char* sl, const unsigned char* sc) {
    static_assert(num_k_strips % 4 == 0, "pieces reordered within groups of four");
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int x = (g & 1) << 1;
#pragma unroll
    for (int nt = 0; nt < num_n_tiles; ++nt) {
      Raw r[num_k_strips];
#pragma unroll
      for (int i = 0; i < num_k_strips; ++i)
        r[i] = *reinterpret_cast<const Raw*>(sl + k_at(nt * MMA_N + g, 2 * (i ^ x) + (c >> 1)) + 8 * (c & 1));
#pragma unroll
      for (int s = 0; s < num_k_strips; ++s) {
        k[nt][s].x = x ? r[s ^ 2].x : r[s].x;
        k[nt][s].y = x ? r[s ^ 2].y : r[s].y;
      }
    }
    fetch_scales(sc, c, ks);
  }
  __device__ __forceinline__ void fetch_v(const unsigned char* sl, const unsigned char* sc) {
    const int lane = lane_here(), g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = 2 * c + (r & 1) + (r >> 1) * 8;
#pragma unroll
      for (int grp = 0; grp < num_v_groups; ++grp)
        v[grp][r] = *reinterpret_cast<const Raw*>(sl + v_at(row, 4 * grp + (g >> 1)) + 8 * (g & 1));
    }
    fetch_scales(sc + (V_SCALES_AT - K_SCALES_AT), c, vs);
  }
  __device__ __forceinline__ void fetch_v(const unsigned char* sl) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = 2 * c + (r & 1) + (r >> 1) * 8;
#pragma unroll
      for (int grp = 0; grp < num_v_groups; ++grp) {
        const bool in_depth = (grp * V_GROUP + 8 * g) < DEPTH;
        v[grp][r] = in_depth ? *reinterpret_cast<const Raw*>(sl + v_at(row, 4 * grp + (g >> 1)) + 8 * (g & 1)) : zero_raw();
      }
    }
    if constexpr (quantized) fetch_scales(sl + V_SCALES_AT, c, vs);
  }

  // K token tile nt, strip s as the score mma's operand: T values (16-bit cache) or the codes' exact
  // values (FP8: f16, or bf16 times 2^-112).
  // MT: the score mma's operand type (T, or f16 for the FP8 ring's f16 scores).
  template <typename MT = T>
  __device__ __forceinline__ uint4 k_val(int nt, int s) const {
    if constexpr (quantized) {
      uint4 r;
      r.x = codes_to_mma<MT>((u16)(k[nt][s].x & 0xffffu));
      r.y = codes_to_mma<MT>((u16)(k[nt][s].x >> 16));
      r.z = codes_to_mma<MT>((u16)(k[nt][s].y & 0xffffu));
      r.w = codes_to_mma<MT>((u16)(k[nt][s].y >> 16));
      return r;
    } else {
      return k[nt][s];
    }
  }

  // B fragments (b0, b1) of the P.V mma for the 8 output n-tiles of V group grp. 16-bit cache: T pairs by
  // byte_perm; FP8: token pairs of codes by prmt, then their exact f16 values (P.V runs in f16 for FP8 caches).
  __device__ __forceinline__ void v_frags(int grp, u32 (&bf)[8][2]) const {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if constexpr (quantized) {
        const int w = j >> 2, jb = j & 3;  // word of the 8 codes, byte in it
        const u32 sel = (u32)(jb | ((4 + jb) << 4));
        const u32 w0 = w ? v[grp][0].y : v[grp][0].x, w1 = w ? v[grp][1].y : v[grp][1].x;
        const u32 w2 = w ? v[grp][2].y : v[grp][2].x, w3 = w ? v[grp][3].y : v[grp][3].x;
        bf[j][0] = f16x2_from_e4m3x2((u16)__byte_perm(w0, w1, sel));
        bf[j][1] = f16x2_from_e4m3x2((u16)__byte_perm(w2, w3, sel));
      } else {
        const u32 sel = (j & 1) ? 0x7632u : 0x5410u;
        const int i = j >> 1;
        bf[j][0] = __byte_perm(comp(v[grp][0], i), comp(v[grp][1], i), sel);
        bf[j][1] = __byte_perm(comp(v[grp][2], i), comp(v[grp][3], i), sel);
      }
    }
  }

  __device__ __forceinline__ static u32 comp(const uint4& x, int i) {
    return i == 0 ? x.x : i == 1 ? x.y : i == 2 ? x.z : x.w;
  }
};

}  // namespace cukv
