// The consumer warpgroups of absorbed MLA decode for blocks of at most 32 query rows (MLADecodeConfig.schedule =
// "narrow"; few heads, as in tensor-parallel serving). Same producer, ring, combine and shared-memory plan as the
// other schedules.
//
// A 64-row block that holds 16 heads leaves 3/4 of every m64 wgmma on padding rows. Here the tile's 64 tokens are the
// wgmma M and the NR query rows (16 or 32) its N, so no tensor work is spent on padding:
//
//   S^T[64 tokens, NR] = K Q^T       wgmma m64nNRk16 x 36, A = the K tile, B = the query block (both K-major)
//   P^T = exp2(S^T - m) per column   the column max over the tile's 64 tokens: 4 warps through shared memory
//   O^T[512, NR] += V^T P^T          wgmma m64nNRk16 x 8 d-blocks x 4 k-steps, A = the same tile read transposed
//                                    (V^T, MN-major), B = P stored as [NR rows][64 tokens] (stmatrix .trans)
//
// Warpgroup g consumes tiles 2k + g whole, with a running max, sum and O^T of its own (4 NR accumulators a thread),
// so the two warpgroups never wait for each other inside the loop: one's softmax runs beside the other's wgmmas. The
// epilogue merges the two states through the (then idle) ring and writes the rows coalesced. Each tile has one
// consuming warpgroup, whose 4 warps arrive on the stage's empty barrier with a count of 2 each (it expects 8).
//
// The accumulator fragment of m64nN (S^T, and each d-block of O^T): register 4j + 2h + e of thread (warp w, lane)
// holds M-row 16w + lane / 4 + 8h and column 8j + 2 (lane % 4) + e; a thread's columns (query rows) are the same in
// S^T and O^T, so the per-column max, sum and rescale factor live in the thread that applies them.
#pragma once
#include "mla_decode_consumer_state.cuh"

namespace cukv {

template <typename T, class Pipe_, int NR>
struct MLADecodeNarrowConsumer {
  typedef Pipe_ Pipe;  // an MLAKVProducerPipeline staging NR query rows
  typedef Wgmma<T, NR> Mma;
  static constexpr int BN = Pipe::BN, STAGES = Pipe::num_kv_stages;
  static constexpr bool SPARSE = Pipe::sparse;
  static_assert(BN == 64, "the tile's 64 tokens are the wgmma M");
  static_assert(Pipe::q_rows == NR, "the query block holds the NR rows");
  static_assert(NR == 16 || NR == 32, "16 or 32 query rows per block");
  static constexpr int kJ = NR / 8;                 // 8-column groups of the fragment
  static constexpr int kSRegs = NR / 2;             // one m64nNR fragment
  static constexpr int kCols = 2 * kJ;              // columns a thread holds
  static constexpr int kDBlocks = kMlaNope / 64;    // O^T's m64 blocks
  static constexpr bool kLazy = CUKV_MLA_LAZY_RESCALE != 0;
  static constexpr float kRescaleLog2 = 8.f;
  static constexpr int kBarWG = 6;                  // + g: one warpgroup's 128 threads (1 is both warpgroups')
  // P^T of warpgroup g: NR rows of 64 tokens (128 B, swizzled), at p_offset + g * kPBytes
  static constexpr int kPBytes = 4096;
  static_assert(NR * kAtomRowBytes <= kPBytes && 2 * kPBytes <= Pipe::p_bytes, "P^T buffers fit");
  // column maxima of a tile: [warpgroup][tile parity][warp][NR] floats in the stats slots
  static_assert(2 * 2 * 4 * NR * 4 <= Pipe::stats_bytes, "column-max slots fit");
  // epilogue, in the ring: each warpgroup's scaled O as [NR][kOStride] floats, then m, true max and l per column
  static constexpr int kOStride = kMlaNope + 4;     // 4 floats of padding: the fragment's stores are conflict-free
  static constexpr int kOBytes = NR * kOStride * 4;
  static_assert(2 * kOBytes + (2 * NR * 2 + 2 * 4 * NR) * 4 <= STAGES * Pipe::k_bytes, "epilogue fits the ring");

  const Pipe& pipe;
  const int g, t, lane, warp;
  float m[kCols], mt[kCols], l[kCols];  // log2 units: the max P is scaled to, the true max, this thread's sum
  float o[kDBlocks][kSRegs];

  __device__ __forceinline__ MLADecodeNarrowConsumer(const Pipe& p, int g_, int t_)
      : pipe(p), g(g_), t(t_), lane(t_ & 31), warp(t_ >> 5) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) m[c] = mt[c] = -CUKV_INF, l[c] = 0.f;
#pragma unroll
    for (int b = 0; b < kDBlocks; ++b)
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) o[b][i] = 0.f;
  }

  static __device__ __forceinline__ char* smem_base() {
    extern __shared__ __align__(1024) char smem[];
    return smem;
  }
  // column c of this thread's slot ci (ci = 2j + e)
  __device__ __forceinline__ int col(int ci) const { return 8 * (ci >> 1) + 2 * (lane & 3) + (ci & 1); }

  // S^T of stage `stage` (waited on) into s.
  __device__ __forceinline__ void scores(float (&s)[kSRegs], int stage) const {
    mla_dot576<Mma>(s, pipe.stage(stage), Pipe::atom_col_bytes, pipe.q(), Pipe::q_atom_col_bytes);
  }

  // Softmax of one tile: s scaled and masked, the columns' new max (max over the 4 warps through shared memory,
  // slots of tile parity `par`), O^T and l rescaled, P^T (as T) stored for the P V wgmmas.
  __device__ __forceinline__ void softmax(float (&s)[kSRegs], int par, const bool (&ok)[2][kCols], float sl2) {
#pragma unroll
    for (int ci = 0; ci < kCols; ++ci) {
      const int i0 = 4 * (ci >> 1) + (ci & 1);
      s[i0] = ok[0][ci] ? s[i0] * sl2 : -CUKV_INF;
      s[i0 + 2] = ok[1][ci] ? s[i0 + 2] * sl2 : -CUKV_INF;
    }
    float cm[kCols];
#pragma unroll
    for (int ci = 0; ci < kCols; ++ci) {
      const int i0 = 4 * (ci >> 1) + (ci & 1);
      cm[ci] = fmaxf(s[i0], s[i0 + 2]);
#pragma unroll
      for (int x = 4; x < 32; x <<= 1) cm[ci] = fmaxf(cm[ci], __shfl_xor_sync(0xffffffffu, cm[ci], x));
    }
    float* red = reinterpret_cast<float*>(smem_base() + Pipe::stats_offset) + (g * 2 + par) * 4 * NR;
    if (lane < 4)
#pragma unroll
      for (int ci = 0; ci < kCols; ++ci) red[warp * NR + col(ci)] = cm[ci];
    named_barrier_sync<128>(kBarWG + g);
    float alpha[kCols], base[kCols];
    bool unit = true;
#pragma unroll
    for (int ci = 0; ci < kCols; ++ci) {
      const int c = col(ci);
      const float tmax = fmaxf(fmaxf(red[c], red[NR + c]), fmaxf(red[2 * NR + c], red[3 * NR + c]));
      mt[ci] = fmaxf(mt[ci], tmax);
      // every thread holding column c sees the same tile max and history: the same decision, no vote
      const float mn = !kLazy || tmax - m[ci] > kRescaleLog2 ? fmaxf(m[ci], tmax) : m[ci];
      base[ci] = mn == -CUKV_INF ? 0.f : mn;  // nothing visible yet: exp2(-inf) = 0 throughout
      alpha[ci] = mla_exp2(m[ci] - base[ci]);
      unit = unit && alpha[ci] == 1.f;
      m[ci] = mn;
      l[ci] *= alpha[ci];
    }
    u32 pk[kJ][2];
#pragma unroll
    for (int j = 0; j < kJ; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float e0 = mla_exp2(s[4 * j + 2 * h] - base[2 * j]);
        const float e1 = mla_exp2(s[4 * j + 2 * h + 1] - base[2 * j + 1]);
        l[2 * j] += e0;
        l[2 * j + 1] += e1;
        pk[j][h] = ElemTraits<T>::pack(e0, e1);
      }
    // P^T: matrix (j, h) of the fragment (tokens 16 warp + 8h .., columns 8j ..) lands transposed in rows 8j .. of
    // the buffer, 16-byte chunk 2 warp + h (its 8 tokens)
    const u32 pbuf = pipe.base + Pipe::p_offset + g * kPBytes;
#pragma unroll
    for (int q = 0; q < kJ / 2; ++q) {
      const int mi = lane >> 3;
      const u32 addr = pbuf + swizzle128(8 * (2 * q + (mi >> 1)) + (lane & 7), 2 * warp + (mi & 1));
      stmatrix_x4_trans(addr, pk[2 * q][0], pk[2 * q][1], pk[2 * q + 1][0], pk[2 * q + 1][1]);
    }
    if (!__all_sync(0xffffffffu, unit)) {
#pragma unroll
      for (int b = 0; b < kDBlocks; ++b)
#pragma unroll
        for (int ci = 0; ci < kCols; ++ci) {
          const int i0 = 4 * (ci >> 1) + (ci & 1);
          o[b][i0] *= alpha[ci];
          o[b][i0 + 2] *= alpha[ci];
        }
    }
    fence_proxy_async();  // the stmatrix stores -> the wgmmas' reads
    named_barrier_sync<128>(kBarWG + g);
  }

  // O^T += V^T P^T over the tile of stage `stage`.
  __device__ __forceinline__ void accumulate(int stage) {
    const u64 vd = sw128_desc(pipe.stage(stage), Pipe::atom_col_bytes, 1024);
    const u64 pd = sw128_desc(pipe.base + Pipe::p_offset + g * kPBytes, 1, 1024);
    wgmma_fence();
#pragma unroll
    for (int b = 0; b < kDBlocks; ++b)
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        Mma::ts(o[b], desc_add(vd, (u32)(b * Pipe::atom_col_bytes + kk * 16 * kAtomRowBytes)),
                desc_add(pd, (u32)(kk * 32)), 1);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int b = 0; b < kDBlocks; ++b) fence_regs(o[b]);
  }

  __device__ void consume(const MLADecodeParams& a, const MLAWorkItem& w, int n_tiles) {
    const int len = SPARSE ? w.end : a.seq_lens[w.batch];
    int lim[kCols];
#pragma unroll
    for (int ci = 0; ci < kCols; ++ci) lim[ci] = mla_row_limit(a, w, len, w.row_block * kMlaBlockM + col(ci));
    mbar_wait(pipe.q_full(), 0);
    fence_proxy_async();
    int par = 0;
#pragma unroll 1
    for (int it = g; it < n_tiles; it += 2, par ^= 1) {
      const int stage = it % STAGES;
      mbar_wait(pipe.full(stage), (it / STAGES) & 1);
      fence_proxy_async();
      const int tok = w.begin + it * BN + 16 * warp + (lane >> 2);  // this thread's first token (the other: + 8)
      bool ok[2][kCols];
      if constexpr (SPARSE) {  // producer warp `warp` published this thread's rows' bits
        const u32 vw = pipe.valid_words(stage)[warp];
#pragma unroll
        for (int ci = 0; ci < kCols; ++ci) {
          ok[0][ci] = (vw >> (lane >> 2)) & 1u;
          ok[1][ci] = (vw >> ((lane >> 2) + 8)) & 1u;
        }
      } else {
#pragma unroll
        for (int ci = 0; ci < kCols; ++ci) {
          ok[0][ci] = tok < lim[ci];
          ok[1][ci] = tok + 8 < lim[ci];
        }
      }
      float s[kSRegs];
      scores(s, stage);
      softmax(s, par, ok, a.scale_log2);
      accumulate(stage);
      if (lane == 0) mbar_arrive_n(pipe.empty(stage), 2);
    }
    finish(a, w);
  }

  // Merge the two warpgroups' states and write the rows: the output (direct) or the float32 partial, the LSE and
  // (sparse) the max logit.
  __device__ void finish(const MLADecodeParams& a, const MLAWorkItem& w) {
#pragma unroll
    for (int ci = 0; ci < kCols; ++ci)
#pragma unroll
      for (int x = 4; x < 32; x <<= 1) l[ci] += __shfl_xor_sync(0xffffffffu, l[ci], x);
    named_barrier_sync<256>(1);  // both warpgroups are past their last tile: the ring is idle
    char* ring = smem_base() + Pipe::ring_offset;
    float* ob = reinterpret_cast<float*>(ring);                    // [2][NR][kOStride]
    float* ms = reinterpret_cast<float*>(ring + 2 * kOBytes);     // [2][NR] m, then [2][NR] true max
    float* ls = ms + 4 * NR;                                       // [2][4 warps][NR] l
    if (lane < 4) {
#pragma unroll
      for (int ci = 0; ci < kCols; ++ci) {
        ls[(g * 4 + warp) * NR + col(ci)] = l[ci];
        if (warp == 0) {
          ms[g * NR + col(ci)] = m[ci];
          ms[(2 + g) * NR + col(ci)] = mt[ci];
        }
      }
    }
    named_barrier_sync<256>(1);
    // this warpgroup's O^T scaled to the merged max: O_g * exp2(m_g - M)
    float f[kCols];
#pragma unroll
    for (int ci = 0; ci < kCols; ++ci) {
      const int c = col(ci);
      const float mg = ms[g * NR + c], mo = ms[(1 - g) * NR + c], mm = fmaxf(mg, mo);
      f[ci] = mg == -CUKV_INF ? 0.f : mla_exp2(mg - mm);
    }
    float* mine = ob + g * NR * kOStride;
#pragma unroll
    for (int b = 0; b < kDBlocks; ++b)
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) {
        const int ci = 2 * (i >> 2) + (i & 1), d = 64 * b + 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1);
        mine[col(ci) * kOStride + d] = o[b][i] * f[ci];
      }
    named_barrier_sync<256>(1);
    const int tid = g * 128 + t;
#pragma unroll 1
    for (int idx = tid; idx < NR * (kMlaNope / 4); idx += 256) {
      const int c = idx / (kMlaNope / 4), d = 4 * (idx % (kMlaNope / 4));
      const int row = w.row_block * kMlaBlockM + c;
      if (row >= a.rows) continue;
      const float m0 = ms[c], m1 = ms[NR + c], mm = fmaxf(m0, m1);
      const float f0 = m0 == -CUKV_INF ? 0.f : mla_exp2(m0 - mm), f1 = m1 == -CUKV_INF ? 0.f : mla_exp2(m1 - mm);
      float l0 = 0.f, l1 = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q) l0 += ls[q * NR + c], l1 += ls[(4 + q) * NR + c];
      const float lt = l0 * f0 + l1 * f1;
      const bool any = lt > 0.f;
      const float lse = any ? (mm + __log2f(lt)) * kLn2 : -CUKV_INF;
      const float mx = fmaxf(ms[2 * NR + c], ms[3 * NR + c]) * kLn2;
      float fs = any ? 1.f / lt : 0.f;
      const float4 v0 = *reinterpret_cast<const float4*>(ob + c * kOStride + d);
      const float4 v1 = *reinterpret_cast<const float4*>(ob + (NR + c) * kOStride + d);
      const float4 v = make_float4(v0.x + v1.x, v0.y + v1.y, v0.z + v1.z, v0.w + v1.w);
      if (w.part < 0) {
        const int i = row / a.heads, h = row - i * a.heads;
        if (a.sink != nullptr && any) fs /= 1.f + __expf(a.sink[h] - lse);
        const long long orow = ((long long)w.batch * a.s_q + i) * a.heads + h;
        T* out = reinterpret_cast<T*>(a.out) + orow * kMlaNope + d;
        *reinterpret_cast<uint2*>(out) = make_uint2(ElemTraits<T>::pack(v.x * fs, v.y * fs),
                                                    ElemTraits<T>::pack(v.z * fs, v.w * fs));
        if (d == 0) {
          if (a.lse != nullptr) a.lse[orow] = lse;
          if constexpr (SPARSE)
            if (a.max_logits != nullptr) a.max_logits[orow] = mx;
        }
      } else {
        const long long prow = (long long)w.part * kMlaBlockM + c;
        *reinterpret_cast<float4*>(a.part_o + prow * kMlaNope + d) = make_float4(v.x * fs, v.y * fs, v.z * fs, v.w * fs);
        if (d == 0) {
          a.part_lse[prow] = lse;
          if constexpr (SPARSE) a.part_max[prow] = mx;
        }
      }
    }
  }
};

}  // namespace cukv
