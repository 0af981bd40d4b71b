// The consumer warpgroups of absorbed MLA decode (see mla_decode.cuh for the block's plan).
//
// Consumer warpgroup g (0 or 1) scores tokens [g * BN/2, (g + 1) * BN/2) of each tile against all 64 query
// rows and owns output columns [256 g, 256 g + 256). Per tile: S_g = Q K_g^T (wgmma, A and B from shared
// memory); the two exchange row maxima (named barrier 1) so both rescale by the same running max; each
// publishes its P fragments (named barrier 2); then O_g += [P_0 P_1] V[:, columns of g] (wgmma, P from
// registers, V transposed from the same shared tile). Scores are tracked in log2 units (s * scale * log2 e).
#pragma once
#include "mla_decode_consumer_state.cuh"

namespace cukv {

template <typename T, int BN, int STAGES, bool FP8 = false, bool SPARSE = false>
struct MLADecodeConsumer : MLADecodeConsumerState<T, MLAKVProducerPipeline<T, BN, STAGES, FP8, SPARSE>, SPARSE> {
  typedef MLAKVProducerPipeline<T, BN, STAGES, FP8, SPARSE> Pipe;
  typedef MLADecodeConsumerState<T, Pipe, SPARSE> State;
  using State::pipe, State::g, State::t, State::lane, State::m, State::mt, State::l, State::o, State::kORegs,
      State::stats, State::pwords;
  static constexpr int kHalf = Pipe::half;
  static constexpr int kSRegs = kHalf / 2, kPWords = kHalf / 4;
  typedef Wgmma<T, kHalf> MmaS;
  typedef Wgmma<T, 256> MmaO;

  __device__ __forceinline__ MLADecodeConsumer(const Pipe& p, int g_, int t_) : State(p, g_, t_) {}

  // S for this warpgroup's tokens of stage s, scaled to log2 units and masked: token columns at or past a row's
  // limit become -inf (selected, never multiplied). Sparse: so do the columns whose row the producer left
  // zero (bit c of `valid` for this half's column c).
  __device__ __forceinline__ void scores(float (&s)[kSRegs], int stage, int tok0, int lim0, int lim1, float sl2,
                                         u32 valid = 0u) {
    State::template qk<MmaS>(s, pipe.stage(stage) + (u32)(g * kHalf * kAtomRowBytes));
    const int c0 = tok0 + g * kHalf + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < kHalf / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = c0 + 8 * j + e;
        if constexpr (SPARSE) {  // one key list per block: lim0 == lim1, and `valid` already stops there
          const bool ok = (valid >> (2 * (lane & 3) + 8 * j + e)) & 1u;
          s[4 * j + e] = ok ? s[4 * j + e] * sl2 : -CUKV_INF;
          s[4 * j + 2 + e] = ok ? s[4 * j + 2 + e] * sl2 : -CUKV_INF;
        } else {
          s[4 * j + e] = col < lim0 ? s[4 * j + e] * sl2 : -CUKV_INF;
          s[4 * j + 2 + e] = col < lim1 ? s[4 * j + 2 + e] * sl2 : -CUKV_INF;
        }
      }
    }
  }

  // The new running max of both rows (this warpgroup's tile half and the other's), the rescale of O and l,
  // and P = exp2(s - max) packed in T as mma A fragments.
  __device__ __forceinline__ void softmax(float (&s)[kSRegs], u32 (&p)[kPWords]) {
    float mx[2] = {-CUKV_INF, -CUKV_INF};
#pragma unroll
    for (int j = 0; j < kHalf / 8; ++j) {
      mx[0] = fmaxf(mx[0], fmaxf(s[4 * j], s[4 * j + 1]));
      mx[1] = fmaxf(mx[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    stats()[g * 128 + t] = make_float2(mx[0], mx[1]);
    named_barrier_sync<256>(1);
    const float2 other = stats()[(1 - g) * 128 + t];
    mt[0] = fmaxf(mt[0], fmaxf(mx[0], other.x));
    mt[1] = fmaxf(mt[1], fmaxf(mx[1], other.y));
    const float2 next = State::next_max(make_float2(m[0], m[1]), make_float2(mt[0], mt[1]));
    const float mn[2] = {next.x, next.y};
    float base[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      base[r] = mn[r] == -CUKV_INF ? 0.f : mn[r];  // a row with nothing visible yet keeps exp2(-inf) = 0
      alpha[r] = mla_exp2(m[r] - base[r]);
      m[r] = mn[r];
      l[r] *= alpha[r];
    }
#pragma unroll
    for (int j = 0; j < kHalf / 8; ++j) {
      const float e0 = mla_exp2(s[4 * j] - base[0]), e1 = mla_exp2(s[4 * j + 1] - base[0]);
      const float e2 = mla_exp2(s[4 * j + 2] - base[1]), e3 = mla_exp2(s[4 * j + 3] - base[1]);
      l[0] += e0 + e1;
      l[1] += e2 + e3;
      p[2 * j] = ElemTraits<T>::pack(e0, e1);
      p[2 * j + 1] = ElemTraits<T>::pack(e2, e3);
    }
    if (State::unit(make_float2(alpha[0], alpha[1]))) return;
#pragma unroll
    for (int j = 0; j < kORegs / 4; ++j) {
      o[4 * j] *= alpha[0];
      o[4 * j + 1] *= alpha[0];
      o[4 * j + 2] *= alpha[1];
      o[4 * j + 3] *= alpha[1];
    }
  }

  // O[:, this warpgroup's 256 columns] += P V over the tile's BN tokens; P of the other half comes from the
  // other warpgroup through shared memory (word q of thread t at [g][q][t]: conflict-free).
  __device__ __forceinline__ void accumulate(const u32 (&p)[kPWords], int stage) {
    u32* pw = pwords();
#pragma unroll
    for (int q = 0; q < kPWords; ++q) pw[(g * kPWords + q) * 128 + t] = p[q];
    named_barrier_sync<256>(2);
    u32 po[kPWords];
#pragma unroll
    for (int q = 0; q < kPWords; ++q) po[q] = pw[((1 - g) * kPWords + q) * 128 + t];
    const u64 vd = sw128_desc(pipe.stage(stage) + (u32)(g * 4 * Pipe::atom_col_bytes), Pipe::atom_col_bytes, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const int q = (kk % (kHalf / 16)) * 4;  // this k16 step's words within its half
      const bool own = (kk < kHalf / 16) == (g == 0);
      const u32 frag[4] = {own ? p[q] : po[q], own ? p[q + 1] : po[q + 1], own ? p[q + 2] : po[q + 2],
                           own ? p[q + 3] : po[q + 3]};
      MmaO::rs(o, frag, desc_add(vd, (u32)(kk * 16 * kAtomRowBytes)), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o);
  }

  __device__ void consume(const MLADecodeParams& a, const MLAWorkItem& w, int n_tiles) {
    const int warp = t >> 5;
    const int r0 = warp * 16 + (lane >> 2);
    const int len = SPARSE ? w.end : a.seq_lens[w.batch];
    const int lim0 = mla_row_limit(a, w, len, w.row_block * kMlaBlockM + r0);
    const int lim1 = mla_row_limit(a, w, len, w.row_block * kMlaBlockM + r0 + 8);
    mbar_wait(pipe.q_full(), 0);
    fence_proxy_async();
    const int peer = Pipe::fp8_pair ? cluster_rank() ^ 1 : 0;  // fp8_pair: the other block of the pair
#pragma unroll 1
    for (int it = 0; it < n_tiles; ++it) {
      const int stage = it % STAGES;
      mbar_wait(pipe.full(stage), (it / STAGES) & 1);
      fence_proxy_async();
      float s[kSRegs];
      u32 valid = 0u;
      if constexpr (SPARSE) {  // this half's rows: producer warps 2g and 2g + 1
        const u32* vw = pipe.valid_words(stage);
        valid = vw[2 * g] | (vw[2 * g + 1] << (BN / 4));
      }
      scores(s, stage, w.begin + it * BN, lim0, lim1, a.scale_log2, valid);
      u32 p[kPWords];
      softmax(s, p);
      accumulate(p, stage);
      if (lane == 0) {
        mbar_arrive(pipe.empty(stage));
        if constexpr (Pipe::fp8_pair) mbar_arrive_remote(cluster_map(pipe.empty(stage), peer));  // its stores too
      }
    }
    State::template finish<false>(a, w, r0);
  }
};

}  // namespace cukv
