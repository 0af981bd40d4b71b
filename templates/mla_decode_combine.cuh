// Combine kernel of absorbed MLA decode: merges the float32 partials of the chunks of one (sequence, row block)
// by their LSE (natural log), applies the sink, writes the output row and its LSE. Only the row blocks the plan
// lists (comb_rbs, num_items[1] of them: those split into chunks, with the range of their partial slots) are
// visited; the others were written by the main kernel. The grid is fixed (a captured launch serves every later
// plan) and strides over the listed row blocks' rows, so a plan with nothing to merge costs one load per block. A
// partial with LSE -inf (no visible key) is never read. A block of 128 threads takes one query row at a time: the
// chunks' slots and weights are gathered once into shared memory (a thread per chunk), each warp adds a quarter of
// the chunks over the whole row, and the four sums meet in shared memory (4 columns per thread written).
#pragma once
#include "mla_decode.cuh"

namespace cukv {

constexpr int kMlaMaxChunks = 512;     // chunks per (sequence, row block); plan() never makes more
constexpr int kMlaCombineThreads = 128;  // four warps a row (cukv/configs/mla_decode.py COMBINE_THREADS)

__device__ __forceinline__ float mla_block_reduce(float v, float* red, bool is_max) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float x = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, x) : v + x;
  }
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = is_max ? fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3])) : (red[0] + red[1]) + (red[2] + red[3]);
  __syncthreads();
  return v;
}

// One query row R (row `row` of its row block) of sequence b, its n >= 2 chunks' slots at rb_slots[first ...].
// Sparse (SPARSE = true) also merges the chunks' max logits into max_logits.
template <typename T, bool SPARSE>
__device__ __forceinline__ void mla_combine_row(const MLADecodeParams& a, int b, int R, int row, int first, int n,
                                                float* s_w, int* s_slot, float* s_red, float* s_acc) {
  float mx = -CUKV_INF;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const int slot = a.rb_slots[first + j];
    const float s = a.part_lse[slot * kMlaBlockM + row];
    s_slot[j] = slot;
    s_w[j] = s;
    mx = fmaxf(mx, s);
  }
  mx = mla_block_reduce(mx, s_red, true);
  const int i = R / a.heads, h = R - i * a.heads;
  const long long orow = ((long long)b * a.s_q + i) * a.heads + h;
  if constexpr (SPARSE) {
    float ml = -CUKV_INF;
    for (int j = threadIdx.x; j < n; j += blockDim.x) ml = fmaxf(ml, a.part_max[s_slot[j] * kMlaBlockM + row]);
    ml = mla_block_reduce(ml, s_red, true);
    if (a.max_logits != nullptr && threadIdx.x == 0) a.max_logits[orow] = ml;
  }
  T* out = reinterpret_cast<T*>(a.out) + orow * kMlaNope + 4 * threadIdx.x;
  if (mx == -CUKV_INF) {
    *reinterpret_cast<uint2*>(out) = make_uint2(0u, 0u);
    if (a.lse != nullptr && threadIdx.x == 0) a.lse[orow] = -CUKV_INF;
    return;
  }
  float sum = 0.f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const float s = s_w[j];
    const float wgt = s == -CUKV_INF ? 0.f : __expf(s - mx);
    s_w[j] = wgt;
    sum += wgt;
  }
  sum = mla_block_reduce(sum, s_red, false);  // its __syncthreads also publishes s_w
  // Warp w adds chunks w, w + 4, ... over all 512 columns (lane l: columns 4 (l + 32 c), c = 0..3), so a thread has
  // four independent loads per chunk and a row of many chunks a quarter of the chain; the warps' sums meet in s_acc.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float4 part[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) part[c] = make_float4(0.f, 0.f, 0.f, 0.f);
  const float* base = a.part_o + (long long)row * kMlaNope + 4 * lane;
#pragma unroll 2
  for (int j = warp; j < n; j += 4) {
    const float wgt = s_w[j];
    if (wgt == 0.f) continue;  // an empty partial: never read
    const float* p = base + (long long)s_slot[j] * (kMlaBlockM * kMlaNope);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float4 v = *reinterpret_cast<const float4*>(p + 128 * c);
      part[c].x += wgt * v.x;
      part[c].y += wgt * v.y;
      part[c].z += wgt * v.z;
      part[c].w += wgt * v.w;
    }
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) reinterpret_cast<float4*>(s_acc + warp * kMlaNope)[lane + 32 * c] = part[c];
  __syncthreads();
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const float4 v = reinterpret_cast<const float4*>(s_acc + w * kMlaNope)[threadIdx.x];
    acc.x += v.x;
    acc.y += v.y;
    acc.z += v.z;
    acc.w += v.w;
  }
  const float lse = mx + __logf(sum);
  float f = 1.f / sum;
  if (a.sink != nullptr) f /= 1.f + __expf(a.sink[h] - lse);
  *reinterpret_cast<uint2*>(out) = make_uint2(ElemTraits<T>::pack(acc.x * f, acc.y * f), ElemTraits<T>::pack(acc.z * f, acc.w * f));
  if (a.lse != nullptr && threadIdx.x == 0) a.lse[orow] = lse;
}

template <typename T, bool SPARSE = false>
__device__ void mla_decode_combine(const MLADecodeParams& a) {
  __shared__ float s_w[kMlaMaxChunks];
  __shared__ int s_slot[kMlaMaxChunks];
  __shared__ float s_red[4];
  __shared__ __align__(16) float s_acc[4 * kMlaNope];  // the four warps' sums of a row
  const int per_rb = a.rows < kMlaBlockM ? a.rows : kMlaBlockM;  // rows of a row block, the last one's may be fewer
  const int work = a.num_items[1] * per_rb;
  // The first entry is loaded beside the count: the grid never exceeds the listed capacity's rows
  // (cukv.ops.mla_decode.launch_combine), so the index is in the list's buffer either way.
  int4 e = a.comb_rbs[blockIdx.x / per_rb];
#pragma unroll 1
  for (int i = blockIdx.x; i < work; i += gridDim.x) {
    if (i != (int)blockIdx.x) e = a.comb_rbs[i / per_rb];
    const int b = e.x / a.row_blocks, rb = e.x - b * a.row_blocks;
    const int row = i - (i / per_rb) * per_rb, R = rb * kMlaBlockM + row;
    if (R >= a.rows || e.z <= 1) continue;  // (uniform over the block)
    mla_combine_row<T, SPARSE>(a, b, R, row, e.y, e.z, s_w, s_slot, s_red, s_acc);
    __syncthreads();  // the next row's gather reuses s_w, s_slot and s_acc
  }
}

}  // namespace cukv
