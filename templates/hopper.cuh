// Hopper building blocks for the prefill pipeline: mbarriers, cp.async with zero fill, wgmma
// shared-memory descriptors for the 128-byte swizzle, and the fences that order them.
#pragma once
#include "common.cuh"
#include "wgmma_ops.cuh"

namespace cukv {

typedef unsigned long long u64;

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// --- mbarriers (CTA scope) -------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_n(u32 bar, int n) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(n) : "memory");
}
// Arrives once every cp.async this thread issued so far has landed (the count was set up front).
__device__ __forceinline__ void mbar_arrive_cp_async(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}
// The barrier tracks this thread's cp.async copies issued so far without an arrival of its own: the pending count
// rises now and falls back once they land, so the phase waits for them and for the arrivals it expects.
__device__ __forceinline__ void mbar_track_cp_async(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, int parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT_%=;\n}\n"
      :: "r"(bar), "r"(parity) : "memory");
}

// A position in a ring of STAGES elements handed over by full/empty mbarrier pairs (FlashAttention's PipelineState):
// `count` elements have passed, the next sits in slot stage(), and its full barrier completes phase() on this round
// (the producer's wait on its empty barrier, for the consumers' release of the previous round, is empty_phase()).
// It keeps the running count rather than a wrapped (stage, phase) pair: the same arithmetic the kernels were tuned
// with, and ahead(e) is the element e further on.
template <int STAGES>
struct RingState {
  int count;
  __device__ __forceinline__ int stage() const { return count % STAGES; }
  __device__ __forceinline__ int phase() const { return (count / STAGES) & 1; }
  __device__ __forceinline__ int empty_phase() const { return ((count / STAGES) & 1) ^ 1; }
  __device__ __forceinline__ RingState ahead(int e) const { return RingState{count + e}; }
  __device__ __forceinline__ void advance(int n = 1) { count += n; }
};

// A ring position kept wrapped, for rings that need neither the running count nor a phase (decode's cp.async strip
// rings: commit groups, not mbarriers, hand their slots over, and STAGES need not be a power of two, so advance()
// is a compare where RingState's stage() would be a division).
template <int STAGES>
struct WrappedRingState {
  int stage = 0;
  __device__ __forceinline__ void advance() {
    const int next = stage + 1;
    stage = next == STAGES ? 0 : next;
  }
};

// Adds tx bytes the current phase must also see land (TMA completions count them down) without arriving.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, int bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

// --- TMA (cp.async.bulk.tensor) --------------------------------------------------------------------
// The driver's opaque 128-byte descriptor (cuda.h cannot be included under NVRTC); cukv/tma.py encodes it.
struct alignas(64) CUtensorMap { unsigned long long opaque[16]; };

// One box of a 4-d tensor map (coordinates innermost first) into shared memory at dst, completing `bytes`
// of bar's transaction count. Coordinates outside the tensor read as zeros (and still count).
__device__ __forceinline__ void tma_load_4d(u32 dst, const CUtensorMap* map, int c0, int c1, int c2, int c3, u32 bar) {
#ifdef CUKV_TMA_EVICT_FIRST  // probe only (benchmarks/probe_mla_tma.py): the copies' lines first out of L2
  asm volatile(
      "{\n .reg .b64 pol;\n createpolicy.fractional.L2::evict_first.b64 pol, 1.0;\n"
      " cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3, %4, %5}], [%6], pol;\n}\n"
      :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
#else
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
      :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
#endif
}

// tma_load_4d into the same shared address of every block of the cluster in `mask` (bit r: cluster rank r),
// completing the box's bytes on the barrier at the same address in each.
__device__ __forceinline__ void tma_load_4d_multicast(u32 dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                                      u32 bar, unsigned short mask) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;"
      :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "h"(mask) : "memory");
}

// The box at these coordinates of a 4-d tensor map into L2 (no shared memory, no barrier).
__device__ __forceinline__ void tma_prefetch_4d(const CUtensorMap* map, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];"
               :: "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}

// One box of shared memory at src into a 4-d tensor map (coordinates innermost first), in this thread's current bulk
// group; the box is clipped at the tensor's ends (nothing past them is written). The source must have been written
// before a fence_proxy_async(), and stay unchanged until tma_store_wait_read() has seen the group read it.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, u32 src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
               :: "l"(map), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// all but N of this thread's bulk groups have read their shared memory (it may be written again)
template <int N>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
// all but N of this thread's bulk groups are complete (written to global memory)
template <int N>
__device__ __forceinline__ void tma_store_wait() { asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory"); }

// Four 8x8 matrices of 16-bit pairs to shared memory (stmatrix): register i of lane t holds row t / 4, columns
// 2 (t % 4) and 2 (t % 4) + 1 of matrix i (the mma accumulators' layout); lane t gives the 16-byte row t % 8 of
// matrix t / 8.
__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
  asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};"
               :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// stmatrix_x4 transposed: lane t's register i (row t / 4, columns 2 (t % 4), +1 of matrix i) lands in the 16-byte rows
// 2 (t % 4) and 2 (t % 4) + 1 of matrix i, at element t / 4; lane t gives row t % 8 of matrix t / 8, as above.
__device__ __forceinline__ void stmatrix_x4_trans(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
  asm volatile("stmatrix.sync.aligned.x4.trans.m8n8.shared.b16 [%0], {%1, %2, %3, %4};"
               :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// orders global accesses of the generic proxy with the async proxy's (tensor copies) on either side
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// --- flags shared between blocks --------------------------------------------------------------------
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int ld_relaxed_gpu(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// --- cp.async: 16 bytes global -> shared; src_bytes = 0 writes zeros without reading ---------------
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// The same with an L2 prefetch hint: a miss brings BYTES (64, 128 or 256) from DRAM at once, for rows that
// are read whole (decode strips).
template <int BYTES>
__device__ __forceinline__ void cp_async16_l2(u32 dst, const void* src, int src_bytes) {
  static_assert(BYTES == 64 || BYTES == 128 || BYTES == 256, "L2 prefetch size");
  if constexpr (BYTES == 256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
  else if constexpr (BYTES == 128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
  else
    asm volatile("cp.async.cg.shared.global.L2::64B [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// 4-byte copies (through L1: .ca is the only form for sizes under 16); same zero fill.
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

// --- thread-block clusters: a barrier over every thread of the cluster (release / acquire), and loads from
// another block's shared memory (distributed shared memory)
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 cluster_map(u32 smem, int rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem), "r"(rank));
  return r;
}
// This block's rank in its cluster.
__device__ __forceinline__ int cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return (int)r;
}
// Arrive on an mbarrier of another block of the cluster (its address from cluster_map).
__device__ __forceinline__ void mbar_arrive_remote(u32 cluster_bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" :: "r"(cluster_bar) : "memory");
}
// `bytes` (a multiple of 16) of this block's shared memory at src into another block's at dst (a cluster_map
// address), by the bulk-copy engine, completing them on that block's mbarrier at bar (a cluster_map address). The
// source must have been written before a fence_proxy_async().
__device__ __forceinline__ void bulk_copy_to_peer(u32 dst, u32 src, int bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "r"(src), "r"(bytes), "r"(bar) : "memory");
}
// Makes this thread's mbarrier.init visible to the async proxy (the tensor copies that complete on the barriers) and
// to the cluster's other blocks (before a cluster_sync).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ float ld_cluster_f32(u32 addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

// Generic-proxy writes (cp.async, st.shared) become visible to wgmma's async proxy after this fence.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Named barriers (ids 1-15; 0 is __syncthreads): THREADS counts the syncing and the arriving threads together.
template <int THREADS>
__device__ __forceinline__ void named_barrier_sync(int id) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "n"(THREADS) : "memory");
}
template <int THREADS>
__device__ __forceinline__ void named_barrier_arrive(int id) {
  asm volatile("bar.arrive %0, %1;" :: "r"(id), "n"(THREADS) : "memory");
}

// Whether `v` holds in all THREADS threads syncing on named barrier `id` (a bar.red.and: a barrier with a vote).
template <int THREADS>
__device__ __forceinline__ bool named_barrier_all(int id, bool v) {
  u32 r;
  asm volatile("{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.and.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
               : "=r"(r) : "r"((u32)v), "r"(id), "n"(THREADS) : "memory");
  return r != 0;
}

// --- wgmma sequencing ------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
// Keeps the compiler from moving accumulator reads/writes across an in-flight wgmma.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// --- the 128-byte swizzle ---------------------------------------------------------------------------
// A swizzle atom is 8 rows of 128 bytes (64 16-bit elements), 1024-byte aligned; the 16-byte chunk c of
// row r sits at chunk position c ^ (r % 8). Tiles are columns of atoms: rows at 128 B, 8-row groups at 1 KB.
constexpr int kAtomCols = 64;       // elements per swizzled row
constexpr int kAtomRowBytes = 128;

__device__ __forceinline__ u32 swizzle128(int row, int chunk) {
  return (u32)(row * kAtomRowBytes + ((chunk ^ (row & 7)) << 4));
}

// wgmma shared-memory matrix descriptor, 128-byte swizzle (layout type 1).
__device__ __forceinline__ u64 sw128_desc(u32 addr, u32 lbo, u32 sbo) {
  u64 d = 0;
  d |= (u64)((addr & 0x3FFFF) >> 4);
  d |= (u64)((lbo & 0x3FFFF) >> 4) << 16;
  d |= (u64)((sbo & 0x3FFFF) >> 4) << 32;
  d |= (u64)1 << 62;
  return d;
}

// A descriptor moved `bytes` along its operand (a k16 step, an atom): only the start address field, addr >> 4 in
// the low 14 bits, changes. Shared-memory operands end below 256 KB, so the add stays inside that field; adding to
// the low word alone lets a loop of wgmmas form each descriptor with one add from a base computed once, instead of
// masking and shifting every address again (about ten integer instructions per wgmma at d256).
__device__ __forceinline__ u64 desc_add(u64 d, u32 bytes) {
  return (d & 0xFFFFFFFF00000000ull) | (u32)((u32)d + (bytes >> 4));
}

// wgmma shared-memory matrix descriptor without swizzle (layout type 0): core matrices of 8 rows x 16 bytes
// stored contiguously; K-major operands step lbo bytes between core matrices along K, sbo along M/N.
__device__ __forceinline__ u64 plain_desc(u32 addr, u32 lbo, u32 sbo) {
  u64 d = 0;
  d |= (u64)((addr & 0x3FFFF) >> 4);
  d |= (u64)((lbo & 0x3FFFF) >> 4) << 16;
  d |= (u64)((sbo & 0x3FFFF) >> 4) << 32;
  return d;
}

}  // namespace cukv
