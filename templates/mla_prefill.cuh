// Non-absorbed MLA prefill on Hopper: the ragged prefill kernel (PrefillKernel: its scheduler, shared-memory layout
// and consumer warpgroups with S = Q K^T over 192 dims, mask, online softmax and O += P V over 128) fed by
// MLAKVProducerPipeline (mla_kv_producer.cuh) instead of the MHA producer. A work item is BM query rows of one
// (sequence, head) and the visible key tiles, walked from the last, as in the MHA prefill: one block per item, or
// (PERSISTENT) one block per SM walking the items from the MHA prefill's counter (PrefillKernel::feed_items and
// consume_persistent, heads outermost but for the last section), the producer's ring position carried across items.
#pragma once
#include "prefill.cuh"
#include "mla_kv_producer.cuh"

namespace cukv {

template <class Traits>
struct MLAPrefillKernel : PrefillKernel<Traits> {
  typedef PrefillKernel<Traits> Base;
  typedef typename Base::T T;
  // Traits::kv_tma_rows > 0: k_nope / v (and rope_tma_rows > 0: the rope rows) by tensor copies; Base::kTma (the
  // MHA producer's) stays off
  static constexpr int kTmaRows = Traits::kv_tma_rows, kRopeTmaRows = Traits::rope_tma_rows;
  static constexpr bool kTma = kTmaRows > 0;
  typedef MLAKVProducerPipeline<T, Base::BN, Base::STAGES, Base::PAGE_SIZE, kTmaRows, kRopeTmaRows> Pipe;
  static_assert(Base::DEPTH == Pipe::depth && Base::DEPTH_V == Pipe::v_depth && Base::BK == Pipe::depth,
                "MLA prefill: Q/K 192 deep, V 128 wide, the whole K in one ring element");
  static_assert(!Base::QUANTIZED && !Base::kTma && !Base::kOnce && Base::kKElems == 1,
                "MLA prefill: a 16-bit rope source, copies by the MLA producer");
  static_assert(sizeof(typename Pipe::Buf) == sizeof(typename Base::Buf) && Pipe::Buf::stage_bytes == Base::Buf::stage_bytes,
                "the pipeline's ring is the consumers'");

  // omap: the output's tensor map (Traits::tma_store), [1][T][H][256] bytes in boxes of 128 bytes x 1 head x 16 tokens
  static __device__ void run(const PrefillArgs& a, const MLAPrefillArgs& m, const MLAPrefillMaps* maps,
                             const OnceArgs* once, const CUtensorMap* qmap, const CUtensorMap* omap);

  // producer warp pw of item t: the query's rows (PERSISTENT: warp 0 stages them with the item), then K and V of
  // every visited tile (the last tile first), through `pipe` (whose ring position carries across items)
  static __device__ __forceinline__ void produce(const PrefillArgs& a, const MLAPrefillArgs& m,
                                                 const MLAPrefillMaps* maps, const typename Base::Smem& sm,
                                                 const typename Base::Cache& rope, const typename Base::Item& t,
                                                 Pipe& pipe, int pw, int lane) {
    if constexpr (!Base::PERSISTENT) Base::load_query(a, sm, t.head, t.q_begin, t.q0, t.rows, pw, lane);
    const T* k_nope = static_cast<const T*>(m.k_nope);
    const T* v = static_cast<const T*>(m.v);
    const T* k_rope = static_cast<const T*>(a.kv.k);
    const i64 kv_base = m.kv_offsets[t.b];
    for (int it = 0; it < t.n_tiles; ++it) {
      const int n = t.n_first + t.n_tiles - 1 - it;
      // lane j < kWarpRows forms the offsets of the warp's row j once; the lanes copying that row take them by shuffle
      const int tok = n * Base::BN + pw * Pipe::kWarpRows + lane;
      const bool in_seq = lane < Pipe::kWarpRows && tok < t.kv_len;
      const i64 row = in_seq ? rope.row_idx(t.b, tok) : (i64)-1;  // -1: a page hole, read as zeros
      const i64 kr = row >= 0 ? Base::Cache::offset(a.kv.k_stride, row, 0, 0) : (i64)-1;
      auto row_of = [&](i64 x, int i) -> i64 { return __shfl_sync(0xffffffffu, x, (lane / 8 + 4 * i) % 32); };
      if constexpr (kTma) {
        if ((n + 1) * Base::BN <= t.kv_len) {  // wholly inside the sequence (warp-uniform)
          const int kv_row = (int)(kv_base + tok);
          int2 box = make_int2(0, (int)row);  // a contiguous k_rope: one page
          if constexpr (Base::PAGE_SIZE > 0)
            box = row >= 0 ? make_int2((int)(row / Base::PAGE_SIZE), (int)(row % Base::PAGE_SIZE)) : make_int2(-1, 0);
          pipe.acquire_kv();
          pipe.get_k_tma(*maps, t.head, kv_row, box, k_rope, [&](int i) { return row_of(kr, i); }, pw, lane);
          pipe.commit_kv_step(Pipe::kRopeByCpAsync);
          pipe.acquire_kv();
          pipe.get_v_tma(*maps, t.head, kv_row, pw, lane);
          pipe.commit_kv_step(false);
          continue;
        }
      }
      i64 kn = -1, vo = -1;
      if (in_seq) {
        kn = (kv_base + tok) * m.kn_stride[0] + (i64)t.head * m.kn_stride[1];
        vo = (kv_base + tok) * m.v_stride[0] + (i64)t.head * m.v_stride[1];
      }
      pipe.acquire_kv();
      pipe.get_k(k_nope, [&](int i) { return row_of(kn, i); }, k_rope, [&](int i) { return row_of(kr, i); }, pw, lane);
      pipe.commit_kv_step();
      pipe.acquire_kv();
      pipe.get_v(v, [&](int i) { return row_of(vo, i); }, pw, lane);
      pipe.commit_kv_step();
    }
    // leave only after every copy has landed (PERSISTENT: feed_items waits once, after the last item)
    if constexpr (!Base::PERSISTENT) asm volatile("cp.async.wait_all;" ::: "memory");
  }
};

template <class Traits>
__device__ void MLAPrefillKernel<Traits>::run(const PrefillArgs& a, const MLAPrefillArgs& m, const MLAPrefillMaps* maps,
                                              const OnceArgs* once, const CUtensorMap* qmap, const CUtensorMap* omap) {
  extern __shared__ unsigned char smem_raw[];
  const typename Base::Smem sm = Base::carve(smem_raw);
  const typename Base::Cache rope(a.kv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  Base::init_barriers(sm);
  __syncthreads();
  typename Base::Buf buf;
  buf.ring = sm.ring;
  if constexpr (Base::PERSISTENT) {
    if (warp < 4) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Base::kProducerRegs));
      Pipe pipe(sm.ring, sm.full, sm.empty);
      Base::feed_items(a, *once, qmap, sm, rope, warp, lane,
                       [&](const typename Base::Item& t) { produce(a, m, maps, sm, rope, t, pipe, warp, lane); });
    } else {
      asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Base::kConsumerRegs));
      Base::consume_persistent(a, sm, buf, rope, warp, lane, once, omap);
    }
    return;
  }
  // work items along x, heads along y (PrefillKernel::run's order: a head's query tiles share its K/V in L2)
  const typename Base::Item t = Base::make_item(a, nullptr, rope, blockIdx.x, blockIdx.y);
  if (warp < 4) {
    if constexpr (Base::kProducerRegs > 0) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Base::kProducerRegs));
    Pipe pipe(sm.ring, sm.full, sm.empty);
    produce(a, m, maps, sm, rope, t, pipe, warp, lane);
  } else {
    if constexpr (Base::kProducerRegs > 0) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Base::kConsumerRegs));
    typename Base::Ring ring{0};
    Base::consume(a, sm, buf, rope, t.head, t.q_begin, t.q0, t.rows, t.kv_len, t.shift, t.n_first, t.n_tiles, 0,
                  warp - 4, lane, ring, 0, nullptr, omap);
    Base::drain_output(lane);
  }
}

}  // namespace cukv
