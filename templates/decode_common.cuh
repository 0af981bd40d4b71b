// What the decode kernels share (DecodeKernel in decode.cuh, DecodeRingKernel in decode_ring.cuh): the
// arguments, the block's shared memory, the split of the context into strips, a warp's strip ring, the
// per-strip online softmax and the epilogue that merges warps and splits (merge_row is in decode.cuh).
#pragma once
#include "decode_streaming.cuh"

namespace cukv {

struct alignas(8) DecodeArgs {
  KVCacheParams kv;
  const void* q;        // [batch, num_qo_heads, depth], contiguous
  void* out;            // [batch, num_qo_heads, depth]
  float* lse;           // [batch, num_qo_heads] natural log, or nullptr
  float* part_o;        // [num_splits, batch, num_qo_heads, depth] (num_splits > 1)
  float* part_lse;      // [num_splits, batch, num_qo_heads] base 2
  const float* sink;    // [num_qo_heads] logits, or nullptr
  int* counters;        // [batch, num_kv_heads] zeros: split blocks finished (num_splits > 1)
  float sm_scale;       // softmax scale
  float softcap;        // 0: off
  int window;           // 0: off; else keys in (p - window, p]
  int num_splits;
  int num_qo_heads;
  int split_strips;     // 16-token strips per split when there is no window (from plan's max_kv_len)
};

template <typename T, int DEPTH>
__device__ __forceinline__ void merge_row(const DecodeArgs& a, int b, int hq, int batch);

// The K and V tensor maps of a `tma` ring (both kernels), encoded by cukv/ops/decode.py over the cache's bytes
// ([pages][page_size][heads][row bytes], boxes of 128 bytes x 1 head x 16 tokens x 1 page, 128-byte swizzle).
struct alignas(64) DecodeMaps {
  CUtensorMap k, v;  // v == &k + 1 (the FP8 ring indexes them by lane)
};

// Static shared memory of a decode block: what decode_epilogue merges through, and Q (16 rows of Q_PITCH
// elements, rows past the group zero) when the head is too wide to keep Q in registers. WARP_SLOTS gives each
// warp its own slot for its output (one barrier instead of one per warp in the merge); without it the warps
// accumulate into o in turn.
template <typename T, int NUM_WARPS, int GROUP, int DEPTH, bool Q_IN_SMEM, int Q_PITCH, bool WARP_SLOTS = false>
struct DecodeSmem {
  static constexpr int O_PITCH = DEPTH + 8;  // rows of a warp slot 8 banks apart: the quad's stores spread out
  static constexpr int SLOT_FLOATS = GROUP * O_PITCH;
  float m[NUM_WARPS][16];
  float l[NUM_WARPS][16];
  float M[16], L[16];
  float o[WARP_SLOTS ? 1 : GROUP][WARP_SLOTS ? 1 : DEPTH];
  alignas(16) float slots[WARP_SLOTS ? NUM_WARPS : 1][WARP_SLOTS ? SLOT_FLOATS : 1];
  int last;
  int q_amax;  // stage_q_f16: the bits of the group's largest |q| (non-negative floats order as ints)
  alignas(16) T q[Q_IN_SMEM ? 16 : 1][Q_IN_SMEM ? Q_PITCH : 8];

  // The group's Q rows as f16, all multiplied by one power of two 2^e that puts the largest |q| in
  // [2^14, 2^15): bf16 values convert exactly (their 8-bit mantissas fit f16's 11) unless they sit more
  // than 2^28 below the largest. Returns 2^-e, the factor that takes f16 scores back. Every thread calls it.
  __device__ __forceinline__ float stage_q_f16(const T* qg) {
    static_assert(Q_IN_SMEM, "Q lives in registers for this configuration");
    constexpr int NT = NUM_WARPS * 32;
    if (threadIdx.x == 0) q_amax = 0;
    stage_q(qg, 1.f);  // Q is read from global memory once; the conversion runs in place
    float mx = 0.f;
    for (int i = threadIdx.x; i < GROUP * DEPTH / 8; i += NT) {
      const uint4 v = *reinterpret_cast<const uint4*>(&q[i / (DEPTH / 8)][(i % (DEPTH / 8)) * 8]);
      const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int k = 0; k < 8; ++k) mx = fmaxf(mx, fabsf(ElemTraits<T>::to_float(e[k])));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if ((threadIdx.x & 31) == 0) atomicMax(&q_amax, __float_as_int(mx));
    __syncthreads();
    const int ex = (q_amax >> 23) & 0xff;                     // biased exponent of the largest |q|
    const int e = q_amax == 0 ? 0 : max(-100, min(100, 14 - (ex - 127)));
    const float f = __int_as_float((e + 127) << 23), inv = __int_as_float((127 - e) << 23);
    for (int i = threadIdx.x; i < GROUP * DEPTH / 8; i += NT) {  // rows past the group stay zero (f16 zeros)
      uint4* p = reinterpret_cast<uint4*>(&q[i / (DEPTH / 8)][(i % (DEPTH / 8)) * 8]);
      *p = convert8<__half, T>(*p, f);  // f16 bits in T's storage
    }
    __syncthreads();
    return inv;
  }

  // Lane (g, c)'s Q fragment of K strip ks (rows g and, with two rows, g + 8), as the score mma reads it.
  template <bool TWO_ROWS>
  __device__ __forceinline__ void q_frag(int g, int c, int ks, uint4& xa, uint4& xb) const {
    xa = *reinterpret_cast<const uint4*>(&q[g][ks * 32 + 8 * c]);
    xb = TWO_ROWS ? *reinterpret_cast<const uint4*>(&q[g + 8][ks * 32 + 8 * c]) : make_uint4(0, 0, 0, 0);
  }

  // The block's GROUP query rows (times f, a power of two) into q; every thread of the block calls it.
  __device__ __forceinline__ void stage_q(const T* qg, float f) {
    static_assert(Q_IN_SMEM, "Q lives in registers for this head dim");
    for (int i = threadIdx.x; i < 16 * DEPTH / 8; i += NUM_WARPS * 32) {
      const int row = i / (DEPTH / 8), col = (i % (DEPTH / 8)) * 8;
      *reinterpret_cast<uint4*>(&q[row][col]) =
          row < GROUP ? scale8<T>(*reinterpret_cast<const uint4*>(qg + (i64)row * DEPTH + col), f) : make_uint4(0, 0, 0, 0);
    }
    __syncthreads();
  }
};

// Strips [lo, hi) of this split and the first visible token. Without a window the splits take fixed runs of
// split_strips strips, so lo does not wait for the length load and the first page lookups go out beside it;
// the last split also takes whatever lies past the planned length. With a window, [start, len) is divided
// evenly.
__device__ __forceinline__ void split_range(const DecodeArgs& a, int len, int split, int& start, int& lo, int& hi) {
  constexpr int BN = 16;
  const int c_hi = (len + BN - 1) / BN;
  if (a.window > 0) {
    start = max(0, len - a.window);
    const int c_lo = start / BN;
    const int per = (c_hi - c_lo + a.num_splits - 1) / a.num_splits;
    lo = c_lo + split * per;
    hi = min(c_hi, lo + per);
  } else {
    start = 0;
    lo = split * a.split_strips;
    hi = split == a.num_splits - 1 ? c_hi : min(c_hi, lo + a.split_strips);
  }
}

// What every decode block knows before its first strip, the same for both kernels: the block's (split, KV head,
// sequence), the lane's roles (g, c: the mma fragments' row and column pair), the sequence's cached length, the
// first visible token and this split's strips [lo, hi) (split_range).
struct DecodeBlock {
  int split, hk, b;
  int warp, lane, g, c;
  int len;
  int start, lo, hi;

  template <typename Op>
  __device__ __forceinline__ DecodeBlock(const DecodeArgs& a, const Op& op)
      : split(blockIdx.x), hk(blockIdx.y), b(blockIdx.z), warp(threadIdx.x >> 5), lane(threadIdx.x & 31),
        g(lane >> 2), c(lane & 3), len(op.cache_length(b)) {
    split_range(a, len, split, start, lo, hi);
  }
};

// A warp's ring of STAGES strip slots in shared memory. Copies run STAGES - 1 strips ahead of the strip being
// computed and page-table entries one strip further ahead still, so a copy never waits on the table. The
// warp's strips are first, first + step, ... below end. issue_strip(base, t0, slot) copies strip t0 into
// slot (base: the row of token t0, -1 for an unmapped page; only looked up where a strip lies in one page).
// prologue() issues the first STAGES - 1 strips (early, so they overlap the rest of the set-up); run() then
// calls body(t0, slot) on each strip once every lane's copies of it have landed.
// MBAR: a slot's strip lands on its own mbarrier (STAGES of them, 8 bytes apart from `bars`, each expecting 32
// arrivals: issue_strip makes every lane arrive once per strip, for tensor copies or for its cp.async copies)
// instead of cp.async commit groups; before a slot is refilled the lanes' reads of it are ordered before the
// async proxy's writes (fence.proxy.async).
template <typename Op, int STAGES, int BN, bool MBAR = false>
struct StripRing {
  static constexpr bool ONE_PAGE = Op::page_size % BN == 0;
  const Op& op;
  const int b, first, end, step;
  // the slot strip st_issue goes to: a plain int (as a WrappedRingState ptxas gave the d128 16-bit ring 14 more
  // registers)
  int st_issue, slot_issue = 0;
  i64 key_next;  // the table entry of strip st_issue (row_key; checked by row_from_key when it is issued)
  const u32 bars;  // MBAR: shared address of slot 0's mbarrier

  __device__ __forceinline__ StripRing(const Op& op_, int b_, int first_, int end_, int step_, u32 bars_ = 0)
      : op(op_), b(b_), first(first_), end(end_), step(step_), st_issue(first_),
        key_next(ONE_PAGE ? op_.row_key(b_, first_ * BN) : (i64)0), bars(bars_) {}

  template <typename Issue>
  __device__ __forceinline__ void issue(Issue& issue_strip) {
    const i64 base = ONE_PAGE ? op.row_from_key(key_next, st_issue * BN) : (i64)0;
    if constexpr (ONE_PAGE) key_next = op.row_key(b, (st_issue + step) * BN);
    if (st_issue < end) issue_strip(base, st_issue * BN, slot_issue);
    if constexpr (!MBAR) cp_async_commit();
    st_issue += step;
    slot_issue = slot_issue + 1 == STAGES ? 0 : slot_issue + 1;
  }
  template <typename Issue>
  __device__ __forceinline__ void prologue(Issue& issue_strip) {
#pragma unroll
    for (int k = 0; k < STAGES - 1; ++k) issue(issue_strip);
  }
  template <typename Issue, typename Body>
  __device__ __forceinline__ void run(Issue& issue_strip, Body&& body) {
    WrappedRingState<STAGES> slot;
    int parity = 0;  // MBAR: the phase of the slots' barriers on this round of the ring
    for (int st = first; st < end; st += step) {
      issue(issue_strip);
      if constexpr (MBAR) {
        mbar_wait(bars + 8u * (u32)slot.stage, parity);  // the strip's copies (tensor or cp.async) have landed
      } else {
        cp_async_wait<STAGES - 1>();
        __syncwarp();  // every lane's copies of this strip have landed
      }
      body(st * BN, slot.stage);
      if constexpr (MBAR) fence_proxy_async();  // this lane's reads of the slot before a tensor copy refills it
      __syncwarp();  // every lane is done with this slot before a later issue overwrites it
      slot.advance();
      if constexpr (MBAR) parity ^= slot.stage == 0;
    }
    cp_async_wait<0>();  // nothing may land in shared memory after the block moves on
  }
};

// Online softmax over one 16-token strip. s holds the raw scores as an m16n8k16 C fragment (rows g and g+8
// are query heads, columns t0 + 8 nt + 2c + {0, 1} tokens) and leaves as unnormalized probabilities; the
// running max m and sum l are updated, and the output accumulated so far must be scaled by al0 / al1.
template <bool TWO_ROWS>
__device__ __forceinline__ void strip_softmax(const DecodeArgs& a, float scale_log2, float (&s)[2][4], int t0, int start,
                                              int len, float& m0, float& m1, float& l0, float& l1, float& al0,
                                              float& al1) {
  const int c = threadIdx.x & 3;
  // scores -> base-2 logits; masked columns become -inf by selection, never by arithmetic. Soft-capping and
  // masking are warp-uniform branches: a strip wholly inside [start, len) skips the mask.
  if (a.softcap > 0.f) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = a.softcap * tanhf(s[nt][e] * a.sm_scale / a.softcap) * kLog2e;
  } else {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= scale_log2;
  }
  if (t0 < start || t0 + 16 > len) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = t0 + nt * 8 + 2 * c + (e & 1);
        s[nt][e] = (t >= start && t < len) ? s[nt][e] : -CUKV_INF;
      }
  }
  float mx0 = -CUKV_INF, mx1 = -CUKV_INF;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (e < 2) mx0 = fmaxf(mx0, s[nt][e]); else mx1 = fmaxf(mx1, s[nt][e]);
    }
  mx0 = quad_max(mx0);
  const float mn0 = fmaxf(m0, mx0);
  const float mu0 = mn0 == -CUKV_INF ? 0.f : mn0;  // a row with nothing yet must not make NaN
  al0 = fast_exp2(m0 - mu0);
  m0 = mn0;
  float mu1 = 0.f;
  al1 = 1.f;
  if constexpr (TWO_ROWS) {
    mx1 = quad_max(mx1);
    const float mn1 = fmaxf(m1, mx1);
    mu1 = mn1 == -CUKV_INF ? 0.f : mn1;
    al1 = fast_exp2(m1 - mu1);
    m1 = mn1;
  }
  float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    s[nt][0] = fast_exp2(s[nt][0] - mu0);
    s[nt][1] = fast_exp2(s[nt][1] - mu0);
    ps0 += s[nt][0] + s[nt][1];
    if constexpr (TWO_ROWS) {
      s[nt][2] = fast_exp2(s[nt][2] - mu1);
      s[nt][3] = fast_exp2(s[nt][3] - mu1);
      ps1 += s[nt][2] + s[nt][3];
    }
  }
  l0 = l0 * al0 + ps0;
  if constexpr (TWO_ROWS) l1 = l1 * al1 + ps1;
}

// A row's output from its base-2 running max mm, its sum ll and an unnormalized accumulator acc: the sink
// (design.md) joins the denominator only, and an empty row (ll == 0: nothing visible) gives 0 and LSE -inf.
__device__ __forceinline__ float out_value(const DecodeArgs& a, int hq, float mm, float ll, float acc) {
  if (!(ll > 0.f)) return 0.f;  // ll > 0 implies mm is finite
  const float denom = a.sink != nullptr ? ll + fast_exp2(a.sink[hq] * kLog2e - mm) : ll;
  return acc / denom;
}
__device__ __forceinline__ float out_lse(float mm, float ll) { return ll > 0.f ? (mm + __log2f(ll)) * kLn2 : -CUKV_INF; }

// The end of every decode block: merge the warps' (m, l, o) in shared memory in warp order (deterministic),
// then write the final output (one split) or this split's fp32 partial and base-2 LSE; the last split
// block of (b, hk) merges all partials. dim_of(j, e) is the head dim of accumulator o[j][e] in this lane.
// Smem needs m, l, M, L, o[GROUP][DEPTH] and last. slots (may be nullptr): per-warp scratch of
// Smem::SLOT_FLOATS floats, warp w's at slots + w * slot_stride, that only warp w has touched so far; with
// it every warp stores its rescaled output at once and the sum over warps (still in warp order, so the
// result is the same bits) is read back after a single barrier.
// CLUSTER > 1: the splits of (b, hk) are one thread-block cluster of CLUSTER blocks (split = rank); each
// block keeps its (M, L, summed output) in shared memory and, after a cluster barrier, merges its share of
// the outputs from every block's shared memory: no partials in global memory, no fence, no counter.
template <typename T, int DEPTH, int GROUP, int NUM_WARPS, int CLUSTER, int NO, typename Smem, typename DimOf>
__device__ __forceinline__ void decode_epilogue(const DecodeArgs& a, Smem& sm, float (&o)[NO][4], float m0, float m1,
                                                float l0, float l1, DimOf dim_of, float* slots = nullptr,
                                                int slot_stride = 0) {
  const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  // ---- merge the warps of this block: max, rescale, sum in warp order
  l0 = quad_sum(l0);
  l1 = quad_sum(l1);
  if (c == 0) {
    sm.m[warp][g] = m0;
    sm.l[warp][g] = l0;
    sm.m[warp][g + 8] = m1;
    sm.l[warp][g + 8] = l1;
  }
  __syncthreads();
  float M[2], L[2], f[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    float mm = -CUKV_INF;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) mm = fmaxf(mm, sm.m[w][row]);
    float ll = 0.f, mine = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float mw = sm.m[w][row];
      const float fw = mw == -CUKV_INF ? 0.f : fast_exp2(mw - mm);
      ll += fw * sm.l[w][row];
      if (w == warp) mine = fw;
    }
    M[r] = mm;
    L[r] = ll;
    f[r] = mine;
  }
  constexpr int OP = Smem::O_PITCH;
  if (slots != nullptr) {
    float* mine = slots + warp * slot_stride;
#pragma unroll
    for (int j = 0; j < NO; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e >> 1);
        const int dim = dim_of(j, e);
        if (row < GROUP && dim < DEPTH) mine[row * OP + dim] = o[j][e] * f[e >> 1];
      }
  } else {
#pragma unroll 1
  for (int w = 0; w < NUM_WARPS; ++w) {
    if (w == warp) {
#pragma unroll
      for (int j = 0; j < NO; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = g + 8 * (e >> 1);
          const int dim = dim_of(j, e);
          if (row < GROUP && dim < DEPTH) {
            const float val = o[j][e] * f[e >> 1];
            sm.o[row][dim] = w == 0 ? val : sm.o[row][dim] + val;
          }
        }
      }
    }
    __syncthreads();
  }
  }

  // ---- write: final output (one split) or fp32 partial + base-2 LSE
  if (warp == 0 && c == 0) {
    sm.M[g] = M[0];
    sm.L[g] = L[0];
    sm.M[g + 8] = M[1];
    sm.L[g + 8] = L[1];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < GROUP * DEPTH; idx += NUM_WARPS * 32) {
    const int row = idx / DEPTH, dim = idx % DEPTH;
    const int hq = hk * GROUP + row;
    const float mm = sm.M[row], ll = sm.L[row];
    float acc;
    if (slots != nullptr) {
      acc = slots[row * OP + dim];
#pragma unroll
      for (int w = 1; w < NUM_WARPS; ++w) acc += slots[w * slot_stride + row * OP + dim];
    } else {
      acc = sm.o[row][dim];
    }
    const i64 oi = ((i64)b * a.num_qo_heads + hq) * DEPTH + dim;
    if constexpr (CLUSTER > 1) {  // the block's sum, in place, for the cluster merge below
      if (slots != nullptr) slots[row * OP + dim] = acc;
      continue;
    }
    if (a.num_splits == 1) {
      static_cast<T*>(a.out)[oi] = ElemTraits<T>::from_float(out_value(a, hq, mm, ll, acc));
      if (dim == 0 && a.lse != nullptr) a.lse[(i64)b * a.num_qo_heads + hq] = out_lse(mm, ll);
    } else {
      const i64 pi = (i64)split * gridDim.z * a.num_qo_heads * DEPTH + oi;
      a.part_o[pi] = ll > 0.f ? acc / ll : 0.f;
      if (dim == 0)
        a.part_lse[((i64)split * gridDim.z + b) * a.num_qo_heads + hq] = ll > 0.f ? mm + __log2f(ll) : -CUKV_INF;
    }
  }
  if constexpr (CLUSTER > 1) {
    cluster_sync();
    const u32 m_at = smem_addr(&sm.M[0]), l_at = smem_addr(&sm.L[0]);
    const u32 o_at = slots != nullptr ? smem_addr(slots) : smem_addr(&sm.o[0][0]);
    const int pitch = slots != nullptr ? OP : DEPTH;
    for (int idx = split * NUM_WARPS * 32 + threadIdx.x; idx < GROUP * DEPTH; idx += CLUSTER * NUM_WARPS * 32) {
      const int row = idx / DEPTH, dim = idx % DEPTH;
      const int hq = hk * GROUP + row;
      float ms[CLUSTER], mm = -CUKV_INF;
#pragma unroll
      for (int r = 0; r < CLUSTER; ++r) {
        ms[r] = ld_cluster_f32(cluster_map(m_at + 4 * row, r));
        mm = fmaxf(mm, ms[r]);
      }
      float ll = 0.f, acc = 0.f;
#pragma unroll
      for (int r = 0; r < CLUSTER; ++r) {  // splits in order: deterministic
        const float w = ms[r] == -CUKV_INF ? 0.f : fast_exp2(ms[r] - mm);
        ll += w * ld_cluster_f32(cluster_map(l_at + 4 * row, r));
        acc += w * ld_cluster_f32(cluster_map(o_at + 4 * (row * pitch + dim), r));
      }
      const i64 oi = ((i64)b * a.num_qo_heads + hq) * DEPTH + dim;
      static_cast<T*>(a.out)[oi] = ElemTraits<T>::from_float(out_value(a, hq, mm, ll, acc));
      if (dim == 0 && a.lse != nullptr) a.lse[(i64)b * a.num_qo_heads + hq] = out_lse(mm, ll);
    }
    cluster_sync();  // no block leaves (freeing its shared memory) while another still reads it
    return;
  }
  if (a.num_splits == 1) return;
  // The last block of (b, hk) to finish merges every split's partial (no second launch); it resets the
  // counter so the next run (or CUDA graph replay) starts from zero.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int prev = atomicAdd(a.counters + (i64)b * gridDim.y + hk, 1);
    sm.last = prev == a.num_splits - 1;
  }
  __syncthreads();
  if (!sm.last) return;
  __threadfence();
  for (int r = warp; r < GROUP; r += NUM_WARPS) merge_row<T, DEPTH>(a, b, hk * GROUP + r, gridDim.z);
  if (threadIdx.x == 0) a.counters[(i64)b * gridDim.y + hk] = 0;
}

}  // namespace cukv
