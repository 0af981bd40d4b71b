// Per-iteration timestamps for studying a kernel's pipeline (benchmarks/trace_prefill.py sets CUKV_TRACE 1 in
// a copy of the tree; as checked in it is 0 and trace_mark compiles to nothing). Lane 0 of each warp of the
// first kTraceBlocks blocks (blockIdx.x == 0 and z == 0) writes clock64() for (warp, iteration, event) into
// cukv_trace, which the host reads with RawModule.get_global.
#pragma once

#define CUKV_TRACE 0

namespace cukv {

constexpr int kTraceBlocks = 8, kTraceWarps = 16, kTraceIters = 128, kTraceEvents = 8;
#if CUKV_TRACE
extern "C" {
// unmangled, for get_global; benchmarks/trace_prefill.py views it as [blocks][warps][iterations][events]
__device__ long long cukv_trace[kTraceBlocks * kTraceWarps * kTraceIters * kTraceEvents];
}
#endif

__device__ __forceinline__ void trace_mark(int it, int ev) {
#if CUKV_TRACE
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0 && blockIdx.x == 0 && blockIdx.z == 0 && blockIdx.y < kTraceBlocks && it >= 0 &&
      it < kTraceIters && warp < kTraceWarps) {
    long long t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t) :: "memory");
    cukv_trace[((blockIdx.y * kTraceWarps + warp) * kTraceIters + it) * kTraceEvents + ev] = t;
  }
#endif
}

}  // namespace cukv
