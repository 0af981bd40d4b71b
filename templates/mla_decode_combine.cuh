// Combine kernel of absorbed MLA decode: merges the float32 partials of the chunks of one (sequence, row block)
// by their LSE (natural log), applies the sink, writes the output row and its LSE. Rows whose row block was
// one chunk were written by the main kernel and are skipped. A partial with LSE -inf (no visible key) is
// never read. One block of 128 threads per query row, 4 columns per thread.
#pragma once
#include "mla_decode.cuh"

namespace cukv {

template <typename T>
__device__ void mla_decode_combine(const MLADecodeParams& a) {
  const int R = blockIdx.x, b = blockIdx.y;
  if (R >= a.rows || b >= a.batch) return;
  const int rb = R / kMlaBlockM, row = R - rb * kMlaBlockM;
  const int k = b * a.row_blocks + rb;
  const int first = a.rb_indptr[k], n = a.rb_indptr[k + 1] - first;
  if (n <= 1) return;
  float mx = -CUKV_INF;
  for (int j = 0; j < n; ++j) mx = fmaxf(mx, a.part_lse[a.rb_slots[first + j] * kMlaBlockM + row]);
  const int i = R / a.heads, h = R - i * a.heads;
  const long long orow = ((long long)b * a.s_q + i) * a.heads + h;
  T* out = reinterpret_cast<T*>(a.out) + orow * kMlaNope + 4 * threadIdx.x;
  if (mx == -CUKV_INF) {
    *reinterpret_cast<uint2*>(out) = make_uint2(0u, 0u);
    if (a.lse != nullptr && threadIdx.x == 0) a.lse[orow] = -CUKV_INF;
    return;
  }
  float sum = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int j = 0; j < n; ++j) {
    const int slot = a.rb_slots[first + j];
    const float s = a.part_lse[slot * kMlaBlockM + row];
    if (s == -CUKV_INF) continue;
    const float wgt = __expf(s - mx);
    sum += wgt;
    const float4 v = *reinterpret_cast<const float4*>(a.part_o + ((long long)slot * kMlaBlockM + row) * kMlaNope + 4 * threadIdx.x);
    acc.x += wgt * v.x;
    acc.y += wgt * v.y;
    acc.z += wgt * v.z;
    acc.w += wgt * v.w;
  }
  const float lse = mx + __logf(sum);
  float f = 1.f / sum;
  if (a.sink != nullptr) f /= 1.f + __expf(a.sink[h] - lse);
  *reinterpret_cast<uint2*>(out) = make_uint2(ElemTraits<T>::pack(acc.x * f, acc.y * f), ElemTraits<T>::pack(acc.z * f, acc.w * f));
  if (a.lse != nullptr && threadIdx.x == 0) a.lse[orow] = lse;
}

}  // namespace cukv
