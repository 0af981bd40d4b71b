// The consumer warpgroups of absorbed MLA decode, alternating schedule with per-slice barriers
// (MLADecodeConfig.slice_release; TMA kernels of 16-bit caches). The alternating schedule's work
// (mla_decode_consumer_alt.cuh: warpgroup g scores tiles 2k + g whole, the running max handed over in tile order,
// each warpgroup adds P V for its 256 output columns over both tiles of a pair) in FlashMLA's SM90 order, over a ring
// whose stages are 9 slices of 64 columns with a full and an empty barrier each (MLAKVProducerPipeline, SLICES_):
//
//   warpgroup 0, pair k (S0 = Q K[2k]^T done)      warpgroup 1, pair k (S1 = Q K[2k+1]^T done)
//   m0, P0 from S0; publish ---------H0-------->   read m0, P0; m1 = max(m0, rowmax S1); P1 from S1
//   O0 += P0 V[2k] (slices 0-3); release them <-H1- publish m1, P1
//   read m1, P1; O0 += P1 V[2k+1] (slices 0-3)     O1 += P1 V[2k+1] (slices 4-7)
//   S0 = Q K[2k+2]^T, rope + slices 0-3 first      P0 *= exp2(m0 - m1); O1 += P0 V[2k] (slices 4-7)
//   (P1 V done: release K[2k+1] slices 0-3)        (P1 V done: release K[2k+1] slices 4-7)
//   S0 slices 4-7                                  (P0 V done: release K[2k] slices 4-7)
//                                                  S1 = Q K[2k+3]^T: rope, slices 4-7, then 0-3
//
// So every slice is refilled as soon as its last reader is done: the rope slice right after its tile's Q K^T, a V
// slice after the P V of the warpgroup owning its columns. Warpgroup 1 adds its own tile's P V first (P0 from
// warpgroup 0 is rescaled to m1 in registers: one more rounding of P0 to T), so the slices of the tile it scores next
// free first; warpgroup 0 issues its next Q K^T behind P1 V, and Q K^T reads the slices in the order the producer
// refills them (slice_order), waiting on each slice's full barrier right before its 4 k-steps.
//
// With 64-token tiles and the lazy rescale (kSmemP = Pipe::p_in_rope, the shipped h128 kernels) the other
// warpgroup's P is not copied into registers: the scoring warpgroup stores its P into the tile's rope slice once its
// Q K^T has read it (stmatrix, the slice's swizzled layout), and the other warpgroup's P V takes it from there as the
// wgmma A operand (Wgmma::sv), as FlashMLA's SM90 kernel does with a buffer of its own. P0 then stays scaled to m0:
// warpgroup 1 adds P1 V and P0 V back to back where m1 = m0 in all its rows (the lazy rescale's usual case; a vote on
// a named barrier, since the warpgroup's wgmmas must be the same in its 4 warps), else P0 V first and O moves to m1
// between the two. The rope slice is loaded last and frees once both P V have read it.
//
// Barrier arrivals (lane 0 of each warp, after the wgmma_wait covering its last read): after Q K^T of a tile, the
// scoring warpgroup's 4 warps on all 9 slices; after P V, each warpgroup's 4 warps on its 4 V slices (and, kSmemP, on
// the rope slice that held the tile's P). So the rope slice's empty barrier counts 4 arrivals (12 with kSmemP), the
// others 8, and every arrival on a slice for a tile comes from a warp that waited on that slice's full barrier for the
// same tile, or read the P stored there after it did (it cannot run a phase ahead).
#pragma once
#include "mla_decode_consumer_alt.cuh"

namespace cukv {

#ifdef CUKV_MLA_WAIT_STATS  // probe only (benchmarks/probe_mla_waits.py): where the slice consumers wait, in clocks
extern "C" {
// [0] warpgroup 0's Q K^T waits, rope and slices 0-3; [1] its slices 4-7; [2] warpgroup 1's Q K^T waits; [3] V waits;
// [4] warpgroup 0's wait for P1; [5] warpgroup 1's for P0; [6] consume() in all; [7] warpgroup items
__device__ unsigned long long cukv_mla_wait_stats[8];
}
#define CUKV_MLA_WS(i, stmt)                   \
  do {                                         \
    const long long ws_t0_ = clock64();        \
    stmt;                                      \
    ws_[i] += (unsigned)(clock64() - ws_t0_);  \
  } while (0)
#else
#define CUKV_MLA_WS(i, stmt) stmt
#endif

template <typename T> __device__ __forceinline__ float2 unpack2(u32 w);
template <> __device__ __forceinline__ float2 unpack2<__nv_bfloat16>(u32 w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
template <> __device__ __forceinline__ float2 unpack2<__half>(u32 w) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}

// SPARSE (sparse_mla.cu.j2, Pipe::gather_slices): each tile's keys are gathered rows, real where the producer's
// validity bits for the tile say so.
template <typename T, int BN, int STAGES, bool SPARSE = false>
struct MLADecodeSliceConsumer : MLADecodeAltConsumer<T, BN, STAGES, false, true, SPARSE> {
  typedef MLADecodeAltConsumer<T, BN, STAGES, false, true, SPARSE> Alt;
  typedef typename Alt::Pipe Pipe;
  typedef typename Alt::State State;
  typedef typename Alt::MmaS MmaS;
  using State::pipe, State::g, State::t, State::lane, State::m, State::o;
  static constexpr int kSRegs = Alt::kSRegs, kPWords = Alt::kPWords, kSlices = Pipe::kSlices;
  static constexpr int kBarH0 = Alt::kBarH0, kBarH1 = Alt::kBarH1;
  static constexpr bool kSmemP = Pipe::p_in_rope;  // the other warpgroup's P read from the tile's rope slice
  static constexpr int kBarVote = 6;  // kSmemP: warpgroup 1's vote on its P V order (a wgmma sequence is collective)
  // Q K^T slices of warpgroup 0's next tile issued before P1 V is waited on: the ones freed by its own first P V (and
  // the rope slice where it comes first)
  static constexpr int kFirst = kSmemP ? 4 : 5;
  static_assert(kSlices == 9 && STAGES >= 2, "9 slices of 64 columns per stage");

  int cp_from = 0;  // the first tile that came by cp.async (Pipe::tma_tiles); the ones before by tensor copies
  int peer = 0;     // multicast: the other block of the cluster pair
  int ring0 = 0;    // persistent: the ring position of the item's tile 0 (tiles of earlier items of this block)

  // The ring position of the item's tile `it` (Pipe::ring_pos).
  __device__ __forceinline__ int rp(int it) const { return Pipe::ring_pos(ring0, it); }
#ifdef CUKV_MLA_WAIT_STATS
  mutable unsigned ws_[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#endif

  __device__ __forceinline__ MLADecodeSliceConsumer(const Pipe& p, int g_, int t_) : Alt(p, g_, t_) {}

  // Slice c of tile `it` has landed (its wgmma reads may start; kFence false: once the caller has fenced).
  template <bool kFence = true>
  __device__ __forceinline__ void wait_slice(int it, int c) const {
    mbar_wait(pipe.full(rp(it) % STAGES, c), (rp(it) / STAGES) & 1);
    if (kFence && it >= cp_from) fence_proxy_async();  // a cp.async tile's copies (generic proxy) -> wgmma reads
  }
  // This warp is done with slice c of tile `it` (multicast: in both blocks of the pair, whose copies it shares).
  __device__ __forceinline__ void release(int it, int c) const {
    if (lane == 0) {
      mbar_arrive(pipe.empty(rp(it) % STAGES, c));
      if constexpr (Pipe::multicast) mbar_arrive_remote(cluster_map(pipe.empty(rp(it) % STAGES, c), peer));
    }
  }
  __device__ __forceinline__ void release_v(int it) const {  // this warpgroup's V slices (its output columns)
#pragma unroll
    for (int q = 0; q < 4; ++q) release(it, 4 * g + q);
  }
  __device__ __forceinline__ void release_scored(int it) const {  // all 9, after this warpgroup's Q K^T of `it`
#pragma unroll
    for (int c = 0; c < kSlices; ++c) release(it, c);
  }
  // persistent: after this warpgroup's Q K^T of tile `it` has completed, its last of the item (the next would be
  // it + 2), this warp is done with the query block (q_empty: the producer may load the next item's).
  __device__ __forceinline__ void release_q(int it, int n_tiles) const {
    if constexpr (Pipe::persistent)
      if (it + 2 >= n_tiles && lane == 0) mbar_arrive(pipe.q_empty());
  }
  // This warpgroup's V slices of a tile it did not score. SPARSE (gathered slices): the P V wgmmas start after all
  // four, so one proxy fence after the waits covers them.
  __device__ __forceinline__ void wait_v(int it) const {
#pragma unroll
    for (int q = 0; q < 4; ++q) CUKV_MLA_WS(3, wait_slice<!SPARSE>(it, 4 * g + q));
    if constexpr (SPARSE) fence_proxy_async();
  }

  // Issue slices J0 .. J1 - 1 (in warpgroup G's slice_order) of S = Q K^T for tile `it`, each slice's 4 k-steps
  // right after its full barrier, one commit group per slice (the first k-step of slice 0 overwrites s).
  template <int G, int J0, int J1>
  __device__ __forceinline__ void qk_slices(float (&s)[kSRegs], int it) const {
    const u64 qd = sw128_desc(pipe.q(), 1, 1024);
    const u64 kd = sw128_desc(pipe.stage(rp(it) % STAGES), 1, 1024);
#pragma unroll
    for (int j = J0; j < J1; ++j) {
      const int c = Pipe::slice_order(G, j);
      CUKV_MLA_WS(G == 1 ? 2 : (J0 == 0 ? 0 : 1), wait_slice(it, c));
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        MmaS::ss(s, desc_add(qd, (u32)(c * Pipe::q_atom_col_bytes + kk * 32)),
                 desc_add(kd, (u32)(c * Pipe::atom_col_bytes + kk * 32)), j > 0 || kk > 0);
      wgmma_commit();
    }
  }

  // kSmemP: the shared address of the P of tile `it` (its stage's rope slice)
  __device__ __forceinline__ u32 p_tile(int it) const {
    return pipe.stage(rp(it) % STAGES) + (u32)((kSlices - 1) * Pipe::atom_col_bytes);
  }

  // kSmemP: this warpgroup's P of tile `it` into the tile's rope slice (K-major, 128-byte swizzle: a wgmma A operand)
  // and its max into its stats slot; then arrive on `bar` (Alt::publish's hand-over).
  __device__ __forceinline__ void publish_p(const u32 (&p)[kPWords], int it, int bar) {
    // stmatrix x4 of 8-token chunks j, j + 1: matrices (rows 0-7, j), (rows 8-15, j), (rows 0-7, j + 1), (rows 8-15,
    // j + 1) of this warp's 16 rows, which are p[2j .. 2j + 3]; lane l addresses row l % 8 of matrix l / 8
    const int row = (t >> 5) * 16 + (lane & 7) + (lane & 8), half = lane >> 4;
    const u32 line = p_tile(it) + (u32)(row * kAtomRowBytes);
#pragma unroll
    for (int j = 0; j < kPWords / 2; j += 2)
      stmatrix_x4(line + (u32)(((j + half) ^ (row & 7)) << 4), p[2 * j], p[2 * j + 1], p[2 * j + 2], p[2 * j + 3]);
    State::stats()[g * 128 + t] = make_float2(m[0], m[1]);
    fence_proxy_async();  // the P stores -> the other warpgroup's wgmma reads
    __threadfence_block();
    named_barrier_arrive<256>(bar);
  }

  // kSmemP: the other warpgroup's max, once it has arrived on `bar` (its P is in the tile's rope slice)
  __device__ __forceinline__ float2 receive_m(int bar) {
    named_barrier_sync<256>(bar);
    return State::stats()[(1 - g) * 128 + t];
  }

  // kSmemP: issue O[:, this warpgroup's 256 columns] += P V over tile `it`, P from the tile's rope slice.
  __device__ __forceinline__ void pv_issue_smem(int it) {
    const u64 vd = sw128_desc(pipe.stage(rp(it) % STAGES) + (u32)(g * 4 * Pipe::atom_col_bytes),
                              Pipe::atom_col_bytes, 1024);
    const u64 pd = sw128_desc(p_tile(it), 1, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      Alt::MmaO::sv(o, desc_add(pd, (u32)(kk * 32)), desc_add(vd, (u32)(kk * 16 * kAtomRowBytes)), 1);
    wgmma_commit();
  }

  // The hand-over of a tile's P between the warpgroups: through the rope slice (kSmemP; `p` unused on the receiving
  // side) or through registers (Alt's shared buffer).
  __device__ __forceinline__ void publish_tile(const u32 (&p)[kPWords], int it, int bar) {
    if constexpr (kSmemP) publish_p(p, it, bar);
    else Alt::publish(p, bar);
  }
  __device__ __forceinline__ float2 receive_tile(u32 (&p)[kPWords], int bar) {
    if constexpr (kSmemP) return receive_m(bar);
    else return Alt::receive(p, bar);
  }
  // Issue O += P V over tile `it` for the P the other warpgroup published (received into `p` without kSmemP).
  __device__ __forceinline__ void pv_issue_other(const u32 (&p)[kPWords], int it) {
    if constexpr (kSmemP) pv_issue_smem(it);
    else Alt::pv_issue(p, rp(it) % STAGES);
  }

  // This warp is done with the P V of tile `it`: its V slices, and (kSmemP) the rope slice holding the tile's P.
  __device__ __forceinline__ void release_pv(int it) const {
    release_v(it);
    if constexpr (kSmemP) release(it, kSlices - 1);
  }

  // P words (rows r0 and r0 + 8 alternate, as probabilities() packs them) scaled by r.x, r.y and rounded to T again.
  __device__ __forceinline__ void rescale_p(u32 (&p)[kPWords], float2 r) const {
#pragma unroll
    for (int q = 0; q < kPWords; ++q) {
      const float2 f = unpack2<T>(p[q]);
      const float k = q & 1 ? r.y : r.x;
      p[q] = ElemTraits<T>::pack(f.x * k, f.y * k);
    }
  }

  // Warpgroup 0: tiles 2k.
  __device__ __forceinline__ void consume0(const MLADecodeParams& a, const MLAWorkItem& w, int n_tiles, int lim0,
                                           int lim1) {
    float s[kSRegs];
    if (n_tiles > 0) {
      qk_slices<0, 0, kSlices>(s, 0);
      wgmma_wait<0>();
      fence_regs(s);
      release_scored(0);
      release_q(0, n_tiles);
    }
#pragma unroll 1
    for (int t0 = 0; t0 < n_tiles; t0 += 2) {
      const int t1 = t0 + 1, t2 = t0 + 2;
      u32 p[kPWords];
      const float2 mx = Alt::mask_rowmax(s, w.begin + t0 * BN, lim0, lim1, a.scale_log2, rp(t0));
      const float2 a0 = Alt::follow(State::next_max(make_float2(m[0], m[1]),
                                                    make_float2(fmaxf(m[0], mx.x), fmaxf(m[1], mx.y))));
      Alt::probabilities(s, p);
      publish_tile(p, t0, kBarH0);  // warpgroup 1 goes on with its softmax while this one runs P0 V
      Alt::scale_o(a0);
      Alt::pv_issue(p, rp(t0) % STAGES);
      wgmma_wait<0>();
      fence_regs(o);
      release_pv(t0);
      if (t1 >= n_tiles) break;
      u32 p1[kPWords];  // (kSmemP: P1 V reads P1 where warpgroup 1 stored it)
      float2 m1;
      CUKV_MLA_WS(4, m1 = receive_tile(p1, kBarH1));
      Alt::scale_o(Alt::follow(m1));
      wait_v(t1);
      pv_issue_other(p1, t1);
      if (t2 < n_tiles) {  // the next tile's Q K^T behind P1 V: the slices it freed first, then the rest
        qk_slices<0, 0, kFirst>(s, t2);
        wgmma_wait<kFirst>();  // P1 V is done
        release_pv(t1);
        qk_slices<0, kFirst, kSlices>(s, t2);
        wgmma_wait<0>();
        fence_regs(o);
        fence_regs(s);
        release_scored(t2);
        release_q(t2, n_tiles);
      } else {
        wgmma_wait<0>();
        fence_regs(o);
        release_pv(t1);
      }
    }
  }

  // Warpgroup 1: tiles 2k + 1.
  __device__ __forceinline__ void consume1(const MLADecodeParams& a, const MLAWorkItem& w, int n_tiles, int lim0,
                                           int lim1) {
    float s[kSRegs];
    if (n_tiles > 1) {
      qk_slices<1, 0, kSlices>(s, 1);
      wgmma_wait<0>();
      fence_regs(s);
      release_scored(1);
      release_q(1, n_tiles);
    }
#pragma unroll 1
    for (int t0 = 0; t0 < n_tiles; t0 += 2) {
      const int t1 = t0 + 1, t3 = t0 + 3;
      const bool pair = t1 < n_tiles;  // the same in both warpgroups
      float2 mx = make_float2(-CUKV_INF, -CUKV_INF);
      if (pair) mx = Alt::mask_rowmax(s, w.begin + t1 * BN, lim0, lim1, a.scale_log2, rp(t1));
      u32 p0[kPWords];  // (kSmemP: P0 V reads P0 where warpgroup 0 stored it)
      float2 m0;
      // (without kSmemP, read before this warpgroup publishes P1 into the same buffer)
      CUKV_MLA_WS(5, m0 = receive_tile(p0, kBarH0));
      if (pair) {
        const float2 mold = make_float2(m[0], m[1]);
        const float2 mn = State::next_max(m0, make_float2(fmaxf(m0.x, mx.x), fmaxf(m0.y, mx.y)));
        const float2 a1 = Alt::follow(mn);  // O and l from this warpgroup's old max straight to m1
        u32 p1[kPWords];
        Alt::probabilities(s, p1);
        publish_tile(p1, t1, kBarH1);  // warpgroup 0 goes on with P1 V
        if constexpr (!kSmemP) {
          Alt::scale_o(a1);
          Alt::pv_issue(p1, rp(t1) % STAGES);  // its own tile first: those slices free first
        }
        // P0 was scaled to m0; to m1 now (a factor in (0, 1]). A row whose m0 is still -inf has P0 = 0: factor 0,
        // never exp2 of a large difference (inf, and 0 * inf)
        const float b1x = mn.x == -CUKV_INF ? 0.f : mn.x, b1y = mn.y == -CUKV_INF ? 0.f : mn.y;
        const float2 f0 = make_float2(m0.x == -CUKV_INF ? 0.f : mla_exp2(m0.x - b1x),
                                      m0.y == -CUKV_INF ? 0.f : mla_exp2(m0.y - b1y));
        // kSmemP: P1 V and P0 V back to back (its own tile first: those slices free first) only where m1 = m0 in every
        // row of the warpgroup; without it P0 is rescaled in registers and they always are
        if (!kSmemP || named_barrier_all<128>(kBarVote, State::unit(f0))) {
          if constexpr (kSmemP) {
            Alt::scale_o(a1);
            Alt::pv_issue(p1, rp(t1) % STAGES);
          } else if (!State::unit(f0)) {
            rescale_p(p0, f0);
          }
          wait_v(t0);
          pv_issue_other(p0, t0);
          wgmma_wait<1>();  // P1 V is done
          release_pv(t1);
          wgmma_wait<0>();
          fence_regs(o);
          release_pv(t0);
        } else {  // O to m0, P0 V; then O to m1, P1 V (P1 from shared memory too: its registers are free by then)
          const float b0x = m0.x == -CUKV_INF ? 0.f : m0.x, b0y = m0.y == -CUKV_INF ? 0.f : m0.y;
          Alt::scale_o(make_float2(mla_exp2(mold.x - b0x), mla_exp2(mold.y - b0y)));
          wait_v(t0);
          pv_issue_smem(t0);
          wgmma_wait<0>();
          fence_regs(o);
          release_pv(t0);
          Alt::scale_o(f0);
          pv_issue_smem(t1);
          wgmma_wait<0>();
          fence_regs(o);
          release_pv(t1);
        }
      } else {
        Alt::scale_o(Alt::follow(m0));
        wait_v(t0);
        pv_issue_other(p0, t0);
        wgmma_wait<0>();
        fence_regs(o);
        release_pv(t0);
      }
      if (t3 < n_tiles) {
        qk_slices<1, 0, kSlices>(s, t3);
        wgmma_wait<0>();
        fence_regs(s);
        release_scored(t3);
        release_q(t3, n_tiles);
      }
    }
  }

  // tma_box_rows: the cache map's box rows (0: every tile by cp.async), as the producer was given them.
  // persistent: `ring0_` is the ring position of the item's tile 0, `item` the block's count of items before it.
  __device__ void consume(const MLADecodeParams& a, const MLAWorkItem& w, int n_tiles, int tma_box_rows,
                          int ring0_ = 0, int item = 0) {
    ring0 = ring0_;
    cp_from = Pipe::tma_tiles(w, tma_box_rows);
    if constexpr (Pipe::multicast) peer = cluster_rank() ^ 1;
    const int warp = t >> 5;
    const int r0 = warp * 16 + (lane >> 2);
    const int len = SPARSE ? w.end : a.seq_lens[w.batch];
    const int lim0 = mla_row_limit(a, w, len, w.row_block * kMlaBlockM + r0);
    const int lim1 = mla_row_limit(a, w, len, w.row_block * kMlaBlockM + r0 + 8);
    mbar_wait(pipe.q_full(), Pipe::persistent ? item & 1 : 0);
    if (n_tiles <= g) release_q(g - 2, n_tiles);  // (a warpgroup with no tile of this item reads no query block)
#ifdef CUKV_MLA_TIMELINE
    const int tl_row = Pipe::persistent && SPARSE ? MLA_TIMELINE_ITEM_ROW(a, w) : (int)blockIdx.x;
    if (g == 0 && t == 0) MLA_TIMELINE_AT_ROW(tl_row, 5);
#endif
    fence_proxy_async();
    CUKV_MLA_WS(6, if (g == 0) consume0(a, w, n_tiles, lim0, lim1); else consume1(a, w, n_tiles, lim0, lim1));
#ifdef CUKV_MLA_TIMELINE
    if (g == 0 && t == 0) MLA_TIMELINE_AT_ROW(tl_row, 6);
#endif
#ifdef CUKV_MLA_WAIT_STATS
    ws_[7] = 1;
    if (t == 0)
      for (int i = 0; i < 8; ++i) atomicAdd(&cukv_mla_wait_stats[i], (unsigned long long)ws_[i]);
#endif
    State::template finish<true, SPARSE>(a, w, r0);
    // persistent: the next item's softmax exchange (stats) waits until both warpgroups have read this one's
    if constexpr (Pipe::persistent) named_barrier_sync<256>(1);
  }
};

}  // namespace cukv
