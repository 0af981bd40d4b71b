// merge_states: combine N partial attentions over disjoint key sets by their (natural-log) LSE.
//
//   m = max_i s_i,  w_i = exp(s_i - m),  v = sum_i w_i v_i / sum_i w_i,  s = m + log(sum_i w_i)
//
// A partition with s_i = -inf (no visible key) is skipped: its values are never loaded, so whatever its
// buffer holds (NaN included) cannot reach the output. A row whose partitions are all empty gets v = 0 and
// s = -inf. Everything is computed in float32; v is read and written in T (bf16, fp16 or float32).
//
// Layout: a row is one (token, head) pair; row r of state i starts at byte
//   v + i * v_state_stride + r * DEPTH * sizeof(T)        (lse: s + i * s_state_stride + r * 4)
// so one stacked [N, rows, DEPTH] array and two separate arrays (stride = the distance between their base
// addresses, computed on the host) go through the same kernel. Each row is handled by DEPTH / VEC
// consecutive threads, VEC = 16 bytes of T per thread; a block holds ROWS_PER_BLOCK rows and strides over
// the grid.
#pragma once
#include "common.cuh"

namespace cukv {

struct alignas(8) MergeArgs {
  const void* v;          // state 0 of the values: [rows, DEPTH] of T, rows contiguous, 16-byte aligned
  const float* s;         // state 0 of the LSEs: [rows] float32, natural log
  void* out;              // [rows, DEPTH] of T
  float* lse;             // [rows] float32
  i64 v_state_stride;     // bytes from state i to state i + 1 (any sign; a multiple of 16)
  i64 s_state_stride;     // bytes from state i to state i + 1 (a multiple of 4)
  i64 num_rows;
  int num_states;
  int pad_;
};

// 16 bytes of T <-> float[16 / sizeof(T)]
template <typename T> struct MergeVec {  // __half and __nv_bfloat16: 8 per 16 bytes
  static constexpr int N = 8;
  static __device__ __forceinline__ void load(float (&x)[N], const void* p) {
    const uint4 r = ldg_stream16(p);
    const u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const T* h = reinterpret_cast<const T*>(&w[j]);
      x[2 * j] = ElemTraits<T>::to_float(h[0]);
      x[2 * j + 1] = ElemTraits<T>::to_float(h[1]);
    }
  }
  static __device__ __forceinline__ void store(void* p, const float (&x)[N]) {
    uint4 r;
    r.x = ElemTraits<T>::pack(x[0], x[1]);
    r.y = ElemTraits<T>::pack(x[2], x[3]);
    r.z = ElemTraits<T>::pack(x[4], x[5]);
    r.w = ElemTraits<T>::pack(x[6], x[7]);
    *reinterpret_cast<uint4*>(p) = r;
  }
};

template <> struct MergeVec<float> {
  static constexpr int N = 4;
  static __device__ __forceinline__ void load(float (&x)[N], const void* p) {
    const uint4 r = ldg_stream16(p);
    x[0] = __uint_as_float(r.x); x[1] = __uint_as_float(r.y); x[2] = __uint_as_float(r.z); x[3] = __uint_as_float(r.w);
  }
  static __device__ __forceinline__ void store(void* p, const float (&x)[N]) {
    *reinterpret_cast<uint4*>(p) = make_uint4(__float_as_uint(x[0]), __float_as_uint(x[1]), __float_as_uint(x[2]),
                                              __float_as_uint(x[3]));
  }
};

template <typename T, int DEPTH, int THREADS>
struct MergeStatesKernel {
  typedef MergeVec<T> Vec;
  static constexpr int kVec = Vec::N;                        // elements per thread per load (16 bytes)
  static constexpr int kThreadsPerRow = DEPTH / kVec;
  static constexpr int kRowsPerBlock = THREADS / kThreadsPerRow;
  static constexpr int kIdleThreads = THREADS - kRowsPerBlock * kThreadsPerRow;
  static_assert(sizeof(T) * kVec == 16, "a thread moves 16 bytes");
  static_assert(DEPTH % kVec == 0, "head_dim must be a multiple of 16 bytes");
  static_assert(kRowsPerBlock >= 1, "a block must hold at least one row");
  static_assert(THREADS % 32 == 0, "whole warps");

  static __device__ __forceinline__ float lse_of(const MergeArgs& a, int i, i64 row) {
    return *reinterpret_cast<const float*>(reinterpret_cast<const char*>(a.s) + i * a.s_state_stride + row * 4);
  }

  static __device__ __forceinline__ void run(const MergeArgs& a) {
    const int slot = threadIdx.x / kThreadsPerRow;           // which row of the block
    const int lane = threadIdx.x % kThreadsPerRow;           // which 16 bytes of the row
    if (slot >= kRowsPerBlock) return;                       // leftover threads when DEPTH does not divide
    const int n = a.num_states;
    for (i64 row = (i64)blockIdx.x * kRowsPerBlock + slot; row < a.num_rows; row += (i64)gridDim.x * kRowsPerBlock) {
      float m = -CUKV_INF;
      for (int i = 0; i < n; ++i) m = fmaxf(m, lse_of(a, i, row));
      float acc[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] = 0.f;
      float total = 0.f;
      const i64 col = row * (i64)(DEPTH * sizeof(T)) + lane * 16;
      if (m > -CUKV_INF) {
#pragma unroll 4
        for (int i = 0; i < n; ++i) {
          const float si = lse_of(a, i, row);
          if (si > -CUKV_INF) {                              // select, never multiply: empty states hold garbage
            const float w = expf(si - m);
            float x[kVec];
            Vec::load(x, reinterpret_cast<const char*>(a.v) + i * a.v_state_stride + col);
#pragma unroll
            for (int j = 0; j < kVec; ++j) acc[j] = fmaf(w, x[j], acc[j]);
            total += w;
          }
        }
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] *= inv;
      Vec::store(reinterpret_cast<char*>(a.out) + col, acc);
      if (lane == 0) a.lse[row] = total > 0.f ? m + logf(total) : -CUKV_INF;
    }
  }
};

}  // namespace cukv
