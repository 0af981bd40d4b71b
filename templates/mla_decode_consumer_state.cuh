// What both consumer schedules of absorbed MLA decode share (mla_decode_consumer.cuh, mla_decode_consumer_alt.cuh):
// a consumer thread's output accumulator O (its warpgroup's 256 columns of two rows), the rows' running max m and
// sum l (log2 units), the shared-memory exchange buffers, and the epilogue that adds the two warpgroups' l and
// writes the output (or a float32 partial), the LSE and (sparse) the max logit.
#pragma once
#include "mla_decode_producer.cuh"

namespace cukv {

// 2^x for the softmax: with the lazy rescale one ex2.approx.ftz (results below 2^-126 flush to 0, far below P's
// rounding), where exp2f adds a range check and two multiplies around it for denormal results. The eager kernels
// keep exp2f: with ex2 the eager slice consumer spills (72 bytes, NVRTC sm_90a).
__device__ __forceinline__ float mla_exp2(float x) {
#if CUKV_MLA_LAZY_RESCALE && !defined(CUKV_MLA_EXACT_EXP2)  // the define: a probe (probe_mla_rescale.py --define)
  return fast_exp2(x);
#else
  return exp2f(x);
#endif
}

// The 36 k-steps of a product over all 576 dims, A and B both K-major tiles of 128-byte-swizzled 64-value atom
// columns (a_col / b_col bytes apart), one commit group, waited on: Q K^T (A = the query block) in the 64-row
// consumers, K Q^T (A = the K tile) in the narrow ones.
template <class Mma, int N>
__device__ __forceinline__ void mla_dot576(float (&s)[N], u32 a, int a_col, u32 b, int b_col) {
  const u64 ad = sw128_desc(a, 1, 1024);
  const u64 bd = sw128_desc(b, 1, 1024);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < kMlaDim / 16; ++k)
    Mma::ss(s, desc_add(ad, (u32)((k / 4) * a_col + (k % 4) * 32)), desc_add(bd, (u32)((k / 4) * b_col + (k % 4) * 32)),
            k > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(s);
}

template <typename T, class Pipe, bool SPARSE = false>
struct MLADecodeConsumerState {
  static constexpr int kORegs = 128;
  // Lazy rescale: a warp's running max m moves only when some row's candidate max passes it by more than
  // kRescaleLog2 (log2 units), so most tiles leave O and l alone (P stays below 2^kRescaleLog2; l, the LSE and the
  // output use the same m). Both warpgroups hand each other the max they scaled to, so they stay in step.
  static constexpr bool kLazy = CUKV_MLA_LAZY_RESCALE != 0;
  static constexpr float kRescaleLog2 = 8.f;

  const Pipe& pipe;
  const int g, t, lane;  // warpgroup, thread in warpgroup, lane
  float m[2], l[2];
  float mt[2];  // the true running max of the scaled logits (sparse: max_logits); m lags it under kLazy
  float o[kORegs];

  __device__ __forceinline__ MLADecodeConsumerState(const Pipe& p, int g_, int t_)
      : pipe(p), g(g_), t(t_), lane(t_ & 31) {
    m[0] = m[1] = mt[0] = mt[1] = -CUKV_INF;
    l[0] = l[1] = 0.f;
#pragma unroll
    for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
  }

  // The max the rows scale to next, given the max they scale to now (m_old) and the candidate (>= m_old): the
  // candidate, or (kLazy) m_old while no row of the warp passes it by kRescaleLog2. A row going from nothing visible
  // (-inf) to a finite max always passes.
  __device__ __forceinline__ static float2 next_max(float2 m_old, float2 cand) {
    if constexpr (!kLazy) {
      return cand;
    } else {
      const bool grow = cand.x - m_old.x > kRescaleLog2 || cand.y - m_old.y > kRescaleLog2;
      return __any_sync(0xffffffffu, grow) ? cand : m_old;
    }
  }
  // Whether a rescale by alpha leaves every row of the warp as it is (kLazy only: the vote costs a cycle or two).
  __device__ __forceinline__ static bool unit(float2 alpha) {
    if constexpr (!kLazy) return false;
    else return __all_sync(0xffffffffu, alpha.x == 1.f && alpha.y == 1.f);
  }

  __device__ __forceinline__ float2* stats() const {
    extern __shared__ __align__(1024) char smem[];
    return reinterpret_cast<float2*>(smem + Pipe::stats_offset);
  }
  __device__ __forceinline__ u32* pwords() const {
    extern __shared__ __align__(1024) char smem[];
    return reinterpret_cast<u32*>(smem + Pipe::p_offset);
  }

  // S = Q K^T over all 576 dims for the tokens whose K rows start at shared address `k_rows` (a stage, or its
  // second half), the wgmmas waited on: Mma's N tokens into s.
  template <class Mma, int N>
  __device__ __forceinline__ void qk(float (&s)[N], u32 k_rows) const {
    mla_dot576<Mma>(s, pipe.q(), Pipe::q_atom_col_bytes, k_rows, Pipe::atom_col_bytes);
  }

  // Both warpgroups' l -> the row's total; then the output (direct) or the float32 partial and its LSE. kGuard: a
  // first barrier keeps the l exchange off the stats slots until both warpgroups have read their last use of them.
  // kMergeMt (SPARSE, alternating consumers: each warpgroup saw the maxima of its own tiles only): the true maxima
  // are exchanged too.
  template <bool kGuard, bool kMergeMt = false>
  __device__ void finish(const MLADecodeParams& a, const MLAWorkItem& w, int r0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // a row's sum is spread over the 4 lanes of its quad
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    if constexpr (kGuard) named_barrier_sync<256>(1);
    stats()[g * 128 + t] = make_float2(l[0], l[1]);
    named_barrier_sync<256>(1);
    const float2 other = stats()[(1 - g) * 128 + t];
    const float lt[2] = {l[0] + other.x, l[1] + other.y};
    if constexpr (SPARSE && kMergeMt) {
      named_barrier_sync<256>(1);  // both warpgroups have read the l slots
      stats()[g * 128 + t] = make_float2(mt[0], mt[1]);
      named_barrier_sync<256>(1);
      const float2 om = stats()[(1 - g) * 128 + t];
      mt[0] = fmaxf(mt[0], om.x);
      mt[1] = fmaxf(mt[1], om.y);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r0 + 8 * r, R = w.row_block * kMlaBlockM + row;
      if (R >= a.rows) continue;
      const bool any = lt[r] > 0.f;
      const float lse = any ? (m[r] + __log2f(lt[r])) * kLn2 : -CUKV_INF;
      float f = any ? 1.f / lt[r] : 0.f;
      const int col0 = g * 256 + 2 * (lane & 3);
      if (w.part < 0) {
        const int i = R / a.heads, h = R - i * a.heads;
        if (a.sink != nullptr && any) f /= 1.f + __expf(a.sink[h] - lse);
        const long long orow = ((long long)w.batch * a.s_q + i) * a.heads + h;
        T* out = reinterpret_cast<T*>(a.out) + orow * kMlaNope;
#pragma unroll
        for (int j = 0; j < kORegs / 4; ++j)
          *reinterpret_cast<u32*>(out + col0 + 8 * j) = ElemTraits<T>::pack(o[4 * j + 2 * r] * f, o[4 * j + 2 * r + 1] * f);
        if (a.lse != nullptr && g == 0 && (lane & 3) == 0) a.lse[orow] = lse;
        if constexpr (SPARSE)
          if (a.max_logits != nullptr && g == 0 && (lane & 3) == 0) a.max_logits[orow] = mt[r] * kLn2;
      } else {
        float* po = a.part_o + ((long long)w.part * kMlaBlockM + row) * kMlaNope;
#pragma unroll
        for (int j = 0; j < kORegs / 4; ++j)
          *reinterpret_cast<float2*>(po + col0 + 8 * j) = make_float2(o[4 * j + 2 * r] * f, o[4 * j + 2 * r + 1] * f);
        if (g == 0 && (lane & 3) == 0) a.part_lse[w.part * kMlaBlockM + row] = lse;
        if constexpr (SPARSE)
          if (g == 0 && (lane & 3) == 0) a.part_max[w.part * kMlaBlockM + row] = mt[r] * kLn2;
      }
    }
  }
};

}  // namespace cukv
