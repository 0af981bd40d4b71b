// Split-KV paged decode: one query token per sequence, GQA groups of 1..16 query heads per KV head.
//
// Grid (num_splits, num_kv_heads, batch); NUM_WARPS warps per block. Rows of the m16n8k16 tile are the
// group's query heads (zero rows pad groups under 16), columns are 16-token strips of the context.
// Each warp streams its strips straight into registers (DecodeStreamingKVBuffer; FP8 caches may go through
// a shared-memory ring first, STAGES > 0), keeps an online softmax per row, and the block merges its warps
// in shared memory in warp order (deterministic). One split writes the final output; several either write
// fp32 partials that the last block of (b, hk) combines by LSE, or (CLUSTER > 1) form a thread-block
// cluster that combines them through distributed shared memory (decode_epilogue).
#pragma once
#include "decode_common.cuh"

namespace cukv {

// Traits (DecodeTraits, rendered by DecodeConfig): T, page_size, head_dim, group, num_warps; quantized: the cache
// holds FP8 e4m3 codes (scales per scale_block dims, 0 = per tensor), dequantized to T in registers; sub: strips
// each warp keeps in flight in registers; stages > 0: instead a ring of that many shared-memory slots per warp,
// filled with whole code rows by cp.async (DecodeStreamingKVBuffer::issue); tma: the ring's whole strips by tensor
// copies instead (DecodeStreamingKVBuffer::issue_tma; one mbarrier per slot); cluster: see decode_epilogue;
// q_in_smem: where Q lives (DecodeConfig.q_in_smem decides); warp_slots: see DecodeSmem.
template <class Traits>
struct DecodeKernel {
  typedef typename Traits::T T;
  static constexpr int PAGE_SIZE = Traits::page_size, DEPTH = Traits::head_dim, GROUP = Traits::group;
  static constexpr int NUM_WARPS = Traits::num_warps;
  static constexpr bool QUANTIZED = Traits::quantized;
  static constexpr int SCALE_BLOCK = Traits::scale_block, SUB = Traits::sub, STAGES = Traits::stages;
  static constexpr int CLUSTER = Traits::cluster;
  static constexpr bool WARP_SLOTS = Traits::warp_slots;
  static constexpr bool TMA = Traits::tma;
  typedef KVCacheOperand<typename Select<QUANTIZED, unsigned char, T>::type, PAGE_SIZE, QUANTIZED> Op;
  typedef DecodeStreamingKVBuffer<Op, T, DEPTH, SCALE_BLOCK, 16, TMA> Buf;
  static constexpr int BN = 16;
  static constexpr bool TWO_ROWS = GROUP > 8;       // rows g+8 carry heads too
  static constexpr int NK = Buf::num_k_strips;
  static constexpr int NO = Buf::num_mmas;           // output n-tiles
  // registers go to the output accumulator (wide heads) or to occupancy (the FP8 ring) instead
  static constexpr bool Q_IN_SMEM = Traits::q_in_smem;
  static_assert(Q_IN_SMEM == (DEPTH > 128 || STAGES > 0),
                "DecodeConfig.q_in_smem: Q in shared memory past head dim 128 and in the FP8 ring");
  // the strip reads Q from shared memory each time where the head is too wide for registers, and in the FP8
  // ring with K scale blocks (their partial scores already take the registers a third block per SM needs);
  // otherwise the FP8 ring stages Q there (as f16) and keeps its fragments in registers (168-178 at d128, by NVRTC version)
  static constexpr bool Q_SMEM_READS = DEPTH > 128 || (STAGES > 0 && Buf::num_k_scales > 1);
  static constexpr bool V_LATE = DEPTH > 128;        // V loads wait until K's registers are free
  static constexpr bool PIPELINE = !V_LATE;          // prefetch the next strip into the same registers
  static_assert(GROUP >= 1 && GROUP <= 16, "group (query heads per KV head) must be 1..16");
  static_assert(PAGE_SIZE >= 1, "page size must be positive");
  static_assert(SUB >= 1 && SUB <= 4, "1..4 strips in flight per warp");
  static_assert(STAGES == 0 || (SUB == 1 && STAGES >= 2 && STAGES <= 8), "a ring of 2..8 slots replaces SUB");
  static_assert(!TMA || (QUANTIZED && STAGES > 0), "tensor copies fill the FP8 ring");
  // TMA: the code slots (1024-byte aligned: 1024 bytes of slack), then the slots' scale blocks, then one mbarrier per slot
  static constexpr int RING_BYTES = NUM_WARPS * STAGES * Buf::SLOT_BYTES + (TMA ? 1024 + 8 * NUM_WARPS * STAGES : 0);
  // FP8: the query is pre-multiplied by a power of two (bf16) and scores by kKFactor * K scale (see fp8.cuh:
  // codes enter the mma exactly). P.V runs in f16 on the codes' exact f16 values (one cvt per pair, no bit
  // moves): P is multiplied by its token's V scale over gv, the warp's running power-of-two bound on the V
  // scales seen so far (so P * scale / gv <= 1 stays in f16 range), and the output is kept in units of gv,
  // rescaled like the softmax's running max when gv grows.
  static constexpr float kQPre = QUANTIZED ? CodeScale<T>::q_pre : 1.f;
  static constexpr float kKFactor = QUANTIZED ? CodeScale<T>::value / CodeScale<T>::q_pre : 1.f;
  typedef typename Select<QUANTIZED, __half, T>::type PVT;  // P.V operand type
  // The FP8 ring runs the scores in f16 whatever T is: codes enter by one cvt each (bf16 needs bit moves
  // after it) and a bf16 query enters exactly through stage_q_f16's power of two.
  static constexpr bool K_F16 = QUANTIZED && STAGES > 0;
  typedef typename Select<K_F16, __half, T>::type QKT;  // score mma operand type

  // WARP_SLOTS: per-warp merge slots in static shared memory (DecodeConfig.warp_slots says when they fit)
  typedef DecodeSmem<T, NUM_WARPS, GROUP, DEPTH, Q_IN_SMEM, DEPTH, WARP_SLOTS> Smem;

  static constexpr int NQ = Q_SMEM_READS ? 1 : NK;  // Q fragments held in registers

  // Q fragments (rows g and g+8 of the group), in the K strip's permuted dim order. Depth > 128 keeps Q
  // in shared memory: its registers go to the wider output accumulator. The FP8 ring sets k_factor (it stages
  // Q as f16 through a power of two).
  static __device__ __forceinline__ void load_q(const DecodeArgs& a, Smem& sm, int b, int hk, int g, int c,
                                                uint4 (&qa)[NQ], uint4 (&qb)[NQ], float& k_factor) {
    const T* q = static_cast<const T*>(a.q) + ((i64)b * a.num_qo_heads + (i64)hk * GROUP) * DEPTH;
    if constexpr (K_F16) {
      k_factor = sm.stage_q_f16(q);
      if constexpr (!Q_SMEM_READS) {
#pragma unroll
        for (int s = 0; s < NK; ++s) sm.template q_frag<TWO_ROWS>(g, c, s, qa[s], qb[s]);
      }
    } else if constexpr (Q_IN_SMEM) {
      sm.stage_q(q, kQPre);
    } else {
#pragma unroll
      for (int s = 0; s < NK; ++s) {
        qa[s] = g < GROUP ? scale8<T>(*reinterpret_cast<const uint4*>(q + (i64)g * DEPTH + s * 32 + 8 * c), kQPre)
                          : make_uint4(0, 0, 0, 0);
        qb[s] = (TWO_ROWS && g + 8 < GROUP) ? scale8<T>(*reinterpret_cast<const uint4*>(q + (i64)(g + 8) * DEPTH + s * 32 + 8 * c), kQPre)
                                             : make_uint4(0, 0, 0, 0);
      }
    }
  }

  // FP8: raises gv to the strip's largest V scale (to the power of two at least it; al0/al1 take the change)
  // and returns 1 / gv (exact), what P's V scales are multiplied by. A quad holds all 16 tokens, and every
  // quad the same ones, so the largest scale (and the branch) is warp-uniform.
  static __device__ __forceinline__ float v_bound(Buf& bb, float& gv, float& al0, float& al1) {
    float vmax = 0.f;
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int i = 0; i < Buf::num_v_scales; ++i) vmax = fmaxf(vmax, bb.vs[r][i]);
    vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 1));
    vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 2));
    if (vmax > gv) {
      const float ng = pow2_at_least(vmax);
      al0 *= gv * (1.f / ng);  // exact: powers of two
      al1 *= gv * (1.f / ng);
      gv = ng;
    }
    return __int_as_float((254 << 23) - __float_as_int(gv));
  }

  // o *= the softmax's rescale factors (al0 for row g, al1 for row g + 8). Once the running max settles, most
  // strips leave it unchanged in every row: skip the rescale then.
  static __device__ __forceinline__ void rescale(float (&o)[NO][4], float& al0, float& al1) {
    if (!__all_sync(0xffffffffu, al0 == 1.f && al1 == 1.f)) {
#pragma unroll
      for (int j = 0; j < NO; ++j) {
        o[j][0] *= al0;
        o[j][1] *= al0;
        if constexpr (TWO_ROWS) {
          o[j][2] *= al1;
          o[j][3] *= al1;
        }
      }
    }
  }

  // o += P.V from bb's V registers; P (the strip's probabilities s) as the A operand, times the V scale of
  // its block over gv (FP8: inv_gv). SCALE_BLOCK 32 puts two blocks in a 64-dim group: lanes g < 4 hold the
  // first block's columns, so each block's mma gets the other block's B columns as zeros.
  static __device__ __forceinline__ void pv(Buf& bb, int g, float (&s)[2][4], float inv_gv, float (&o)[NO][4]) {
#pragma unroll
    for (int grp = 0; grp < NO / 8; ++grp) {
      u32 bf[8][2];
      bb.v_frags(grp, bf);
      constexpr int kBlocks = (Buf::quantized && Buf::SB < 64) ? 2 : 1;
#pragma unroll
      for (int hb = 0; hb < kBlocks; ++hb) {
        float f[4] = {1.f, 1.f, 1.f, 1.f};
        if constexpr (QUANTIZED) {
          // past the head (d96's second group) the B columns are zeros; any finite scale will do
          const int blk = min(kBlocks == 2 ? 2 * grp + hb : (grp * 64) / Buf::SB, Buf::num_v_scales - 1);
#pragma unroll
          for (int r = 0; r < 4; ++r) f[r] = bb.vs[r][blk] * inv_gv;
        }
        const u32 pa0 = ElemTraits<PVT>::pack(s[0][0] * f[0], s[0][1] * f[1]);
        const u32 pa2 = ElemTraits<PVT>::pack(s[1][0] * f[2], s[1][1] * f[3]);
        const u32 pa1 = TWO_ROWS ? ElemTraits<PVT>::pack(s[0][2] * f[0], s[0][3] * f[1]) : 0u;
        const u32 pa3 = TWO_ROWS ? ElemTraits<PVT>::pack(s[1][2] * f[2], s[1][3] * f[3]) : 0u;
        const bool mine = kBlocks == 1 || ((g < 4) == (hb == 0));
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const int j = grp * 8 + jj;
          mma_16816<PVT>(o[j], pa0, pa1, pa2, pa3, mine ? bf[jj][0] : 0u, mine ? bf[jj][1] : 0u);
        }
      }
    }
  }

  // Ring (FP8): the warp copies whole rows of each strip (cp.async) STAGES - 1 strips ahead into its slots and
  // reads its fragments back right before the strip; page rows are looked up one strip further ahead still.
  // buf is the caller's (declared in here, it changes ptxas's register allocation).
  template <class Strip>
  static __device__ __forceinline__ void ring_strips(const Op& op, const int& b, const int& hk, const int& warp,
                                                     const int& start, const int& len, const int& my_lo,
                                                     const int& my_hi, Buf& buf, Strip&& strip) {
    extern __shared__ __align__(16) unsigned char ring[];
    unsigned char* my_ring = ring + warp * STAGES * Buf::SLOT_BYTES;
    const u32 my_ring_s = smem_addr(my_ring);
    StripRing<Op, STAGES, BN> sr(op, b, my_lo + warp, my_hi, NUM_WARPS);
    auto issue = [&](i64 base, int t0, int slot) {
      Buf::issue(op, b, hk, t0, start, len, base, my_ring_s + slot * Buf::SLOT_BYTES);
    };
    sr.prologue(issue);
    sr.run(issue, [&](int t0, int slot) {
      const unsigned char* here = my_ring + slot * Buf::SLOT_BYTES;
      buf.fetch_k(here);
      strip(buf, t0, [&] { buf.fetch_v(here); }, [] {});
    });
  }

  // The ring by tensor copies (TMA): the same strips, slots and reads, but the code slots start on 1024 bytes (the
  // 128-byte swizzle's pattern), the scales sit in blocks of their own after them, and a slot's strip lands on its own
  // mbarrier (each lane arrives once per strip, after its cp.async copies; tensor copies count their bytes).
  template <class Strip>
  static __device__ __forceinline__ void ring_strips_tma(const Op& op, const DecodeMaps* maps, const int& b,
                                                         const int& hk, const int& warp, const int& start, const int& len,
                                                         const int& my_lo, const int& my_hi, Buf& buf, Strip&& strip) {
    extern __shared__ __align__(16) unsigned char ring_raw[];
    const u32 raw_at = smem_addr(ring_raw);
    const u32 ring_at = (raw_at + 1023u) & ~1023u;
    const unsigned char* ring = ring_raw + (ring_at - raw_at);
    constexpr int SLOTS = NUM_WARPS * STAGES;
    const int my_first = warp * STAGES;  // this warp's first slot
    const u32 my_bars = ring_at + (u32)(SLOTS * Buf::SLOT_BYTES + 8 * my_first);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
      for (int s = 0; s < STAGES; ++s) mbar_init(my_bars + 8 * s, 32);
      fence_mbarrier_init();
    }
    __syncwarp();
    auto codes_at = [&](int slot) { return (my_first + slot) * Buf::CODE_BYTES; };
    auto scales_at = [&](int slot) { return SLOTS * Buf::CODE_BYTES + (my_first + slot) * Buf::SCALE_BYTES; };
    StripRing<Op, STAGES, BN, true> sr(op, b, my_lo + warp, my_hi, NUM_WARPS, my_bars);
    auto issue = [&](i64 base, int t0, int slot) {
      Buf::issue_tma(op, &maps->k, b, hk, t0, start, len, base, ring_at + (u32)codes_at(slot),
                     ring_at + (u32)scales_at(slot), my_bars + 8 * slot);
    };
    sr.prologue(issue);
    sr.run(issue, [&](int t0, int slot) {
      const unsigned char* codes = ring + codes_at(slot);
      const unsigned char* scales = ring + scales_at(slot);
      buf.fetch_k(codes, scales);
      strip(buf, t0, [&] { buf.fetch_v(codes, scales); }, [] {});
    });
  }

  // The register pipeline's first round: buf[sub] and base[sub] for strip ch + sub * NUM_WARPS (its K and V
  // loads already out where PIPELINE). The strip loop itself stays in run (as a function of its own, it
  // changes ptxas's register allocation of the 16-head kernels).
  static __device__ __forceinline__ void pipeline_prologue(const Op& op, const int& b, const int& hk, const int& start,
                                                           const int& len, const int& my_hi, const int& ch,
                                                           Buf (&buf)[SUB], i64 (&base)[SUB]) {
#pragma unroll
    for (int sub = 0; sub < SUB; ++sub) {
      buf[sub].set_tensor_scales(op);
      const int st = ch + sub * NUM_WARPS;
      base[sub] = PAGE_SIZE % BN == 0 ? Buf::rows_base(op, b, st * BN) : (i64)0;  // speculative: in-table
      if (PIPELINE && st < my_hi) {
        buf[sub].load_k(op, b, hk, st * BN, start, len, base[sub]);
        buf[sub].load_v(op, b, hk, st * BN, start, len, base[sub]);
      }
    }
  }

  static __device__ __forceinline__ void run(const DecodeArgs& a, const DecodeMaps* maps = nullptr) {
    __shared__ Smem sm;
    const Op op(a.kv);
    // Chunks are 16-token strips aligned to absolute positions (so a strip never straddles a page whose
    // size is a multiple of 16); splits take contiguous runs of chunks.
    const DecodeBlock blk(a, op);
    const int hk = blk.hk, b = blk.b, warp = blk.warp, g = blk.g, c = blk.c;
    const int len = blk.len, start = blk.start, my_lo = blk.lo, my_hi = blk.hi;

    uint4 qa[NQ], qb[NQ];
    float k_factor = kKFactor;  // what a raw FP8 score is multiplied by, beside the K scale
    load_q(a, sm, b, hk, g, c, qa, qb, k_factor);
    const float scale_log2 = a.sm_scale * kLog2e;

    float o[NO][4];
#pragma unroll
    for (int j = 0; j < NO; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m0 = -CUKV_INF, m1 = -CUKV_INF, l0 = 0.f, l1 = 0.f;
    float gv = 0x1p-126f;  // FP8: o is in units of gv (a power of two)

    // One strip of scores, softmax and P.V from bb's registers. after_scores runs once the K registers are
    // consumed (the pipeline reloads them there), after_pv once the V registers are.
    auto strip = [&](Buf& bb, int t0, auto&& after_scores, auto&& after_pv) {
      float s[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
      // Scores. K scale blocks (one for a 16-bit cache): a partial score per block, scaled per token after the
      // mma (inline: as a function of its own, the scores change ptxas's register allocation)
#pragma unroll
      for (int kb = 0; kb < Buf::num_k_scales; ++kb) {
        // the ring keeps two accumulators per n-tile (the k16 halves of each 32-dim step): half the dependent
        // mma chain (the register kernels have no registers to spare for it)
        constexpr int KH = STAGES > 0 ? 2 : 1;
        float acc[2][KH][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int h = 0; h < KH; ++h) acc[nt][h][0] = acc[nt][h][1] = acc[nt][h][2] = acc[nt][h][3] = 0.f;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int ks = kb * (NK / Buf::num_k_scales); ks < (kb + 1) * (NK / Buf::num_k_scales); ++ks) {
            uint4 xa, xb;
            if constexpr (Q_SMEM_READS) {
              sm.template q_frag<TWO_ROWS>(g, c, ks, xa, xb);
            } else {
              xa = qa[ks];
              xb = qb[ks];
            }
            const uint4 kk = bb.template k_val<QKT>(nt, ks);
            mma_16816<QKT>(acc[nt][0], xa.x, xb.x, xa.y, xb.y, kk.x, kk.y);
            mma_16816<QKT>(acc[nt][KH - 1], xa.z, xb.z, xa.w, xb.w, kk.z, kk.w);
          }
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float sum = acc[nt][0][e];
#pragma unroll
            for (int h = 1; h < KH; ++h) sum += acc[nt][h][e];
            if constexpr (QUANTIZED) s[nt][e] += sum * (bb.ks[2 * nt + (e & 1)][kb] * k_factor);
            else s[nt][e] = sum;
          }
      }
      after_scores();
      float al0, al1;
      strip_softmax<TWO_ROWS>(a, scale_log2, s, t0, start, len, m0, m1, l0, l1, al0, al1);
      float inv_gv = 1.f;  // FP8: what P's V scales are multiplied by
      if constexpr (QUANTIZED) inv_gv = v_bound(bb, gv, al0, al1);
      rescale(o, al0, al1);
      pv(bb, g, s, inv_gv, o);
      after_pv();
    };
    if constexpr (STAGES > 0) {
      Buf buf;
      if constexpr (TMA) ring_strips_tma(op, maps, b, hk, warp, start, len, my_lo, my_hi, buf, strip);
      else ring_strips(op, b, hk, warp, start, len, my_lo, my_hi, buf, strip);
    } else {
      // Software pipeline (depth <= 128): strip i+1's K loads go out right after strip i's scores, its V loads
      // right after strip i's P.V, and its page lookup at the top of strip i, so every warp keeps SUB strips
      // of loads in flight while it computes, in the same registers. A warp's strips in one round are
      // ch + sub * NUM_WARPS (sub < SUB); FP8 caches use SUB = 2 so the bytes in flight match the 16-bit cache.
      Buf buf[SUB];
      i64 base[SUB];
      int ch = my_lo + warp;
      pipeline_prologue(op, b, hk, start, len, my_hi, ch, buf, base);
      for (; ch < my_hi; ch += NUM_WARPS * SUB) {
#pragma unroll
        for (int sub = 0; sub < SUB; ++sub) {
          const int st = ch + sub * NUM_WARPS;
          if (st >= my_hi) break;
          const int t0 = st * BN;
          const int nch = st + NUM_WARPS * SUB;
          const bool has_next = nch < my_hi;
          const i64 nbase = (PAGE_SIZE % BN == 0 && has_next) ? Buf::rows_base(op, b, nch * BN) : (i64)0;
          if constexpr (!PIPELINE) {
            buf[sub].load_k(op, b, hk, t0, start, len, base[sub]);
            if constexpr (!V_LATE) buf[sub].load_v(op, b, hk, t0, start, len, base[sub]);
          }
          strip(
              buf[sub], t0,
              [&] {
                if (PIPELINE && has_next) buf[sub].load_k(op, b, hk, nch * BN, start, len, nbase);
                if constexpr (V_LATE) buf[sub].load_v(op, b, hk, t0, start, len, base[sub]);
              },
              [&] {
                if (PIPELINE && has_next) buf[sub].load_v(op, b, hk, nch * BN, start, len, nbase);
              });
          base[sub] = nbase;
        }
      }
    }

    if constexpr (QUANTIZED) {
#pragma unroll
      for (int j = 0; j < NO; ++j) o[j][0] *= gv, o[j][1] *= gv, o[j][2] *= gv, o[j][3] *= gv;
    }

    decode_epilogue<T, DEPTH, GROUP, NUM_WARPS, CLUSTER>(a, sm, o, m0, m1, l0, l1, [&](int j, int e) {
      return (j / 8) * 64 + 16 * c + (j % 8) + 8 * (e & 1);  // the V strip's permuted output columns
    }, WARP_SLOTS ? &sm.slots[0][0] : nullptr, Smem::SLOT_FLOATS);
  }
};

// One warp combines the num_splits partials of (b, hq) by their LSE; empty partitions (-inf, zero output)
// get weight 0. Partials are read through L2 (ld.cg): other blocks wrote them during this launch. The lanes
// load 32 LSEs at a time and the partial rows go out 8 at a time, so the merge costs a few L2 round trips
// rather than two per split.
template <typename T, int DEPTH>
__device__ __forceinline__ void merge_row(const DecodeArgs& a, int b, int hq, int batch) {
  constexpr int NI = (DEPTH + 31) / 32;
  constexpr int U = NI > 4 ? 4 : 8;  // partial rows in flight (32 registers of them)
  const int lane = threadIdx.x & 31;
  const int n = a.num_splits;
  const i64 bh = (i64)b * a.num_qo_heads + hq;
  const i64 stride = (i64)batch * a.num_qo_heads;
  const float x0 = lane < n ? __ldcg(a.part_lse + lane * stride + bh) : -CUKV_INF;
  float mm = x0;
  for (int s = lane + 32; s < n; s += 32) mm = fmaxf(mm, __ldcg(a.part_lse + s * stride + bh));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, o));
  float acc[NI];
#pragma unroll
  for (int i = 0; i < NI; ++i) acc[i] = 0.f;
  float wsum = 0.f;
  for (int s0 = 0; s0 < n; s0 += 32) {
    const float x = s0 == 0 ? x0 : (s0 + lane < n ? __ldcg(a.part_lse + (s0 + lane) * stride + bh) : -CUKV_INF);
    const float w = x == -CUKV_INF ? 0.f : fast_exp2(x - mm);  // lane j: the weight of split s0 + j
    wsum += w;
    const int cnt = min(32, n - s0);
    for (int j0 = 0; j0 < cnt; j0 += U) {
      float v[U][NI];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float* po = a.part_o + ((s0 + j0 + u) * stride + bh) * DEPTH;
#pragma unroll
        for (int i = 0; i < NI; ++i) v[u][i] = (j0 + u < cnt && i * 32 + lane < DEPTH) ? __ldcg(po + i * 32 + lane) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float wu = __shfl_sync(0xffffffffu, w, j0 + u);
#pragma unroll
        for (int i = 0; i < NI; ++i) acc[i] += wu * v[u][i];
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) wsum += __shfl_xor_sync(0xffffffffu, wsum, o);
#pragma unroll
  for (int i = 0; i < NI; ++i)
    if (i * 32 + lane < DEPTH)
      static_cast<T*>(a.out)[bh * DEPTH + i * 32 + lane] = ElemTraits<T>::from_float(out_value(a, hq, mm, wsum, acc[i]));
  if (lane == 0 && a.lse != nullptr) a.lse[bh] = out_lse(mm, wsum);
}

}  // namespace cukv
