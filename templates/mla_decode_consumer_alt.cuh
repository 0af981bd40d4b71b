// The consumer warpgroups of absorbed MLA decode, alternating schedule (MLADecodeConfig.schedule = "alternate";
// the default "split" schedule is mla_decode_consumer.cuh). Same producer, ring, combine and shared-memory plan.
//
// Consumer warpgroup g (0 or 1) scores every other K tile: warpgroup 0 tiles 2k, warpgroup 1 tiles 2k + 1, each
// against all 64 query rows and all BN tokens (wgmma m64nBNk16, A = Q and B = K from shared memory). Each still
// owns output columns [256 g, 256 g + 256) and accumulates them over both tiles of a pair: its own P from
// registers, the other's P from shared memory. The running row max is handed over in tile order, so the two
// softmaxes run one after the other while the other warpgroup's wgmmas run:
//
//   warpgroup 0, pair k                          warpgroup 1, pair k
//   S0 = Q K[2k]^T                               S1 = Q K[2k+1]^T            (in parallel)
//   m0 = max(m, rowmax S0); P0; publish ---H0--> read m0, P0; issue O1 += P0 V[2k]
//   issue O0 += P0 V[2k]                         m1 = max(m0, rowmax S1); P1 (beside its wgmmas)
//   wait for H1                           <--H1--- publish m1, P1
//   read m1, P1; O0 += P1 V[2k+1]                O1 += P1 V[2k+1]
//
// O and l follow each new max (O scaled by alpha = exp2(m_old - m_new) before the wgmma that adds to it); both
// warpgroups end on the same max, and each l holds the sums of its own tiles' P. H0 and H1 are named barriers
// (warpgroup 0 arrives on H0, 1 syncs; the reverse for H1); the two strictly alternate, so neither is arrived on
// twice before the other side has synced. One P buffer (word q of thread t at [q][t]) and one max slot per
// warpgroup suffice: slot [q][t] is written and read only by thread t of each warpgroup, in the order
// W0 (P of 2k) -> R1 -> W1 (P of 2k + 1) -> R0 -> W0 (P of 2k + 2), each arrow a barrier or program order.
// Each warp of each warpgroup arrives on a stage's empty barrier once, after its last wgmma on the stage (8
// arrivals per tile, as in the split schedule).
#pragma once
#include "mla_decode_consumer_state.cuh"

namespace cukv {

// SPARSE (with SLICES only: sparse_mla.cu.j2): a tile's keys are real where the producer's validity bits say so.
template <typename T, int BN, int STAGES, bool FP8 = false, bool SLICES = false, bool SPARSE = false>
struct MLADecodeAltConsumer
    : MLADecodeConsumerState<T, MLAKVProducerPipeline<T, BN, STAGES, FP8, SPARSE, SLICES>, SPARSE> {
  // SLICES: mla_decode_consumer_slices.cuh
  typedef MLAKVProducerPipeline<T, BN, STAGES, FP8, SPARSE, SLICES> Pipe;
  typedef MLADecodeConsumerState<T, Pipe, SPARSE> State;
  using State::pipe, State::g, State::t, State::lane, State::m, State::l, State::o, State::kORegs, State::stats,
      State::pwords, State::mt;
  static constexpr int kSRegs = BN / 2, kPWords = BN / 4;
  static constexpr int kBarH0 = 3, kBarH1 = 4;  // named barriers (1 is the epilogue's, 2 the split schedule's)
  static_assert(Pipe::p_bytes == 128 * kPWords * 4, "one P buffer of a whole tile's words per thread");
  typedef Wgmma<T, BN> MmaS;
  typedef Wgmma<T, 256> MmaO;

  __device__ __forceinline__ MLADecodeAltConsumer(const Pipe& p, int g_, int t_) : State(p, g_, t_) {}

  // S for all BN tokens of stage s, scaled to log2 units and masked (token columns at or past a row's limit
  // become -inf: selected, never multiplied); returns the row maxima of this thread's two rows over the quad.
  __device__ __forceinline__ float2 scores(float (&s)[kSRegs], int stage, int tok0, int lim0, int lim1, float sl2) {
    State::template qk<MmaS>(s, pipe.stage(stage));
    return mask_rowmax(s, tok0, lim0, lim1, sl2);
  }

  // SPARSE: whether every key of the tile at ring position r is real (Pipe::tile_valid_words: bit k of the pair for
  // token k)
  __device__ __forceinline__ bool all_valid(int r) const {
    const u32* vw = pipe.tile_valid_words(r);
    return (vw[0] & vw[1]) == ~0u;
  }

  // scores()'s scaling and masking of S (tokens tok0 ..) already computed, and its row maxima. SPARSE: the validity
  // words of the tile at ring position `valid_pos` say which keys are real (the others become -inf too); the true max
  // follows (mt).
  __device__ __forceinline__ float2 mask_rowmax(float (&s)[kSRegs], int tok0, int lim0, int lim1, float sl2,
                                                int valid_pos = 0) {
    float2 mx;
#if CUKV_MLA_LAZY_RESCALE  // (the eager kernels spill 4 bytes with the second path)
    // a tile wholly inside every row's limit (all but a sequence's last one or two) needs no per-score compares
    // (SPARSE: a tile of real keys only; the limits add nothing, the gathered list stopping at the item's end)
    if (__all_sync(0xffffffffu, SPARSE ? all_valid(valid_pos) : tok0 + BN <= min(lim0, lim1)))
      mx = scale_rowmax<false>(s, tok0, lim0, lim1, sl2, valid_pos);
    else
#endif
      mx = scale_rowmax<true>(s, tok0, lim0, lim1, sl2, valid_pos);
    if constexpr (SPARSE) {
      mt[0] = fmaxf(mt[0], mx.x);
      mt[1] = fmaxf(mt[1], mx.y);
    }
    return mx;
  }

  // mask_rowmax's work; kMask: scores at or past a row's limit become -inf (SPARSE: those of invalid keys; the
  // gathered list stops at the item's end, and a padding row's zero query scores nothing but 0)
  template <bool kMask>
  __device__ __forceinline__ float2 scale_rowmax(float (&s)[kSRegs], int tok0, int lim0, int lim1, float sl2,
                                                 int valid_pos) {
    const int c0 = tok0 + 2 * (lane & 3);
    // SPARSE: this thread's columns 2 (lane & 3) + 8 j + e at bits 8 j + e of two words (j < 4 and j >= 4)
    u32 vlo = 0u, vhi = 0u;
    if constexpr (SPARSE && kMask) {
      const u32* vw = pipe.tile_valid_words(valid_pos);
      vlo = vw[0] >> (2 * (lane & 3));
      vhi = vw[1] >> (2 * (lane & 3));
    }
    float mx[2] = {-CUKV_INF, -CUKV_INF};
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = c0 + 8 * j + e;
        if constexpr (SPARSE) {
          const bool key = !kMask || (((j < 4 ? vlo : vhi) >> (8 * (j & 3) + e)) & 1u);
          s[4 * j + e] = key ? s[4 * j + e] * sl2 : -CUKV_INF;
          s[4 * j + 2 + e] = key ? s[4 * j + 2 + e] * sl2 : -CUKV_INF;
        } else {
          s[4 * j + e] = !kMask || col < lim0 ? s[4 * j + e] * sl2 : -CUKV_INF;
          s[4 * j + 2 + e] = !kMask || col < lim1 ? s[4 * j + 2 + e] * sl2 : -CUKV_INF;
        }
        mx[0] = fmaxf(mx[0], s[4 * j + e]);
        mx[1] = fmaxf(mx[1], s[4 * j + 2 + e]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    return make_float2(mx[0], mx[1]);
  }

  // The running max moves to mn (>= m) and l with it; returns alpha = exp2(m_old - mn), by which O must be
  // scaled before its next wgmma. A row with nothing visible yet (mn = -inf) gets alpha 0 (its O and l are 0).
  __device__ __forceinline__ float2 follow(float2 mn) {
    const float2 alpha = make_float2(mla_exp2(m[0] - (mn.x == -CUKV_INF ? 0.f : mn.x)),
                                     mla_exp2(m[1] - (mn.y == -CUKV_INF ? 0.f : mn.y)));
    m[0] = mn.x;
    m[1] = mn.y;
    l[0] *= alpha.x;
    l[1] *= alpha.y;
    return alpha;
  }

  __device__ __forceinline__ void scale_o(float2 alpha) {
    if (State::unit(alpha)) return;
#pragma unroll
    for (int j = 0; j < kORegs / 4; ++j) {
      o[4 * j] *= alpha.x;
      o[4 * j + 1] *= alpha.x;
      o[4 * j + 2] *= alpha.y;
      o[4 * j + 3] *= alpha.y;
    }
  }

  // P = exp2(s - m) packed in T as mma A fragments (the running max m already includes this tile), l += its sums.
  __device__ __forceinline__ void probabilities(const float (&s)[kSRegs], u32 (&p)[kPWords]) {
    const float base0 = m[0] == -CUKV_INF ? 0.f : m[0], base1 = m[1] == -CUKV_INF ? 0.f : m[1];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const float e0 = mla_exp2(s[4 * j] - base0), e1 = mla_exp2(s[4 * j + 1] - base0);
      const float e2 = mla_exp2(s[4 * j + 2] - base1), e3 = mla_exp2(s[4 * j + 3] - base1);
      l[0] += e0 + e1;
      l[1] += e2 + e3;
      p[2 * j] = ElemTraits<T>::pack(e0, e1);
      p[2 * j + 1] = ElemTraits<T>::pack(e2, e3);
    }
  }

  // Hand this tile's max and P to the other warpgroup (its slot, the shared P buffer), then arrive on `bar`.
  __device__ __forceinline__ void publish(const u32 (&p)[kPWords], int bar) {
    u32* pw = pwords();
#pragma unroll
    for (int q = 0; q < kPWords; ++q) pw[q * 128 + t] = p[q];
    stats()[g * 128 + t] = make_float2(m[0], m[1]);
    __threadfence_block();
    named_barrier_arrive<256>(bar);
  }

  // The other warpgroup's max and P, once it has arrived on `bar`.
  __device__ __forceinline__ float2 receive(u32 (&p)[kPWords], int bar) {
    named_barrier_sync<256>(bar);
    const u32* pw = pwords();
#pragma unroll
    for (int q = 0; q < kPWords; ++q) p[q] = pw[q * 128 + t];
    return stats()[(1 - g) * 128 + t];
  }

  // Issue O[:, this warpgroup's 256 columns] += P V over the BN tokens of stage s. Until pv_retire, neither O nor
  // p may be touched (the wgmmas read p and accumulate into O asynchronously); other registers may.
  __device__ __forceinline__ void pv_issue(const u32 (&p)[kPWords], int stage) {
    const u64 vd = sw128_desc(pipe.stage(stage) + (u32)(g * 4 * Pipe::atom_col_bytes), Pipe::atom_col_bytes, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const u32 frag[4] = {p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3]};
      MmaO::rs(o, frag, desc_add(vd, (u32)(kk * 16 * kAtomRowBytes)), 1);
    }
    wgmma_commit();
  }

  // Wait for the P V wgmmas; then this warp releases the stage (its last use of it).
  __device__ __forceinline__ void pv_retire(int stage) {
    wgmma_wait<0>();
    fence_regs(o);
    if (lane == 0) mbar_arrive(pipe.empty(stage));
  }

  __device__ __forceinline__ void wait_tile(int it) const {
    mbar_wait(pipe.full(it % STAGES), (it / STAGES) & 1);
    fence_proxy_async();
  }

  __device__ void consume(const MLADecodeParams& a, const MLAWorkItem& w, int n_tiles) {
    const int warp = t >> 5;
    const int r0 = warp * 16 + (lane >> 2);
    const int len = a.seq_lens[w.batch];
    const int lim0 = mla_row_limit(a, w, len, w.row_block * kMlaBlockM + r0);
    const int lim1 = mla_row_limit(a, w, len, w.row_block * kMlaBlockM + r0 + 8);
    mbar_wait(pipe.q_full(), 0);
    fence_proxy_async();
#pragma unroll 1
    for (int t0 = 0; t0 < n_tiles; t0 += 2) {
      const int t1 = t0 + 1;
      const bool pair = t1 < n_tiles;  // the same in both warpgroups
      u32 p[kPWords];
      if (g == 0) {
        wait_tile(t0);
        float s[kSRegs];
        const float2 mx = scores(s, t0 % STAGES, w.begin + t0 * BN, lim0, lim1, a.scale_log2);
        const float2 a0 = follow(State::next_max(make_float2(m[0], m[1]), make_float2(fmaxf(m[0], mx.x), fmaxf(m[1], mx.y))));
        probabilities(s, p);
        publish(p, kBarH0);  // warpgroup 1 goes on with its softmax while this one runs P0 V
        scale_o(a0);
        pv_issue(p, t0 % STAGES);
        if (pair) {
          u32 p1[kPWords];
          const float2 m1 = receive(p1, kBarH1);  // waits while P0 V runs
          pv_retire(t0 % STAGES);
          scale_o(follow(m1));
          wait_tile(t1);
          pv_issue(p1, t1 % STAGES);
          pv_retire(t1 % STAGES);
        } else {
          pv_retire(t0 % STAGES);
        }
      } else {
        float s[kSRegs];
        float2 mx = make_float2(-CUKV_INF, -CUKV_INF);
        if (pair) {
          wait_tile(t1);
          mx = scores(s, t1 % STAGES, w.begin + t1 * BN, lim0, lim1, a.scale_log2);
        }
        u32 p0[kPWords];
        const float2 m0 = receive(p0, kBarH0);
        scale_o(follow(m0));  // O and l to m0, the max P0 is scaled to
        wait_tile(t0);
        pv_issue(p0, t0 % STAGES);
        float2 a1 = make_float2(1.f, 1.f);
        if (pair) {  // the softmax of tile t1 while P0 V runs
          a1 = follow(State::next_max(m0, make_float2(fmaxf(m0.x, mx.x), fmaxf(m0.y, mx.y))));
          probabilities(s, p);
          publish(p, kBarH1);  // warpgroup 0 goes on with P1 V
        }
        pv_retire(t0 % STAGES);
        if (pair) {
          scale_o(a1);  // then O to the pair's max, the one P1 is scaled to
          pv_issue(p, t1 % STAGES);
          pv_retire(t1 % STAGES);
        }
      }
    }
    State::template finish<true>(a, w, r0);
  }
};

}  // namespace cukv
