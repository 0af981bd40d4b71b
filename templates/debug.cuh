// Timing and diagnosis aids of the prefill kernels, all off (0) as shipped, where they compile to nothing. A probe
// switches one on with a compile define (compile_source(defines=...) or CUKV_DEFINES; benchmarks/ab_macros.sh still
// rewrites the #define lines here). Nothing below changes what a shipped kernel computes.
#pragma once
#include "hopper.cuh"  // globaltimer_ns

// CUKV_TRACE 1: lane 0 of each warp of the first kTraceBlocks blocks (blockIdx.x == 0 and z == 0) writes clock64()
// for (warp, iteration, event) into cukv_trace (trace_mark), which benchmarks/trace_prefill.py reads with
// RawModule.get_global.
#ifndef CUKV_TRACE
#define CUKV_TRACE 0
#endif
// CUKV_WAIT_STATS 1: the consumer warpgroups sum their waits into cukv_wait_stats (ns; benchmarks/probe_waits.py):
// [0] K tiles, [1] V tiles, [2] the ring order's named barrier, [3] consume() in all, [4] tiles, [5] items; convert
// once: [6] K waits and [7] tiles of the items begun in the first 400 us (from the earliest block start, the word
// CUKV_ONCE_STATS keeps)
#ifndef CUKV_WAIT_STATS
#define CUKV_WAIT_STATS 0
#endif
// CUKV_ONCE_STATS 1 (convert once): counts visits in the 32 ints before the flags (benchmarks/probe_prefill_once.py
// --stats): [1] quarters converted, [2] warp 0's flag reads that found their tiles ready, [3] those that had to wait,
// [4] its polls, [5] its wait time in 64 ns units, [6] the converters' time in 64 ns units, [7] / [8] the blocks'
// first items' waits, summed / longest, in 64 ns units, [16] the first consumer warpgroup's query waits at item
// boundaries (64 ns units), [10..11] ~(earliest block start), [12..13] latest consumer end, [14..15] ~(earliest
// end), ns ([29..31] are the persistent grids' counters, not statistics)
#ifndef CUKV_ONCE_STATS
#define CUKV_ONCE_STATS 0
#endif
// CUKV_ONCE_UB 1 (convert once, timing only): every tile is loaded from the workspace as a previous run left it
// (warp 0 reads no flags, the converters return at once): the bound a free conversion would give
#ifndef CUKV_ONCE_UB
#define CUKV_ONCE_UB 0
#endif

namespace cukv {

constexpr int kTraceBlocks = 8, kTraceWarps = 16, kTraceIters = 128, kTraceEvents = 8;
#if CUKV_TRACE
extern "C" {
// unmangled, for get_global; benchmarks/trace_prefill.py views it as [blocks][warps][iterations][events]
__device__ long long cukv_trace[kTraceBlocks * kTraceWarps * kTraceIters * kTraceEvents];
}
#endif
#if CUKV_WAIT_STATS
extern "C" {
__device__ unsigned long long cukv_wait_stats[8];  // a definition: the block form of extern "C"
}
#endif

// CUKV_WAIT_STATS: one consumer warp's waits over a work item (ns, 32 bits: an item's waits stay far below 4 s),
// added to cukv_wait_stats by flush(). As shipped every member is dead code.
struct WaitStats {
  u32 k = 0, v = 0, bar = 0, k_early = 0, t0 = 0;
  bool early = false;  // an item begun while convert-once's converters run (see PrefillKernel::consume)
  static __device__ __forceinline__ u32 now() { return CUKV_WAIT_STATS ? (u32)globaltimer_ns() : 0u; }
  // sum += the time since `since` (a now())
  static __device__ __forceinline__ void add(u32& sum, u32 since) {
    if (CUKV_WAIT_STATS) sum += (u32)globaltimer_ns() - since;
  }
  // a K wait that began at `since`
  __device__ __forceinline__ void add_k(u32 since) {
    if (CUKV_WAIT_STATS) {
      const u32 dk = (u32)globaltimer_ns() - since;
      k += dk;
      if (early) k_early += dk;
    }
  }
  // one warp of each four (first_of_four) adds the item's sums
  __device__ __forceinline__ void flush(bool first_of_four, int n_tiles) const {
#if CUKV_WAIT_STATS
    if (first_of_four) {
      atomicAdd(&cukv_wait_stats[0], (unsigned long long)k);
      atomicAdd(&cukv_wait_stats[1], (unsigned long long)v);
      atomicAdd(&cukv_wait_stats[2], (unsigned long long)bar);
      atomicAdd(&cukv_wait_stats[3], (unsigned long long)((u32)globaltimer_ns() - t0));
      atomicAdd(&cukv_wait_stats[4], (unsigned long long)n_tiles);
      atomicAdd(&cukv_wait_stats[5], 1ull);
      atomicAdd(&cukv_wait_stats[6], (unsigned long long)k_early);
      if (early) atomicAdd(&cukv_wait_stats[7], (unsigned long long)n_tiles);
    }
#endif
  }
};

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
