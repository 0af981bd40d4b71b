// Split-KV paged decode with a shared-memory ring per warp (16-bit caches, page size a multiple of 16).
//
// Same grid, softmax and epilogue as DecodeKernel (decode.cuh); only the staging differs. Each warp owns a
// ring of STAGES slots in dynamic shared memory; a slot holds one 16-token strip of K and of V
// (DecodeRingStrip). The warp issues cp.async copies STAGES - 1 strips ahead of the one it computes, so
// the bytes in flight cost shared memory instead of registers, and reads its operands back with ldmatrix:
// K rows as the score mma's B fragments, V rows transposed as the P.V mma's B fragments. Rows are 16-byte
// chunks XOR-swizzled by (row % 8), so the eight rows one ldmatrix reads sit in eight different banks.
// Tokens outside [start, len) and rows on unmapped pages are zero-filled by the copy (src size 0), never
// read: NaN in unused slots cannot reach an output.
// Traits::tma: a strip wholly inside [start, len) on a mapped page comes by TMA tensor copies instead, one box per
// 64-dim atom of K and of V (128 bytes x 1 head x 16 tokens of one page, 128-byte swizzle), into a slot laid out as
// atom columns; the other strips still go by cp.async into the same layout. Either way every lane arrives once on
// the slot's mbarrier (StripRing's MBAR form), so a strip is waited for the same way however it came.
#pragma once
#include "decode.cuh"
#include "hopper.cuh"

namespace cukv {

__device__ __forceinline__ void ldmatrix_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr) : "memory");
}

// One ring slot: K rows [BN][DEPTH] then V rows [BN][DEPTH], 16-bit elements, chunk-swizzled rows. ATOM_COLUMNS
// (the tensor-copy layout): each half is DEPTH / 64 atom columns of BN rows x 128 bytes, the 128-byte swizzle's
// pattern (hopper.cuh swizzle128) in each; a slot then starts on 1024 bytes. Either way the eight rows one ldmatrix
// reads at one chunk sit in eight different 16-byte bank groups.
template <int DEPTH, bool ATOM_COLUMNS = false>
struct DecodeRingStrip {
  static constexpr int BN = 16;
  static constexpr int CHUNKS = DEPTH / 8;              // 16-byte chunks per row
  static constexpr int ROW_BYTES = DEPTH * 2;
  static constexpr int HALF_BYTES = BN * ROW_BYTES;     // K (or V) part
  static constexpr int BYTES = 2 * HALF_BYTES;
  static constexpr int COPIES = BN * CHUNKS / 32;       // 16-byte copies per lane for K (and again for V)
  static constexpr int ATOMS = DEPTH / kAtomCols;       // atom columns per half (ATOM_COLUMNS)
  static constexpr int ATOM_BYTES = BN * kAtomRowBytes;  // one atom column: one tensor copy's box
  static_assert(CHUNKS % 8 == 0, "the swizzle permutes chunks within groups of 8: head dim a multiple of 64");
  static_assert(COPIES >= 1 && (BN * CHUNKS) % 32 == 0, "whole copies per lane");
  static_assert(!ATOM_COLUMNS || (ATOM_BYTES % 1024 == 0 && BYTES % 1024 == 0),
                "atom columns and slots keep the 128-byte swizzle's 1024-byte alignment");

  static __device__ __forceinline__ u32 offset(int row, int chunk) {
    if constexpr (ATOM_COLUMNS)
      return (u32)((chunk >> 3) * ATOM_BYTES) + swizzle128(row, chunk & 7);
    else
      return (u32)(row * ROW_BYTES + ((chunk ^ (row & 7)) << 4));
  }
};

// Traits: DecodeTraits (decode.cu.j2) with quantized false and stages > 0; sub, scale_block and warp_slots unused
// (a warp's merge slot is its own ring slots).
template <class Traits>
struct DecodeRingKernel {
  typedef typename Traits::T T;
  static constexpr int PAGE_SIZE = Traits::page_size, DEPTH = Traits::head_dim, GROUP = Traits::group;
  static constexpr int NUM_WARPS = Traits::num_warps, STAGES = Traits::stages, CLUSTER = Traits::cluster;
  static_assert(!Traits::quantized, "FP8 caches take DecodeKernel's ring (decode.cuh)");
  static constexpr bool TMA = Traits::tma;
  typedef KVCacheOperand<T, PAGE_SIZE, false> Op;
  typedef DecodeRingStrip<DEPTH, TMA> Strip;
  static constexpr int BN = 16;
  static constexpr bool TWO_ROWS = GROUP > 8;
  static constexpr int NO = DEPTH / 8;               // output n-tiles of 8 dims
  static constexpr int NKS = DEPTH / 16;             // k-steps of the score mma
  static constexpr bool Q_IN_SMEM = Traits::q_in_smem;  // registers go to the output accumulator instead
  static_assert(Q_IN_SMEM || DEPTH <= 128, "Q in registers: head dim <= 128");
  static constexpr int Q_PITCH = DEPTH + 8;          // padded rows: the 8 rows of a fragment load hit 8 banks
  static constexpr int SLOTS_BYTES = NUM_WARPS * STAGES * Strip::BYTES;
  // TMA: then one mbarrier per slot, and 1024 bytes of slack to align the slots for the 128-byte swizzle
  static constexpr int RING_BYTES = SLOTS_BYTES + (TMA ? 1024 + 8 * NUM_WARPS * STAGES : 0);
  // rows are read whole: let an L2 miss fetch the row (up to 256 bytes) from DRAM at once
  static constexpr int L2_PREFETCH = Strip::ROW_BYTES >= 256 ? 256 : Strip::ROW_BYTES >= 128 ? 128 : 64;
  static_assert(PAGE_SIZE % BN == 0, "a strip lies in one page");
  static_assert(GROUP >= 1 && GROUP <= 16, "group (query heads per KV head) must be 1..16");
  static_assert(STAGES >= 2 && STAGES <= 8, "2..8 ring slots per warp");

  typedef DecodeSmem<T, NUM_WARPS, GROUP, DEPTH, Q_IN_SMEM, Q_PITCH> Smem;
  // after its last strip a warp's own ring slots hold its merge slot (decode_epilogue)
  static_assert(Smem::SLOT_FLOATS * 4 <= STAGES * Strip::BYTES, "a warp's merge slot fits in its ring");

  // Copies strip t0 of (b, head) into the slot at `slot` (shared address); base is the row of token t0
  // (-1: an unmapped page).
  static __device__ __forceinline__ void issue(const Op& op, u32 slot, int head, int t0, int start, int len, i64 base) {
    const int lane = threadIdx.x & 31;
    const T* pk = static_cast<const T*>(op.p.k);
    const T* pv = static_cast<const T*>(op.p.v);
    if (base >= 0) {
      pk = op.row_ptr(true, base, head);
      pv = op.row_ptr(false, base, head);
    }
    const i64 ks = op.p.k_stride[1], vs = op.p.v_stride[1];
#pragma unroll
    for (int i = 0; i < Strip::COPIES; ++i) {
      const int idx = lane + 32 * i, row = idx / Strip::CHUNKS, chunk = idx % Strip::CHUNKS;
      const int t = t0 + row;
      const bool ok = base >= 0 && t >= start && t < len;
      const u32 dst = slot + Strip::offset(row, chunk);
      cp_async16_l2<L2_PREFETCH>(dst, ok ? pk + row * ks + 8 * chunk : pk, ok ? 16 : 0);
      cp_async16_l2<L2_PREFETCH>(dst + Strip::HALF_BYTES, ok ? pv + row * vs + 8 * chunk : pv, ok ? 16 : 0);
    }
  }

  // TMA: strip t0 into the slot at `slot`, every lane arriving once on the slot's barrier `bar`. A strip wholly inside
  // [start, len) on a mapped page (warp-uniform) comes by 2 * ATOMS tensor copies, one per lane, each lane first
  // adding its box's bytes to the barrier's transaction count; any other strip goes by issue()'s zero-filling
  // cp.async copies, and the lane's arrival then waits for them (cp.async.mbarrier.arrive.noinc).
  static __device__ __forceinline__ void issue_tma(const Op& op, const DecodeMaps* maps, u32 slot, u32 bar, int head,
                                                   int t0, int start, int len, i64 base) {
    if (base >= 0 && t0 >= start && t0 + BN <= len) {
      const int lane = threadIdx.x & 31;
      if (lane < 2 * Strip::ATOMS) {
        const bool is_v = lane >= Strip::ATOMS;
        const int atom = is_v ? lane - Strip::ATOMS : lane;
        mbar_expect_tx(bar, Strip::ATOM_BYTES);
        tma_load_4d(slot + (u32)((is_v ? Strip::HALF_BYTES : 0) + atom * Strip::ATOM_BYTES), is_v ? &maps->v : &maps->k,
                    atom * kAtomRowBytes, head, (int)(base % PAGE_SIZE), (int)(base / PAGE_SIZE), bar);
      }
      mbar_arrive(bar);
    } else {
      issue(op, slot, head, t0, start, len, base);
      mbar_arrive_cp_async(bar);
    }
  }

  static __device__ __forceinline__ void run(const DecodeArgs& a, const DecodeMaps* maps = nullptr) {
    __shared__ Smem sm;
    extern __shared__ __align__(16) unsigned char ring_raw[];  // 16 B: banks depend on offsets, not the base
    // TMA: the slots start on 1024 bytes (the 128-byte swizzle's pattern repeats every 8 rows of 128 bytes)
    const u32 ring_at = TMA ? (smem_addr(ring_raw) + 1023u) & ~1023u : smem_addr(ring_raw);
    unsigned char* ring = ring_raw + (ring_at - smem_addr(ring_raw));
    const Op op(a.kv);
    const DecodeBlock blk(a, op);
    const int hk = blk.hk, b = blk.b, warp = blk.warp, lane = blk.lane, g = blk.g, c = blk.c;
    const int len = blk.len, start = blk.start, my_lo = blk.lo, my_hi = blk.hi;
    const u32 my_ring = ring_at + (u32)(warp * STAGES * Strip::BYTES);
    // TMA: this warp's STAGES barriers after all the slots, each expecting its 32 lanes
    const u32 my_bars = ring_at + (u32)SLOTS_BYTES + (u32)(8 * warp * STAGES);
    if constexpr (TMA) {
      if (lane == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) mbar_init(my_bars + 8 * s, 32);
        fence_mbarrier_init();
      }
      __syncwarp();
    }

    // Strips of this warp: my_lo + warp + NUM_WARPS * k, copied into the ring before Q is staged.
    StripRing<Op, STAGES, BN, TMA> sr(op, b, my_lo + warp, my_hi, NUM_WARPS, my_bars);
    auto issue_strip = [&](i64 base, int t0, int slot) {
      if constexpr (TMA)
        issue_tma(op, maps, my_ring + slot * Strip::BYTES, my_bars + 8 * slot, hk, t0, start, len, base);
      else
        issue(op, my_ring + slot * Strip::BYTES, hk, t0, start, len, base);
    };
    sr.prologue(issue_strip);

    // Q as A fragments: a0 = Q[g][16ks + 2c..], a1 = Q[g+8][..], a2 = Q[g][16ks + 8 + 2c..], a3 = Q[g+8][+8..]
    const T* qg = static_cast<const T*>(a.q) + ((i64)b * a.num_qo_heads + (i64)hk * GROUP) * DEPTH;
    u32 qf[Q_IN_SMEM ? 1 : NKS][4];
    if constexpr (Q_IN_SMEM) {
      sm.stage_q(qg, 1.f);
    } else {
#pragma unroll
      for (int ks = 0; ks < NKS; ++ks) {
        const int d = 16 * ks + 2 * c;
        qf[ks][0] = g < GROUP ? *reinterpret_cast<const u32*>(qg + (i64)g * DEPTH + d) : 0u;
        qf[ks][2] = g < GROUP ? *reinterpret_cast<const u32*>(qg + (i64)g * DEPTH + d + 8) : 0u;
        qf[ks][1] = (TWO_ROWS && g + 8 < GROUP) ? *reinterpret_cast<const u32*>(qg + (i64)(g + 8) * DEPTH + d) : 0u;
        qf[ks][3] = (TWO_ROWS && g + 8 < GROUP) ? *reinterpret_cast<const u32*>(qg + (i64)(g + 8) * DEPTH + d + 8) : 0u;
      }
    }
    const float scale_log2 = a.sm_scale * kLog2e;

    float o[NO][4];
#pragma unroll
    for (int j = 0; j < NO; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m0 = -CUKV_INF, m1 = -CUKV_INF, l0 = 0.f, l1 = 0.f;

    // ldmatrix lane roles: lane l addresses row (l & 7) of matrix (l >> 3)
    const int mi = lane >> 3, mr = lane & 7;
    sr.run(issue_strip, [&](int t0, int slot) {
      const u32 sk = my_ring + slot * Strip::BYTES, sv = sk + Strip::HALF_BYTES;

      // S = Q K^T: matrices (tokens 0-7, dims lo), (0-7, hi), (8-15, lo), (8-15, hi) of each k-step
      float s[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < NKS; ++ks) {
        u32 k0, k1, k2, k3;
        ldmatrix_x4(sk + Strip::offset(8 * (mi >> 1) + mr, 2 * ks + (mi & 1)), k0, k1, k2, k3);
        u32 a0, a1, a2, a3;
        if constexpr (Q_IN_SMEM) {
          const int d = 16 * ks + 2 * c;
          a0 = *reinterpret_cast<const u32*>(&sm.q[g][d]);
          a2 = *reinterpret_cast<const u32*>(&sm.q[g][d + 8]);
          a1 = TWO_ROWS ? *reinterpret_cast<const u32*>(&sm.q[g + 8][d]) : 0u;
          a3 = TWO_ROWS ? *reinterpret_cast<const u32*>(&sm.q[g + 8][d + 8]) : 0u;
        } else {
          a0 = qf[ks][0], a1 = qf[ks][1], a2 = qf[ks][2], a3 = qf[ks][3];
        }
        mma_16816<T>(s[0], a0, a1, a2, a3, k0, k1);
        mma_16816<T>(s[1], a0, a1, a2, a3, k2, k3);
      }
      float al0, al1;
      strip_softmax<TWO_ROWS>(a, scale_log2, s, t0, start, len, m0, m1, l0, l1, al0, al1);

      // O += P V: P is the scores' C fragment repacked as an A fragment; V transposed by ldmatrix,
      // matrices (tokens 0-7, dims 8j..), (8-15, 8j..), (0-7, 8j+8..), (8-15, 8j+8..)
      const u32 pa0 = ElemTraits<T>::pack(s[0][0], s[0][1]);
      const u32 pa2 = ElemTraits<T>::pack(s[1][0], s[1][1]);
      const u32 pa1 = TWO_ROWS ? ElemTraits<T>::pack(s[0][2], s[0][3]) : 0u;
      const u32 pa3 = TWO_ROWS ? ElemTraits<T>::pack(s[1][2], s[1][3]) : 0u;
#pragma unroll
      for (int j = 0; j < NO; j += 2) {
        u32 v0, v1, v2, v3;
        ldmatrix_x4_trans(sv + Strip::offset(8 * (mi & 1) + mr, j + (mi >> 1)), v0, v1, v2, v3);
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          o[j + jj][0] *= al0;
          o[j + jj][1] *= al0;
          if constexpr (TWO_ROWS) {
            o[j + jj][2] *= al1;
            o[j + jj][3] *= al1;
          }
        }
        mma_16816<T>(o[j], pa0, pa1, pa2, pa3, v0, v1);
        mma_16816<T>(o[j + 1], pa0, pa1, pa2, pa3, v2, v3);
      }
    });

    decode_epilogue<T, DEPTH, GROUP, NUM_WARPS, CLUSTER>(a, sm, o, m0, m1, l0, l1,
                                                [&](int j, int e) { return 8 * j + 2 * c + (e & 1); },
                                                reinterpret_cast<float*>(ring), STAGES * Strip::BYTES / 4);
  }
};

}  // namespace cukv
