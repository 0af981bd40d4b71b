// The prefill's consumer warpgroups: each computes S = Q K^T for its 64 query rows with wgmma (Q and K from shared
// memory), masks, runs the online softmax in registers, accumulates O += P V with P straight from registers, and
// writes O and the LSE.
#pragma once
#include "prefill_kernel.cuh"

namespace cukv {

// FP8 scores: this thread's two query rows r0, r1 (block rows) as e4m3 hi + lo terms in shared memory. Lane c
// of the row's quad takes the 8-dim pieces c, c + 4, ... (zeros past the head and past the sequence); the
// row's factor 2^k = 256 / (power of two >= its largest |q|) puts every |q * 2^k| <= 256, hi = e4m3(q * 2^k),
// lo = e4m3(q * 2^k - hi) (the difference is exact in float32). Returns 2^-k per row in f0, f1.
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::split_query(const PrefillArgs& a, const Smem& sm, int head,
                                                                   int q_begin, int q0, int rows, int r0, int r1, int c,
                                                                   float& f0, float& f1) {
  const T* q = static_cast<const T*>(a.q);
  uint4 x[2][kQ8Steps];
  float amax[2] = {0.f, 0.f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = h ? r1 : r0;
    const T* src = q + (i64)(q_begin + q0 + r) * a.q_stride[0] + (i64)head * a.q_stride[1];
#pragma unroll
    for (int t = 0; t < kQ8Steps; ++t) {
      const int d = 8 * (c + 4 * t);
      x[h][t] = (r < rows && d < DEPTH) ? __ldg(reinterpret_cast<const uint4*>(src + d)) : make_uint4(0, 0, 0, 0);
      const T* e = reinterpret_cast<const T*>(&x[h][t]);
#pragma unroll
      for (int i = 0; i < 8; ++i) amax[h] = fmaxf(amax[h], fabsf(ElemTraits<T>::to_float(e[i])));
    }
  }
  float up[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) up[h] = pow2_at_least(fmaxf(quad_max(amax[h]), 0x1p-100f)) * (1.f / 256.f);
  f0 = up[0];
  f1 = up[1];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = h ? r1 : r0;
    const float k = 1.f / up[h];  // a power of two: exact
#pragma unroll
    for (int t = 0; t < kQ8Steps; ++t) {
      const T* e = reinterpret_cast<const T*>(&x[h][t]);
      u32 hi[2], lo[2];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float v0 = ElemTraits<T>::to_float(e[2 * i]) * k, v1 = ElemTraits<T>::to_float(e[2 * i + 1]) * k;
        const u16 h2 = e4m3x2_from_floats(v0, v1);
        const float2 back = floats_from_e4m3x2(h2);
        const u16 l2 = e4m3x2_from_floats(v0 - back.x, v1 - back.y);
        if (i % 2 == 0) {
          hi[i / 2] = h2;
          lo[i / 2] = l2;
        } else {
          hi[i / 2] |= (u32)h2 << 16;
          lo[i / 2] |= (u32)l2 << 16;
        }
      }
      const int byte = 8 * (c + 4 * t);
      const u32 dst = sm.q + (u32)((byte / 128) * BM * kAtomRowBytes) + swizzle128(r, (byte % 128) / 16) + (byte % 16);
      asm volatile("st.shared.v2.u32 [%0], {%1,%2};" :: "r"(dst), "r"(hi[0]), "r"(hi[1]) : "memory");
      asm volatile("st.shared.v2.u32 [%0], {%1,%2};" :: "r"(dst + (u32)kQ8Half), "r"(lo[0]), "r"(lo[1]) : "memory");
    }
  }
}

// a row's exponent base in log2 units (its running max times the score factor); a row with nothing visible yet
// keeps base 0, so exp2(-inf - 0) = 0 and never NaN
template <class Traits>
__device__ __forceinline__ float PrefillKernel<Traits>::exp_base(float m, float sl) { return m == -CUKV_INF ? 0.f : m * sl; }

template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::consume(const PrefillArgs& a, const Smem& sm, const Buf& buf,
                                                               const Cache& cache, int head, int q_begin, int q0,
                                                               int rows, int kv_len, int shift, int n_first,
                                                               int n_tiles, int vslice, int warp, int lane, Ring& ring,
                                                               int q_phase, const OnceArgs* once,
                                                               const CUtensorMap* omap) {
  float kb[MmaKs::kRegs];  // kKsMma: the score columns' K scales
  // the warpgroup, broadcast from lane 0 so that ptxas knows it is warp-uniform: the query descriptor built
  // from it then stays in uniform registers, one add per wgmma (desc_add) instead of moves from vector ones
  const int wg = __shfl_sync(0xffffffffu, warp / 4, 0), wq = warp % 4;
  const int g = lane / 4, c = lane % 4;
  // this thread's two rows (within the block) and their positions
  const int r0 = wg * 64 + wq * 16 + g, r1 = r0 + 8;
  const int p0 = shift + q0 + r0, p1 = shift + q0 + r1;
  const int hi0 = key_hi(a, p0, kv_len), hi1 = key_hi(a, p1, kv_len);
  const int lo0 = key_lo(a, p0), lo1 = key_lo(a, p1);
  // positions of the warpgroup's rows bound which tiles need the element-wise mask
  const int wp_first = shift + q0 + wg * 64, wp_last = wp_first + 63;
  const int wg_hi_min = key_hi(a, wp_first, kv_len), wg_lo_max = key_lo(a, wp_last);

  const float scale_log2 = a.sm_scale * kLog2e;
  const bool capped = a.softcap > 0.f;
  // Scores leave the mma as s * f_row (FP8 scores: the query's 2^-k and a per-tensor K scale; token K scales
  // are applied per column below); f0, f1 fold into the exponent's one FMA (sl0, sl1) or the soft-cap.
  float f0 = 1.f, f1 = 1.f;
  stage_query(a, sm, cache, once, head, q_begin, q0, rows, r0, r1, c, wg, q_phase, f0, f1);
  const float sl0 = capped ? kLog2e : scale_log2 * f0, sl1 = capped ? kLog2e : scale_log2 * f1;
  const float cap0 = a.sm_scale * f0 / a.softcap, cap1 = a.sm_scale * f1 / a.softcap;
  float o[kORegs];
#pragma unroll
  for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
  float m0 = -CUKV_INF, m1 = -CUKV_INF, l0 = 0.f, l1 = 0.f;

  // this warpgroup's query rows; each wgmma adds its offset (desc_add)
  const u64 q_desc = sw128_desc(sm.q + (u32)(wg * 64 * kAtomRowBytes), 1, 1024);

  int pending_v = -1;
  WaitStats ws;
  ws.t0 = WaitStats::now();
  // convert-once's persistent grid: an item begun in the kernel's first 400 us (while the converters run), from the
  // blocks' start (an item that reads the word before any block's start is visible counts as later; the form that
  // handles it spilled 20 bytes at d256). The 16-bit grid has no converters.
  ws.early = CUKV_WAIT_STATS && PERSISTENT && kOnce &&
                     globaltimer_ns() - ~*reinterpret_cast<const volatile unsigned long long*>(once->flags - 32 + 10) <
                         400000ull;
  // PINGPONG: wait for the previous warpgroup's S issue, then let the next one go. Warpgroup 0 goes first
  // and the last skips its final pass, so every named barrier sees as many passes as waits.
  const int ring_next = 4 + (wg + 1) % kConsumerWGs;
  for (int it = 0; it < n_tiles; ++it) {
    const int n = n_first + n_tiles - 1 - it;
    float s[kSRegs];
    trace_mark(it, 0);
    const bool ring_wait = PINGPONG && !(wg == 0 && it == 0);
    const bool ring_pass = PINGPONG && !(wg == kConsumerWGs - 1 && it == n_tiles - 1);
    issue_scores(sm, buf, ring, q_desc, s, kb, o, wg, it, ring_wait, ws);
    if (ring_pass) named_barrier_arrive<256>(ring_next);
    wgmma_wait<0>();
    trace_mark(it, 2);
    // PERSISTENT: the item's last S has read the staged query; warp 0 may stage the next item's
    if (PERSISTENT && it == n_tiles - 1 && lane == 0) mbar_arrive(sm.q_empty);
    fence_regs(s);
    fence_regs(o);
    scale_scores(sm, ring, s, kb, c);
    // every wgmma so far is complete: release this tile's K elements and the previous tile's V
    if (lane == 0) {
      for (int e = 0; e < kKElems; ++e) mbar_arrive(sm.empty + 8 * ring.ahead(e).stage());
      if (pending_v >= 0) mbar_arrive(sm.empty + 8 * pending_v);
    }
    ring.advance(kKElems);

    // ---- scores, mask, online softmax (rows r0 and r1; 4 lanes share a row). Scores stay unscaled
    // until the exponent (one FMA); soft-cap and masks are uniform branches, not per-element selects.
    if (capped) {
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) s[i] = a.softcap * tanhf(s[i] * (i % 4 < 2 ? cap0 : cap1));
    }
    const int key0 = n * BN;
    if (key0 + BN > wg_hi_min || key0 < wg_lo_max) mask_scores(s, key0, c, lo0, hi0, lo1, hi1);
    float mx0 = m0, mx1 = m1;
    row_max(s, mx0, mx1);
    // The running max moves (and O is rescaled) only when some row of the warp grew past kRescaleLog2; a row
    // seeing its first keys (m = -inf) always counts as grown, one with none still visible never does.
    const bool grow = !kLazyRescale || (mx0 - m0) * sl0 > (float)kRescaleLog2 ||
                      (mx1 - m1) * sl1 > (float)kRescaleLog2;
    if (!kLazyRescale || __any_sync(0xffffffffu, grow)) {
      const float alpha0 = fast_exp2(m0 * sl0 - exp_base(mx0, sl0)), alpha1 = fast_exp2(m1 * sl1 - exp_base(mx1, sl1));
      m0 = mx0;
      m1 = mx1;
      l0 *= alpha0;
      l1 *= alpha1;
#pragma unroll
      for (int j = 0; j < kORegs / 4; ++j) {
        o[4 * j] *= alpha0;
        o[4 * j + 1] *= alpha0;
        o[4 * j + 2] *= alpha1;
        o[4 * j + 3] *= alpha1;
      }
    }
    const float base0 = exp_base(m0, sl0), base1 = exp_base(m1, sl1);
    u32 p[BN / 2];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const float e0 = fast_exp2(fmaf(s[4 * j], sl0, -base0)), e1 = fast_exp2(fmaf(s[4 * j + 1], sl0, -base0));
      const float e2 = fast_exp2(fmaf(s[4 * j + 2], sl1, -base1)), e3 = fast_exp2(fmaf(s[4 * j + 3], sl1, -base1));
      l0 += e0 + e1;
      l1 += e2 + e3;
      p[2 * j] = ElemTraits<PT>::pack(e0, e1);
      p[2 * j + 1] = ElemTraits<PT>::pack(e2, e3);
    }

    // ---- O += P V (P from registers: k16 step kk uses score columns 16kk .. 16kk + 15)
    const int vstage = ring.stage();
    trace_mark(it, 3);
    const u32 tv0 = WaitStats::now();
    mbar_wait(sm.full + 8 * vstage, ring.phase());
    WaitStats::add(ws.v, tv0);
    trace_mark(it, 4);
    fence_proxy_async();
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const u32 frag[4] = {p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3]};
      MmaO::rs(o, frag, buf.v_desc(vstage, kk), 1);
    }
    wgmma_commit();
    trace_mark(it, 5);
    if constexpr (PV_WAIT) {
      wgmma_wait<0>();
      fence_regs(o);
      if (lane == 0) mbar_arrive(sm.empty + 8 * vstage);
    } else {
      fence_regs(o);
      pending_v = vstage;
    }
    ring.advance();
  }
  wgmma_wait<0>();
  fence_regs(o);
  if (lane == 0 && pending_v >= 0) mbar_arrive(sm.empty + 8 * pending_v);
  if (PERSISTENT && n_tiles == 0 && lane == 0) mbar_arrive(sm.q_empty);
ws.flush(wq == 0 && lane == 0, n_tiles);

  store_output(a, cache, once, o, l0, l1, m0, m1, sl0, sl1, r0, r1, head, q_begin, q0, rows, vslice, c, sm, omap);
}

// ---- S = Q K^T over the K elements of this tile (the next ring position on): issued and committed, not waited for
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::issue_scores(const Smem& sm, const Buf& buf, const Ring& ring,
                                                                    u64 q_desc, float (&s)[kSRegs],
                                                                    float (&kb)[MmaKs::kRegs], float (&o)[kORegs],
                                                                    int wg, int it, bool ring_wait, WaitStats& ws) {
  if constexpr (FP8_SCORES) {
    const int stage = ring.stage();
    mbar_wait(sm.full + 8 * stage, ring.phase());
    trace_mark(it, 1);
    if constexpr (kKsMma) {
      // P V(t - 1) completes first: its P registers hold kb while S is in flight (both beside P and the
      // output made ptxas serialize the wgmmas, C7512)
      wgmma_wait<0>();
      fence_regs(o);
    }
    if (ring_wait) named_barrier_sync<256>(4 + wg);
    fence_proxy_async();
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kQ8Steps; ++k) {
      const u32 qa = (u32)((k / 4) * BM * kAtomRowBytes + (k % 4) * 32);
      const u64 kd = buf.k_desc(stage, k / 4, k % 4);
      MmaS8::ss(s, desc_add(q_desc, qa), kd, k > 0);
      MmaS8::ss(s, desc_add(q_desc, qa + (u32)kQ8Half), kd, 1);
    }
    if constexpr (kKsMma)
      MmaKs::ss(kb, plain_desc(sm.kscale, 0, 128),
                plain_desc(sm.kscale + (u32)(kKsOnesBytes + stage * (BN / 2) * kKsRowBytes), 0, 128), 0);
    wgmma_commit();
  } else {
    const u32 tb0 = WaitStats::now();
    if (ring_wait) named_barrier_sync<256>(4 + wg);
    WaitStats::add(ws.bar, tb0);
#pragma unroll
    for (int e = 0; e < kKElems; ++e) {
      const int stage = ring.ahead(e).stage();
      const u32 tk0 = WaitStats::now();
      mbar_wait(sm.full + 8 * stage, ring.ahead(e).phase());
      ws.add_k(tk0);
      trace_mark(it, 1);
      fence_proxy_async();
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < Buf::num_k_mmas2; ++k) {
        const int dim = e * BK + k * 16;
        if (dim < DEPTH) {
          const int qa = dim / 64;
          const u64 qd = desc_add(q_desc, (u32)(qa * BM * kAtomRowBytes + (dim % 64) * 2));
          MmaS::ss(s, qd, buf.k_desc(stage, k / 4, k % 4), e > 0 || k > 0);
        }
      }
      wgmma_commit();
    }
  }
}

// FP8 scores with token scales: the K scales multiply the score columns (before the mask: a masked column's scale may
// be zero). kKsMma: from the K-scale wgmma's registers kb; otherwise from the ring element's scales in shared memory.
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::scale_scores(const Smem& sm, const Ring& ring,
                                                                    float (&s)[kSRegs], float (&kb)[MmaKs::kRegs],
                                                                    int c) {
  if constexpr (kKsMma) {
    fence_regs(kb);
    // key columns 8j + 2c (+1): the first half's scales on row g's registers, the second's on row g + 8's
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const int i = j < BN / 16 ? 4 * j : 4 * (j - BN / 16) + 2;
      s[4 * j] *= kb[i];
      s[4 * j + 1] *= kb[i + 1];
      s[4 * j + 2] *= kb[i];
      s[4 * j + 3] *= kb[i + 1];
    }
  } else if constexpr (FP8_SCORES && SCALE_BLOCK > 0) {
    const u32 ks = sm.kscale + (u32)((ring.stage() * BN + 2 * c) * 4);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      float k0, k1;
      asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];" : "=f"(k0), "=f"(k1) : "r"(ks + (u32)(32 * j)) : "memory");
      s[4 * j] *= k0;
      s[4 * j + 1] *= k1;
      s[4 * j + 2] *= k0;
      s[4 * j + 3] *= k1;
    }
    __syncwarp();  // every lane has read the scales before lane 0 releases the element
  }
}

// ---- epilogue: normalize, sink, write O and LSE of rows r0 and r1 if below `rows` (token q_begin + q0 + r)
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::store_output(const PrefillArgs& a, const Cache& cache,
                                                                    const OnceArgs* once, const float (&o)[kORegs],
                                                                    float l0, float l1, float m0, float m1, float sl0,
                                                                    float sl1, int r0, int r1, int head, int q_begin, int q0,
                                                                    int rows, int vslice, int c, const Smem& sm,
                                                                    const CUtensorMap* omap) {
  l0 = quad_sum(l0);
  l1 = quad_sum(l1);
  const float base0 = exp_base(m0, sl0), base1 = exp_base(m1, sl1);
  float d0 = l0, d1 = l1;
  if (a.sink != nullptr) {
    const float sk = a.sink[head] * kLog2e;
    d0 += fast_exp2(sk - base0);
    d1 += fast_exp2(sk - base1);
  }
  // V staged as codes: its tensor scale joins the normalization
  const float vs = kVCodes      ? cache.template load_scale<0>(false, 0, 0, 0)
                   : kOnceCodes ? Fp8Cache(once->fp8).template load_scale<0>(false, 0, 0, 0)
                                : 1.f;
  const float inv0 = d0 > 0.f ? vs / d0 : 0.f, inv1 = d1 > 0.f ? vs / d1 : 0.f;
  T* out = static_cast<T*>(a.out);
  const int col_base = vslice * kVCols;
  if constexpr (kTmaStore) {
    store_output_tma(a, sm, omap, o, inv0, inv1, r0, head, q_begin + q0, rows, col_base);
  } else {
#pragma unroll
    for (int j = 0; j < kORegs / 4; ++j) {
      const int col = col_base + 8 * j + 2 * c;
      if (r0 < rows)
        *reinterpret_cast<u32*>(out + (i64)(q_begin + q0 + r0) * a.o_stride[0] + (i64)head * a.o_stride[1] + col) =
            ElemTraits<T>::pack(o[4 * j] * inv0, o[4 * j + 1] * inv0);
      if (r1 < rows)
        *reinterpret_cast<u32*>(out + (i64)(q_begin + q0 + r1) * a.o_stride[0] + (i64)head * a.o_stride[1] + col) =
            ElemTraits<T>::pack(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
    }
  }
  if (a.lse != nullptr && c == 0 && vslice == 0) {
    if (r0 < rows)
      a.lse[(i64)(q_begin + q0 + r0) * a.num_qo_heads + head] = l0 > 0.f ? (base0 + __log2f(l0)) * kLn2 : -CUKV_INF;
    if (r1 < rows)
      a.lse[(i64)(q_begin + q0 + r1) * a.num_qo_heads + head] = l1 > 0.f ? (base1 + __log2f(l1)) * kLn2 : -CUKV_INF;
  }
}

// tma_store: this warp's 16 rows of the block (from w0 = r0 rounded down to 16; token `token0 + w0` on) times inv0 /
// inv1 into the warp's staging tile, then one tensor copy per 64-column atom. The warp's previous copies must have
// read the tile first (they were issued an item earlier, so the wait rarely waits); the copies of this one complete
// while the warp goes on to its next item. A warp whose rows cross the item's end (`rows`) copies the rows below it
// from the tile to global memory itself, 16 bytes a lane (a tensor copy's box would write past the sequence).
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::store_output_tma(const PrefillArgs& a, const Smem& sm,
                                                                        const CUtensorMap* omap,
                                                                        const float (&o)[kORegs], float inv0,
                                                                        float inv1, int r0, int head, int token0,
                                                                        int rows, int col_base) {
  const int lane = threadIdx.x % 32, w0 = r0 & ~15;
  if (w0 >= rows) return;  // none of the warp's rows is the item's (warp-uniform)
  const u32 tile = sm.out + (u32)((w0 / 16) * kOutWarpBytes);
  if (lane == 0) tma_store_wait_read<0>();
  __syncwarp();
  // stmatrix x4 of 8-column chunks j, j + 1: matrices (rows 0-7, j), (rows 8-15, j), (rows 0-7, j + 1), (rows 8-15,
  // j + 1), which are this thread's o[4j .. 4j + 7] in accumulator order; lane t addresses row t % 8 of matrix t / 8
  const int row = (lane & 7) + (lane & 8), half = lane >> 4;
#pragma unroll
  for (int j = 0; j < kORegs / 4; j += 2) {
    const int chunk = j + half;
    stmatrix_x4(tile + (u32)((chunk / 8) * kOutAtomBytes) + swizzle128(row, chunk % 8),
                ElemTraits<T>::pack(o[4 * j] * inv0, o[4 * j + 1] * inv0),
                ElemTraits<T>::pack(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1),
                ElemTraits<T>::pack(o[4 * j + 4] * inv0, o[4 * j + 5] * inv0),
                ElemTraits<T>::pack(o[4 * j + 6] * inv1, o[4 * j + 7] * inv1));
  }
  if (w0 + 16 <= rows) {  // warp-uniform
    fence_proxy_async();  // the generic-proxy stores -> the tensor copies' reads
    __syncwarp();
    if (lane == 0) {
#pragma unroll
      for (int atom = 0; atom < kOutAtoms; ++atom)
        tma_store_4d(omap, tile + (u32)(atom * kOutAtomBytes), (col_base + atom * kAtomCols) * (int)sizeof(T), head,
                     token0 + w0, 0);
      tma_store_commit();
    }
  } else {
    __syncwarp();  // the tile's rows, which other lanes wrote
    constexpr int kChunks = kOutAtoms * 8;  // 16-byte chunks per row
    T* out = static_cast<T*>(a.out);
#pragma unroll
    for (int k = 0; k < 16 * kChunks / 32; ++k) {
      const int r = (lane + 32 * k) / kChunks, chunk = (lane + 32 * k) % kChunks;
      if (w0 + r < rows) {
        u32 v0, v1, v2, v3;
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3)
                     : "r"(tile + (u32)((chunk / 8) * kOutAtomBytes) + swizzle128(r, chunk % 8)) : "memory");
        T* dst = out + (i64)(token0 + w0 + r) * a.o_stride[0] + (i64)head * a.o_stride[1] + col_base + chunk * 8;
        asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(dst), "r"(v0), "r"(v1), "r"(v2), "r"(v3)
                     : "memory");
      }
    }
  }
}

// The keys of the tile from key0 that a row does not see ([lo0, hi0) for row r0, [lo1, hi1) for r1) read -inf
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::mask_scores(float (&s)[kSRegs], int key0, int c, int lo0,
                                                                   int hi0, int lo1, int hi1) {
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      const int key = key0 + 8 * j + 2 * c + (h & 1);
      const bool vis = h < 2 ? (key >= lo0 && key < hi0) : (key >= lo1 && key < hi1);
      s[4 * j + h] = vis ? s[4 * j + h] : -CUKV_INF;  // select, never multiply: NaN cannot leak
    }
  }
}

// mx0, mx1: at least rows r0's and r1's largest score of the tile (over the row's quad of lanes)
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::row_max(const float (&s)[kSRegs], float& mx0, float& mx1) {
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    mx0 = fmaxf(mx0, fmaxf(s[4 * j], s[4 * j + 1]));
    mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
  }
  mx0 = quad_max(mx0);
  mx1 = quad_max(mx1);
}

// The warpgroup's query in shared memory (FP8 scores: split into e4m3 terms here; otherwise staged by the producer on
// q_full), and the factors f0, f1 its rows' scores leave the mma with
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::stage_query(const PrefillArgs& a, const Smem& sm,
                                                                   const Cache& cache, const OnceArgs* once, int head,
                                                                   int q_begin, int q0, int rows, int r0, int r1,
                                                                   int c, int wg, int q_phase, float& f0, float& f1) {
  if constexpr (FP8_SCORES) {
    split_query(a, sm, head, q_begin, q0, rows, r0, r1, c, f0, f1);
    if constexpr (SCALE_BLOCK == 0) {
      const float ks = cache.template load_scale<0>(true, 0, 0, 0);
      f0 *= ks;
      f1 *= ks;
    }
    fence_proxy_async();  // the generic-proxy stores -> wgmma; then every warp of the warpgroup has stored
    named_barrier_sync<128>(1 + wg);
  } else {
    mbar_wait(sm.q_full, q_phase);
    fence_proxy_async();
  }
  if constexpr (kOnceCodes) {  // the workspace's K holds codes: its tensor scale scales the scores
    const float ks = Fp8Cache(once->fp8).template load_scale<0>(true, 0, 0, 0);
    f0 *= ks;
    f1 *= ks;
  }
}

}  // namespace cukv
