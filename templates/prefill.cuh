// Ragged prefill over a paged (or contiguous) KV cache on Hopper: warp-specialized, wgmma.
//
// A block owns BM query rows of one (sequence, query head) and walks its visible KV tiles from the last
// (the masked diagonal) to the first. A producer warpgroup gathers K and V rows through the page table (cp.async
// or TMA) into the KVBuffer ring; BM / 64 consumer warpgroups each compute S = Q K^T for 64 rows with
// wgmma (Q and K from shared memory), run the online softmax in registers, and accumulate O += P V with P
// straight from registers. Ring elements are handed over by mbarriers: `full` counts the producer lanes'
// completions, `empty` the consumer warps that finished reading.
//
// The files, by concern: prefill_args.cuh (arguments and options), prefill_kernel.cuh (derived sizes, shared-memory
// layout, declarations), prefill_scheduler.cuh (work items), prefill_producer.cuh (K/V ring), prefill_once.cuh
// (convert once), prefill_consumer.cuh (S, mask, softmax, P V, epilogue); run() below assigns the roles.
#pragma once
#include "prefill_producer.cuh"
#include "prefill_once.cuh"
#include "prefill_consumer.cuh"

namespace cukv {

template <class Traits>
__device__ void PrefillKernel<Traits>::run(const PrefillArgs& a, const PrefillMaps* maps, const OnceArgs* once,
                                           const CUtensorMap* qmap) {
  static_assert(!kTmaStore, "the MHA prefill has no output tensor map (tma_store: the MLA prefill's)");
  extern __shared__ unsigned char smem_raw[];
  const Smem sm = carve(smem_raw);
  const Cache cache(a.kv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  init_barriers(sm);
  if constexpr (kKsMma) {
    // the fixed A of the K-scale wgmma (see kKsMma): row r weighs the first or the second three terms by 0.5
    if (threadIdx.x < 64) {
      const u32 half2 = 0x3f003f00u, half1 = 0x3f00u;  // bf16 0.5 (a pair, one)
      const bool second = (threadIdx.x / 8) % 2;
      asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(sm.kscale + (u32)(threadIdx.x * 16)),
                   "r"(second ? 0u : half2), "r"(second ? 0u : half1), "r"(second ? half2 : 0u),
                   "r"(second ? half1 : 0u)
                   : "memory");
      fence_proxy_async();
    }
  }
  __syncthreads();

  Buf buf;
  buf.ring = sm.ring;
  if constexpr (PERSISTENT) {
    // timing aid: [10..11] ~(earliest block start), [12..13] latest consumer end, [14..15] ~(earliest end), ns
    if ((CUKV_ONCE_STATS || CUKV_WAIT_STATS) && threadIdx.x == 0)
      atomicMax(reinterpret_cast<unsigned long long*>(once->flags - 32 + 10), ~(unsigned long long)globaltimer_ns());
    if (warp < 4) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(kProducerRegs));
      if constexpr (!kOnce)
        feed_persistent_16(a, maps, *once, qmap, sm, buf, cache, warp, lane);
      else if (warp == 0)
        feed_persistent(a, maps, *once, qmap, sm, buf, cache, lane);
      else
        convert_persistent(a, *once, sm, buf, cache, raw_quarter(sm, warp), lane);
    } else {
      asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(kConsumerRegs));
      consume_persistent(a, sm, buf, cache, warp, lane, once);
    }
    return;
  }
  // work items along x (launched first), heads along y: the blocks in flight are the query tiles of one or two
  // heads, which read the same K/V rows while they are in L2 (heads along x had each KV head's rows read by
  // blocks far apart in time: slower on H100, most at MHA; docs/tuning.md)
  const Item t = make_item(a, once, cache, blockIdx.x, blockIdx.y);
  const int vslice = blockIdx.z;
  if (warp < 4) {
    if constexpr (kProducerRegs > 0) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(kProducerRegs));
    if constexpr (kOnce)
      produce_once(a, maps, *once, sm, buf, cache, t.b, t.kv_head, t.head, t.q_begin, t.q0, t.rows, t.kv_len,
                   t.n_first, t.n_tiles, warp, lane);
    else {
      Ring ring{0};
      produce(a, maps, sm, buf, cache, t.b, t.kv_head, t.head, t.q_begin, t.q0, t.rows, t.kv_len, t.n_first,
              t.n_tiles, vslice, warp, lane, ring);
    }
  } else {
    if constexpr (kProducerRegs > 0) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(kConsumerRegs));
    Ring ring{0};
    consume(a, sm, buf, cache, t.head, t.q_begin, t.q0, t.rows, t.kv_len, t.shift, t.n_first, t.n_tiles, vslice,
            warp - 4, lane, ring, 0, once);
  }
}

// thread 0: the ring's barriers, the query's, and the persistent grid's and FP8 TMA raw slots' where they exist (the
// block synchronizes before any use)
template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::init_barriers(const Smem& sm) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(sm.full + 8 * s, 128);  // every producer lane arrives when its copies land
      mbar_init(sm.empty + 8 * s, kConsumerWGs * 4);
    }
    // every producer lane's query copies (PERSISTENT: warp 0's lane 0 with the item and its tensor copies)
    mbar_init(sm.q_full, PERSISTENT ? 1 : 128);
    if constexpr (PERSISTENT) mbar_init(sm.q_empty, kConsumerWGs * 4);
    if constexpr (kTma && QUANTIZED) {
      for (int s = 0; s < 2; ++s) mbar_init(sm.raw_full + 8 * s, 128);  // every producer lane arrives
    }
  }
}

template <class Traits>
__device__ __forceinline__ void PrefillKernel<Traits>::consume_persistent(const PrefillArgs& a, const Smem& sm,
                                                                          const Buf& buf, const Cache& cache, int warp,
                                                                          int lane, const OnceArgs* once,
                                                                          const CUtensorMap* omap) {
  Ring ring{0};
  for (int i = 0;; ++i) {
    const u64 tq0 = CUKV_ONCE_STATS ? globaltimer_ns() : 0;
    mbar_wait(sm.q_full, i & 1);
    if (CUKV_ONCE_STATS && i > 0 && warp == 4 && lane == 0)  // [16]: the first warpgroup's query waits
      atomicAdd(once->flags - 32 + 16, (int)((globaltimer_ns() - tq0) >> 6));
    const Item t = load_item(sm.item);
    if (t.b < 0) {
      if (CUKV_ONCE_STATS && warp == 4 && lane == 0) {
        const unsigned long long now = globaltimer_ns();
        atomicMax(reinterpret_cast<unsigned long long*>(once->flags - 32 + 12), now);
        atomicMax(reinterpret_cast<unsigned long long*>(once->flags - 32 + 14), ~now);
      }
      drain_output(lane);
      return;
    }
    consume(a, sm, buf, cache, t.head, t.q_begin, t.q0, t.rows, t.kv_len, t.shift, t.n_first, t.n_tiles, 0,
            warp - 4, lane, ring, i & 1, once, omap);
  }
}

}  // namespace cukv
