// Non-absorbed MLA prefill on Hopper: the ragged prefill kernel (PrefillKernel: its scheduler, shared-memory layout
// and consumer warpgroups with S = Q K^T over 192 dims, mask, online softmax and O += P V over 128) fed by
// MLAKVProducerPipeline (mla_kv_producer.cuh) instead of the MHA producer. One block owns BM query rows of one
// (sequence, head) and walks its visible key tiles from the last, as the MHA prefill does.
#pragma once
#include "prefill.cuh"
#include "mla_kv_producer.cuh"

namespace cukv {

template <class Traits>
struct MLAPrefillKernel : PrefillKernel<Traits> {
  typedef PrefillKernel<Traits> Base;
  typedef typename Base::T T;
  typedef MLAKVProducerPipeline<T, Base::BN, Base::STAGES, Base::PAGE_SIZE> Pipe;
  static_assert(Base::DEPTH == Pipe::depth && Base::DEPTH_V == Pipe::v_depth && Base::BK == Pipe::depth,
                "MLA prefill: Q/K 192 deep, V 128 wide, the whole K in one ring element");
  static_assert(!Base::QUANTIZED && !Base::kTma && !Base::PERSISTENT && !Base::kOnce && Base::kKElems == 1,
                "MLA prefill: a 16-bit rope source, copies by cp.async, one block per work item");
  static_assert(sizeof(typename Pipe::Buf) == sizeof(typename Base::Buf) && Pipe::Buf::stage_bytes == Base::Buf::stage_bytes,
                "the pipeline's ring is the consumers'");

  static __device__ void run(const PrefillArgs& a, const MLAPrefillArgs& m);

  // producer warp pw: the query's rows, then K and V of every visited tile (the last tile first)
  static __device__ __forceinline__ void produce(const PrefillArgs& a, const MLAPrefillArgs& m,
                                                 const typename Base::Smem& sm, const typename Base::Cache& rope,
                                                 const typename Base::Item& t, int pw, int lane) {
    Base::load_query(a, sm, t.head, t.q_begin, t.q0, t.rows, pw, lane);
    Pipe pipe(sm.ring, sm.full, sm.empty);
    const T* k_nope = static_cast<const T*>(m.k_nope);
    const T* v = static_cast<const T*>(m.v);
    const T* k_rope = static_cast<const T*>(a.kv.k);
    const i64 kv_base = m.kv_offsets[t.b];
    for (int it = 0; it < t.n_tiles; ++it) {
      const int n = t.n_first + t.n_tiles - 1 - it;
      // lane j < kWarpRows forms the offsets of the warp's row j once; the lanes copying that row take them by shuffle
      const int tok = n * Base::BN + pw * Pipe::kWarpRows + lane;
      i64 kn = -1, vo = -1, kr = -1;
      if (lane < Pipe::kWarpRows && tok < t.kv_len) {
        kn = (kv_base + tok) * m.kn_stride[0] + (i64)t.head * m.kn_stride[1];
        vo = (kv_base + tok) * m.v_stride[0] + (i64)t.head * m.v_stride[1];
        const i64 row = rope.row_idx(t.b, tok);  // -1: a page hole, read as zeros
        kr = row >= 0 ? Base::Cache::offset(a.kv.k_stride, row, 0, 0) : (i64)-1;
      }
      auto row_of = [&](i64 x, int i) -> i64 { return __shfl_sync(0xffffffffu, x, (lane / 8 + 4 * i) % 32); };
      pipe.acquire_kv();
      pipe.get_k(k_nope, [&](int i) { return row_of(kn, i); }, k_rope, [&](int i) { return row_of(kr, i); }, pw, lane);
      pipe.commit_kv_step();
      pipe.acquire_kv();
      pipe.get_v(v, [&](int i) { return row_of(vo, i); }, pw, lane);
      pipe.commit_kv_step();
    }
    asm volatile("cp.async.wait_all;" ::: "memory");  // leave only after every copy has landed
  }
};

template <class Traits>
__device__ void MLAPrefillKernel<Traits>::run(const PrefillArgs& a, const MLAPrefillArgs& m) {
  extern __shared__ unsigned char smem_raw[];
  const typename Base::Smem sm = Base::carve(smem_raw);
  const typename Base::Cache rope(a.kv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < Base::STAGES; ++s) {
      mbar_init(sm.full + 8 * s, 128);  // every producer lane arrives when its copies land
      mbar_init(sm.empty + 8 * s, Base::kConsumerWGs * 4);
    }
    mbar_init(sm.q_full, 128);
  }
  __syncthreads();
  // work items along x, heads along y (PrefillKernel::run's order: a head's query tiles share its K/V in L2)
  const typename Base::Item t = Base::make_item(a, nullptr, rope, blockIdx.x, blockIdx.y);
  if (warp < 4) {
    if constexpr (Base::kProducerRegs > 0) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Base::kProducerRegs));
    produce(a, m, sm, rope, t, warp, lane);
  } else {
    if constexpr (Base::kProducerRegs > 0) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Base::kConsumerRegs));
    typename Base::Buf buf;
    buf.ring = sm.ring;
    typename Base::Ring ring{0};
    Base::consume(a, sm, buf, rope, t.head, t.q_begin, t.q0, t.rows, t.kv_len, t.shift, t.n_first, t.n_tiles, 0,
                  warp - 4, lane, ring, 0, nullptr);
  }
}

}  // namespace cukv
