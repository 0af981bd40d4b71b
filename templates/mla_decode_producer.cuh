// MLAKVProducerPipeline for absorbed MLA decode: the shared-memory plan and the producer warpgroup.
//
// Every tile is BN cache rows x 576 values in T, stored as 9 columns of 128-byte swizzle atoms (64 values
// wide, BN rows tall): K for S = Q K^T is all 576 columns (k_nope_bytes + k_rope_bytes), V for O += P V is the
// first 512 columns of the same rows (v_bytes aliases k_nope_bytes). The query block sits in the same layout
// (the block's 64 rows, or 16 / 32 for the narrow consumers: QROWS_). Rows past the item's end, and rows whose
// page id lies outside the cache or the table, are zero-filled and never read, so nothing the cache holds there
// (NaN included) reaches the mma.
//
// FP8 caches (FP8 = true; 656-byte rows: 512 e4m3 codes, 4 float32 scales, 64 bf16 rope values) fill the same
// bf16 tiles: each lane loads 16 codes and their scale of FP8_ROWS rows (8 or 16) at a time into registers,
// dequantizes them (e4m3 -> f16 is exact; the product with the scale is rounded once to bf16, exactly when the
// scale is a power of two) and stores them; the rope values are copied as they are with cp.async. Those loads are
// synchronous (the bytes in flight per SM bound the producer), so with PREFETCH > 0 every row is first brought
// into L2 (cp.async.bulk.prefetch, one instruction a row) PREFETCH tiles ahead of its load and the loads wait
// for L2, not DRAM (docs/tuning.md, "MLA decode").
//
// Cluster pairs (CUKV_MLA_MULTICAST, MLADecodeConfig.multicast): the two row blocks of one chunk read the same rows, so
// they run as a cluster of two blocks that share the copies: with per-slice barriers each full tile is copied once by
// TMA multicast into both rings (rank r the slices c % 2 == r); with FP8 rows each block loads and dequantizes half of
// every tile and copies it into the other's stage with the bulk engine. Every consumer warp then releases a stage (or
// slice) in both blocks, so neither refills what the other still reads.
//
// Sparse MLA (SPARSE = true, MLAPrefillSparse): key j of "sequence" b (one query token) is cache row
// indices[b][j]; an index outside 0 .. num_rows reads as a zero row like a key past the end. Zero rows score 0,
// not -inf, so the producer also publishes which rows of each stage are real (kv_valid_producer: one ballot word
// per producer warp beside the barriers) and the consumers mask the others to -inf.
#pragma once
#include "mla_decode.cuh"
#include "fp8.cuh"

#ifndef CUKV_MLA_MULTICAST  // set by the rendered source (MLADecodeConfig.multicast)
#define CUKV_MLA_MULTICAST 0
#endif
#ifndef CUKV_MLA_PERSISTENT  // set by the rendered source (MLADecodeConfig.persistent)
#define CUKV_MLA_PERSISTENT 0
#endif
#ifndef CUKV_MLA_NEXT_Q  // set by the rendered source (SparseMLAConfig.next_q)
#define CUKV_MLA_NEXT_Q 0
#endif

namespace cukv {

__device__ __forceinline__ void st_shared16(u32 addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" :: "r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// The cache as a TMA tensor (cukv/ops/mla_decode.py encodes it): bytes [pages][page_size][1][row], boxes of 128
// bytes (64 values, one swizzle atom column) x box_rows tokens of one page. box_rows 0: every tile by cp.async.
struct alignas(64) MLACacheMap {
  CUtensorMap map;
  int box_rows;
  int pad[15];
};

template <typename T, int BN_, int STAGES_, bool FP8_ = false, bool SPARSE_ = false, bool SLICES_ = false,
          int QROWS_ = kMlaBlockM>
struct MLAKVProducerPipeline {
  static constexpr bool fp8 = FP8_, sparse = SPARSE_, slices = SLICES_;
  static constexpr int q_rows = QROWS_;  // query rows staged (the block's; 16 or 32 with the narrow consumers)
  // SLICES_ (MLADecodeConfig.slice_release): each stage's 9 atom columns of 64 values ("slices": 0-7 are also V, 8 is
  // the rope part, read by Q K^T only) have a full and an empty barrier of their own, so a slice is refilled as soon
  // as its last reader is done (mla_decode_consumer_slices.cuh); else one pair per stage.
  static constexpr int kSlices = SLICES_ ? kMlaDim / 64 : 1;
  // SLICES_ with 64-token tiles and the lazy rescale: once the scoring warpgroup's Q K^T has read a tile's rope slice,
  // that warpgroup stores the tile's P there (64 rows x 64 tokens, the slice's own swizzled layout: a wgmma A operand),
  // and both warpgroups' P V read it (mla_decode_consumer_slices.cuh). The rope slice then frees after the Q K^T and
  // both P V (kRopeReleases arrivals), and is loaded last. Not with SPARSE_: a gathered rope slice wants the lead it
  // gets from freeing right after Q K^T (P then goes through the exchange buffer).
#ifndef CUKV_MLA_REG_P  // (the define: probes time the register hand-over of P instead)
  static constexpr bool p_in_rope = SLICES_ && !SPARSE_ && BN_ == 64 && CUKV_MLA_LAZY_RESCALE;
#else
  static constexpr bool p_in_rope = false;
#endif
  static constexpr int kRopeReleases = p_in_rope ? 12 : 4;
  // SLICES_ with MLADecodeConfig.multicast: the block pair of a cluster (the two row blocks of one chunk: the same
  // tiles) shares each full tile's copies: rank r copies the slices c with c % 2 == r into both blocks' stages (TMA
  // multicast), and a slice's empty barrier counts both blocks' releases (each consumer warp arrives on its own and
  // on the other block's), so that neither refills a slice the other still reads.
  static constexpr bool multicast = SLICES_ && CUKV_MLA_MULTICAST;
  // FP8 rows with MLADecodeConfig.multicast (the split consumers): the pair shares each tile's dequantization instead;
  // rank r loads, dequantizes and stores rows 32 r .. 32 r + 31 and copies them into the other block's stage
  // (load_tile_fp8_pair), and both blocks' consumers release each stage in both.
  static constexpr bool fp8_pair = FP8_ && !SLICES_ && CUKV_MLA_MULTICAST;
  static constexpr int kPeers = multicast || fp8_pair ? 2 : 1;
  // SPARSE_ with SLICES_ and MLADecodeConfig.multicast: the pair's blocks (a token's two row blocks, the same keys)
  // gather rows 32 rank .. 32 rank + 31 of every slice each, and forward that half into the other block's stage with
  // the bulk engine once it has landed (gather_slices; `landed` barriers per slice).
  static constexpr bool gather_pair = SPARSE_ && multicast;
  static constexpr int kRings = gather_pair ? 3 : 2;  // full and empty (and landed) barriers per slice and stage
  // SLICES_ with MLADecodeConfig.persistent: a block takes work items blockIdx.x, blockIdx.x + gridDim.x, ...; the
  // ring's tile count runs on across them (`ring0`: the item's first tile), and q_empty (each consumer warp's arrival
  // after its warpgroup's last Q K^T of an item) lets the producer load the next item's query block.
  static constexpr bool persistent = SLICES_ && CUKV_MLA_PERSISTENT;
  // The ring position of an item's tile `it` (its stage and phase): after the block's earlier items' tiles when
  // persistent, else the tile itself.
  static __device__ __forceinline__ int ring_pos(int ring0, int it) { return persistent ? ring0 + it : it; }
  static constexpr int row_bytes = FP8_ ? 656 : kMlaDim * (int)sizeof(T);  // one cache row in global memory
  static constexpr int fp8_rope_byte = kMlaNope + 16;  // an FP8 row's bf16 rope values, after its codes and 4 scales
  static constexpr int BN = BN_, num_kv_stages = STAGES_;
  static constexpr int k_nope_elements = BN * kMlaNope, k_rope_elements = BN * kMlaRope;
  static constexpr int k_nope_bytes = k_nope_elements * (int)sizeof(T);
  static constexpr int k_rope_bytes = k_rope_elements * (int)sizeof(T);
  static constexpr int k_bytes = k_nope_bytes + k_rope_bytes;
  static constexpr int k_elements = k_nope_elements + k_rope_elements;
  static constexpr int v_elements = k_nope_elements, v_bytes = k_nope_bytes;  // V = K's first 512 columns
  static constexpr int atom_col_bytes = BN * kAtomRowBytes;                    // one 64-value column of atoms
  static constexpr int q_bytes = QROWS_ * kMlaDim * (int)sizeof(T);
  static constexpr int q_atom_col_bytes = QROWS_ * kAtomRowBytes;
  static constexpr int half = BN / 2;                                          // tokens per consumer warpgroup
  static constexpr int p_bytes = 2 * 128 * (half / 4) * 4;                     // each thread's P words, both WGs
  static constexpr int stats_bytes = 2 * 128 * 8;                              // (m or l) x 2 rows per thread
  // q_full, q_empty, then the ring's full and empty barriers
  static constexpr int barrier_bytes = (8 * (2 + kRings * num_kv_stages * kSlices) + 63) / 64 * 64;
  // offsets: the query block, the ring, then the exchange buffers and barriers (swizzled parts 1 KB aligned)
  static constexpr int q_offset = 0;
  static constexpr int ring_offset = q_offset + q_bytes;
  static constexpr int p_offset = ring_offset + num_kv_stages * k_bytes;
  static constexpr int stats_offset = p_offset + p_bytes;
  static constexpr int barrier_offset = stats_offset + stats_bytes;
  static constexpr int valid_offset = barrier_offset + barrier_bytes;         // sparse: 4 words per stage
  static constexpr int valid_bytes = SPARSE_ ? (16 * num_kv_stages + 63) / 64 * 64 : 0;
  static constexpr int smem_bytes = valid_offset + valid_bytes;
  static_assert(QROWS_ % 16 == 0 && QROWS_ <= kMlaBlockM, "query rows: whole 8-row atoms, 4 warps");
  static_assert(sizeof(T) == 2, "16-bit tiles");
  static_assert(!FP8_ || sizeof(T) == 2, "FP8 rows dequantize into 16-bit tiles");
  static_assert(BN == 32 || BN == 64, "a tile is 32 or 64 tokens");
  static_assert(k_bytes % 1024 == 0 && q_bytes % 1024 == 0, "swizzle atoms stay 1 KB aligned");
  static_assert(8 * (2 + kRings * num_kv_stages * kSlices) <= barrier_bytes, "barriers fit");
  static_assert(!SLICES_ || !FP8_, "per-slice barriers: 16-bit tiles (tensor copies, or sparse gathers) only");
  static_assert(!(SPARSE_ && CUKV_MLA_PERSISTENT) || SLICES_, "persistent sparse blocks: per-slice gathers");
  static_assert(smem_bytes <= 227 * 1024, "shared memory");

  u32 base;  // shared address of the dynamic shared memory (1 KB aligned)

  __device__ __forceinline__ u32 q() const { return base + q_offset; }
  __device__ __forceinline__ u32 stage(int s) const { return base + ring_offset + s * k_bytes; }
  __device__ __forceinline__ u32 q_full() const { return base + barrier_offset; }
  __device__ __forceinline__ u32 q_empty() const {
    return base + barrier_offset + 8 + 8 * (2 * num_kv_stages * kSlices);
  }
  __device__ __forceinline__ u32 full(int s) const { return base + barrier_offset + 8 + 8 * s; }
  // gather_pair: this block's half of slice c of stage s has landed (lane 0 of the gathering warp, its lanes' copies
  // tracked by mbar_track_cp_async), for the warp that forwards it to the other block
  __device__ __forceinline__ u32 landed(int s, int c) const {
    return base + barrier_offset + 16 + 8 * (2 * num_kv_stages * kSlices) + 8 * (kSlices * s + c);
  }
  __device__ __forceinline__ u32 empty(int s) const { return base + barrier_offset + 8 + 8 * (num_kv_stages + s); }

  // SLICES_: slice c of stage s. Full: one arrival (with the slice's bytes, or after every producer lane's cp.async
  // copies, each tracked by mbar_track_cp_async; SPARSE_: one from each of the stream's two warps, gather_pair: the
  // gathering warp's, with the other block's half in bytes). Empty: the scoring warpgroup's 4 warps after Q K^T, and
  // for slices 0-7 also the 4 warps of the warpgroup whose output columns they hold, after its P V.
  __device__ __forceinline__ u32 full(int s, int c) const { return base + barrier_offset + 8 + 8 * (kSlices * s + c); }
  __device__ __forceinline__ u32 empty(int s, int c) const {
    return base + barrier_offset + 8 + 8 * (kSlices * (num_kv_stages + s) + c);
  }

  __device__ __forceinline__ void init_barriers() const {
    mbar_init(q_full(), 128);  // every producer thread arrives when its copies land
    if constexpr (persistent) mbar_init(q_empty(), 8);  // lane 0 of each consumer warp, its last Q K^T of the item done
    if constexpr (SLICES_) {
      for (int s = 0; s < num_kv_stages; ++s)
        for (int c = 0; c < kSlices; ++c) {
          // (SPARSE_: gather_slices' two warps of a stream; gather_pair: the gathering warp's arrival with the
          // other block's half in bytes)
          mbar_init(full(s, c), SPARSE_ && !gather_pair ? 2 : 1);
          if constexpr (gather_pair) mbar_init(landed(s, c), 1);
          mbar_init(empty(s, c), kPeers * (c == kSlices - 1 ? kRopeReleases : 8));
        }
    } else {
      init_stage_barriers();
    }
  }

  __device__ __forceinline__ void init_stage_barriers() const {
    for (int s = 0; s < num_kv_stages; ++s) {
      // FP8: each producer thread arrives for its stores and its copies (fp8_pair: for its stores, the other block's
      // half counted in bytes); sparse: for its validity word and copies
      mbar_init(full(s), !fp8_pair && (FP8_ || SPARSE_) ? 256 : 128);
      mbar_init(empty(s), 8 * kPeers);  // lane 0 of each consumer warp (of both blocks: fp8_pair), its wgmmas done
    }
  }

  // Byte offset of 16-byte chunk c (0 .. 71) of row r inside a tile whose atom columns are col_bytes apart.
  static __device__ __forceinline__ u32 chunk_offset(int r, int c, int col_bytes) {
    return (u32)((c >> 3) * col_bytes) + swizzle128(r, c & 7);
  }

  // The query block (q_rows rows): row R = rb * 64 + r is token i = R / H, head h = R % H; rows past `rows` are zeros.
  __device__ void load_q(const MLADecodeParams& a, const MLAWorkItem& w, int warp, int lane) const {
    const T* qn = reinterpret_cast<const T*>(a.q_nope);
    const T* qp = reinterpret_cast<const T*>(a.q_pe);
#pragma unroll 1
    for (int rr = 0; rr < QROWS_ / 4; ++rr) {
      const int r = warp * (QROWS_ / 4) + rr, R = w.row_block * kMlaBlockM + r;
      const bool ok = R < a.rows;
      const int i = ok ? R / a.heads : 0, h = ok ? R - i * a.heads : 0;
      const T* nrow = qn + w.batch * a.q_nope_stride[0] + i * a.q_nope_stride[1] + h * a.q_nope_stride[2];
      const T* prow = qp + w.batch * a.q_pe_stride[0] + i * a.q_pe_stride[1] + h * a.q_pe_stride[2];
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        const int c = lane + 32 * j;
        if (c < 72) {
          const T* src = c < 64 ? nrow + 8 * c : prow + 8 * (c - 64);
          cp_async16(q() + chunk_offset(r, c, q_atom_col_bytes), ok ? (const void*)src : a.q_nope, ok ? 16 : 0);
        }
      }
    }
    mbar_arrive_cp_async(q_full());
  }

  // SparseMLAConfig.next_q: the query block of work item blockIdx.x + %nsmid into L2, the block that starts about
  // when this one ends (on whichever SM frees first; one block an SM): warps 0 and 1 a row a lane, each row's address
  // as load_q forms it.
  __device__ void prefetch_next_q(const MLADecodeParams& a, int warp, int lane) const {
    unsigned sms;
    asm("mov.u32 %0, %%nsmid;" : "=r"(sms));
    const int idx = (int)(blockIdx.x + sms);
    if (warp >= 2 || idx >= *a.num_items) return;
    const MLAWorkItem w = mla_load_item(a, idx);
    const int r = warp * 32 + lane, R = w.row_block * kMlaBlockM + r;
    if (r >= QROWS_ || R >= a.rows) return;
    const int i = R / a.heads, h = R - i * a.heads;
    const T* nrow = reinterpret_cast<const T*>(a.q_nope) + w.batch * a.q_nope_stride[0] + i * a.q_nope_stride[1] +
                    h * a.q_nope_stride[2];
    const T* prow = reinterpret_cast<const T*>(a.q_pe) + w.batch * a.q_pe_stride[0] + i * a.q_pe_stride[1] +
                    h * a.q_pe_stride[2];
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(nrow), "n"(kMlaNope * (int)sizeof(T)) : "memory");
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(prow), "n"(kMlaRope * (int)sizeof(T)) : "memory");
  }

  // Address of token t's row, or null where it must read as zeros.
  static __device__ __forceinline__ const char* row_ptr(const MLADecodeParams& a, const MLAWorkItem& w, int t) {
    if (t >= w.end) return nullptr;
    if constexpr (SPARSE_) {  // w.end already stops at the token's valid prefix (mla_sparse_end)
      const int idx = a.indices[w.batch * a.indices_stride + t];
      if ((unsigned)idx >= (unsigned)a.num_rows) return nullptr;  // negatives and uint32 >= 2^31 included
      const int page = idx / a.page_size, off = idx - page * a.page_size;
      return a.cache + page * a.page_stride + off * a.row_stride;
    }
    const int pi = t / a.page_size, off = t - pi * a.page_size;
    if (pi >= a.table_width) return nullptr;
    const int page = a.block_table[w.batch * a.table_stride + pi];
    if (page < 0 || page >= a.num_pages) return nullptr;
    return a.cache + page * a.page_stride + off * a.row_stride;
  }

  // Lane j < BN/4 of warp w looks up the page of row w * BN/4 + j of tile `it` (null: read as zeros).
  __device__ __forceinline__ const char* lookup(const MLADecodeParams& a, const MLAWorkItem& w, int it, int warp,
                                                int lane) const {
    constexpr int kRowsPerWarp = BN / 4;
    if (lane >= kRowsPerWarp) return nullptr;
    return row_ptr(a, w, w.begin + it * BN + warp * kRowsPerWarp + lane);
  }

  // Sparse: stage s's rows w * BN/4 + j (j < BN/4) are real keys where bit j of word w is set.
  __device__ __forceinline__ u32* valid_words(int s) const {
    extern __shared__ __align__(1024) char smem[];
    return reinterpret_cast<u32*>(smem + valid_offset) + 4 * s;
  }
  // Sparse with SLICES_ (gather_slices): the tile at ring position r has real keys at rows j where bit j % 32 of word
  // j / 32 is set. A slot per ring position modulo 2 STAGES: the next tile of a stage may start loading (its first
  // slice freed by the last one's Q K^T) before the last one's scores are masked.
  __device__ __forceinline__ u32* tile_valid_words(int r) const {
    extern __shared__ __align__(1024) char smem[];
    return reinterpret_cast<u32*>(smem + valid_offset) + 2 * (r % (2 * num_kv_stages));
  }

  // A tile into stage s: warp w copies rows w * BN/4 .. (w + 1) * BN/4 - 1, their addresses broadcast from `mine`.
  __device__ __forceinline__ void load_tile(const MLADecodeParams& a, const char* mine, int s, int warp, int lane) const {
    if constexpr (SPARSE_) mbar_arrive(full(s));  // releases the validity word written before (produce)
    copy_rows(a, mine, s, warp, lane);
    mbar_arrive_cp_async(full(s));
  }

  // load_tile's copies (zero fill where `mine` is null), no arrival
  __device__ __forceinline__ void copy_rows(const MLADecodeParams& a, const char* mine, int s, int warp,
                                            int lane) const {
    constexpr int kRowsPerWarp = BN / 4;
    const u32 dst = stage(s);
#pragma unroll 4
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const char* src = (const char*)__shfl_sync(0xffffffffu, (unsigned long long)mine, rr);
      const int r = warp * kRowsPerWarp + rr;
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        const int c = lane + 32 * j;
        if (c < 72) cp_async16(dst + chunk_offset(r, c, atom_col_bytes), src ? src + 16 * c : a.cache, src ? 16 : 0);
      }
    }
  }

  // The row of `mine` (null: none) into L2, ahead of its load.
  static __device__ __forceinline__ void prefetch_row(const char* mine) {
    if (mine) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(mine), "n"(row_bytes) : "memory");
  }

  // FP8 rows in registers: this lane's 16 codes (16 * lane ..) and their scale for kBatch rows of its warp.
  template <int kBatch>
  struct CodeBatch {
    uint4 codes[kBatch];
    float scale[kBatch];
  };

  // Issue the loads of rows r0 .. r0 + kBatch - 1 of this warp's BN/4 (their addresses in lanes of `mine`); a row
  // read as zeros gets codes 0 and scale 0, which dequantize to +0.
  template <int kBatch>
  static __device__ __forceinline__ void load_codes(CodeBatch<kBatch>& b, const char* mine, int r0, int lane) {
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const char* src = (const char*)__shfl_sync(0xffffffffu, (unsigned long long)mine, r0 + i);
      const bool ok = src != nullptr;
#ifdef CUKV_MLA_FP8_NO_LOAD  // probe only: the producer's cost without the code loads (benchmarks/probe_mla_fp8.py)
      b.codes[i] = make_uint4(0x38383838u, 0x38383838u, 0x38383838u, 0x38383838u);
      b.scale[i] = ok ? 1.f : 0.f;
#else
      b.codes[i] = ok ? ldg_stream16(src + 16 * lane) : make_uint4(0u, 0u, 0u, 0u);
      b.scale[i] = ok ? __ldg(reinterpret_cast<const float*>(src + kMlaNope) + lane / 8) : 0.f;
#endif
    }
  }

  // Lane l < 8: the rope chunk l of FP8 row `src` (from byte fp8_rope_byte; zeros for a null row) into row r of the
  // tile at dst.
  __device__ __forceinline__ void copy_rope_chunk(const MLADecodeParams& a, const char* src, u32 dst, int r,
                                                  int lane) const {
    if (lane < 8)
      cp_async16(dst + chunk_offset(r, 64 + lane, atom_col_bytes), src ? src + fp8_rope_byte + 16 * lane : a.cache,
                 src ? 16 : 0);
  }

  // The rope chunks of this warp's rows of a tile into stage s as they are (lanes 0-7, cp.async). ROPE_FIRST: issued
  // before the rows' code loads, so that their latency overlaps the loads' instead of following it; else each row's
  // behind its codes (store_codes).
  __device__ __forceinline__ void copy_rope(const MLADecodeParams& a, const char* mine, int s, int warp,
                                            int lane) const {
    constexpr int kRowsPerWarp = BN / 4;
    const u32 dst = stage(s);
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const char* src = (const char*)__shfl_sync(0xffffffffu, (unsigned long long)mine, i);
      copy_rope_chunk(a, src, dst, warp * kRowsPerWarp + i, lane);
    }
  }

  // Dequantize a batch into stage s (lane l: 16-byte chunks 2l and 2l + 1 of each row); unless ROPE_FIRST, copy each
  // row's rope chunks too.
  template <int kBatch, bool ROPE_FIRST>
  __device__ __forceinline__ void store_codes(const CodeBatch<kBatch>& b, const MLADecodeParams& a, const char* mine,
                                              int s, int warp, int r0, int lane) const {
    constexpr int kRowsPerWarp = BN / 4;
    const u32 dst = stage(s);
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const char* src = ROPE_FIRST ? nullptr : (const char*)__shfl_sync(0xffffffffu, (unsigned long long)mine, r0 + i);
      const int r = warp * kRowsPerWarp + r0 + i;
      if constexpr (!ROPE_FIRST) copy_rope_chunk(a, src, dst, r, lane);
      st_shared16(dst + chunk_offset(r, 2 * lane, atom_col_bytes),
                  dequant8<T>(make_uint2(b.codes[i].x, b.codes[i].y), b.scale[i]));
      st_shared16(dst + chunk_offset(r, 2 * lane + 1, atom_col_bytes),
                  dequant8<T>(make_uint2(b.codes[i].z, b.codes[i].w), b.scale[i]));
    }
  }

  // Stage s is complete once this thread's stores are visible to wgmma and its rope copies have landed.
  __device__ __forceinline__ void commit_fp8(int s) const {
    fence_proxy_async();  // the generic-proxy stores -> the consumers' wgmma reads
    mbar_arrive(full(s));
    mbar_arrive_cp_async(full(s));
  }

  // fp8_pair: this block's half of an FP8 tile (rows 32 rank .. 32 rank + 31) in registers. Warp w takes rows
  // 32 rank + 8 w + i (i < 8; their addresses in lanes i of `mine`): each lane loads 16 codes of each and the rope
  // chunk l % 8 of rows l / 8 and l / 8 + 4.
  struct PairHalf {
    CodeBatch<8> codes;
    uint4 rope[2];
  };
  // (SPARSE_: the addresses in lanes 16 + i; lanes 0-15 hold the warp's 16 rows of the whole tile, for validity)
  static constexpr int kHalfLane = SPARSE_ ? 16 : 0;
  static __device__ __forceinline__ void load_half(PairHalf& h, const char* mine, int lane) {
    load_codes(h.codes, mine, kHalfLane, lane);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const char* src =
          (const char*)__shfl_sync(0xffffffffu, (unsigned long long)mine, kHalfLane + (lane >> 3) + 4 * k);
      h.rope[k] = src ? ldg_stream16(src + fp8_rope_byte + 16 * (lane & 7)) : make_uint4(0u, 0u, 0u, 0u);
    }
  }

  // fp8_pair: the half dequantized and stored into stage s; once the four warps have, thread 0 copies it (32 rows of
  // each of the 9 atom columns, 4 KB apiece) into the other block's stage by the bulk engine, completing there on
  // its full barrier, which this block's thread 0 arms for the other's half.
  __device__ __forceinline__ void store_half(const PairHalf& h, int s, int warp, int lane, int rank) const {
    constexpr int kHalfBytes = 32 * kAtomRowBytes;
    static_assert(fp8_pair && BN == 64, "a pair's blocks take 32 rows of a 64-token tile each");
    const u32 dst = stage(s);
    const int r0 = 32 * rank + 8 * warp;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      st_shared16(dst + chunk_offset(r0 + i, 2 * lane, atom_col_bytes),
                  dequant8<T>(make_uint2(h.codes.codes[i].x, h.codes.codes[i].y), h.codes.scale[i]));
      st_shared16(dst + chunk_offset(r0 + i, 2 * lane + 1, atom_col_bytes),
                  dequant8<T>(make_uint2(h.codes.codes[i].z, h.codes.codes[i].w), h.codes.scale[i]));
    }
#pragma unroll
    for (int k = 0; k < 2; ++k)
      st_shared16(dst + chunk_offset(r0 + (lane >> 3) + 4 * k, 64 + (lane & 7), atom_col_bytes), h.rope[k]);
    fence_proxy_async();  // the generic-proxy stores -> the consumers' wgmma reads and the bulk copies
    named_barrier_sync<128>(kProducerBarrier);
    if (warp == 0 && lane == 0) {
      mbar_expect_tx(full(s), kMlaDim / 64 * kHalfBytes);  // the other block's half (it may land first)
      const u32 far = cluster_map(dst, rank ^ 1), far_bar = cluster_map(full(s), rank ^ 1);
      const u32 half = (u32)(32 * rank * kAtomRowBytes);
#pragma unroll
      for (int c = 0; c < kMlaDim / 64; ++c)
        bulk_copy_to_peer(far + half + (u32)(c * atom_col_bytes), dst + half + (u32)(c * atom_col_bytes), kHalfBytes,
                          far_bar);
    }
    mbar_arrive(full(s));
  }

  // produce() for fp8_pair: the query block, then this block's half of every tile once its stage is free (loads
  // issued before that wait measured slower), each tile's row lookups one tile ahead and (PREFETCH > 0) its rows
  // into L2 PREFETCH tiles ahead.
  template <int PREFETCH>
  __device__ void produce_fp8_pair(const MLADecodeParams& a, const MLAWorkItem& w, int n_tiles, int warp,
                                   int lane) const {
    static_assert(PREFETCH >= 0 && PREFETCH <= 4, "prefetch distance in tiles");
    const int rank = cluster_rank();
    // lane kHalfLane + i (i < 8) of warp `warp`: the row of this block's half of tile it (null: read as zeros);
    // SPARSE_: lane j < 16 the warp's row j of the whole tile (its validity bit)
    const auto look = [&](int it) -> const char* {
      const int j = lane - kHalfLane;
      if (SPARSE_ && lane < 16) return row_ptr(a, w, w.begin + it * BN + warp * 16 + lane);
      return j >= 0 && j < 8 ? row_ptr(a, w, w.begin + it * BN + 32 * rank + 8 * warp + j) : nullptr;
    };
    const char* next = look(0);
    const char* ahead = nullptr;
    if constexpr (PREFETCH > 0) {
#pragma unroll
      for (int j = 0; j < PREFETCH; ++j) prefetch_row(look(j));
      ahead = look(PREFETCH);
    }
    load_q(a, w, warp, lane);
#pragma unroll 1
    for (int it = 0; it < n_tiles; ++it) {
      const int s = it % num_kv_stages;
      const char* cur = next;
      next = look(it + 1);
      if constexpr (PREFETCH > 0) {
        prefetch_row(ahead);
        ahead = look(it + PREFETCH + 1);
      }
      if (it >= num_kv_stages) mbar_wait(empty(s), ((it / num_kv_stages) - 1) & 1);
      if constexpr (SPARSE_) {  // kv_valid_producer: every row of the tile, published before this thread's arrival
        const u32 bits = __ballot_sync(0xffffffffu, lane < 16 && cur != nullptr);
        if (lane == 0) valid_words(s)[warp] = bits;
      }
      PairHalf h;
      load_half(h, cur, lane);
      store_half(h, s, warp, lane, rank);
    }
    cp_async_wait<0>();  // the query block's copies
  }

  // TMA: lane g < BN / box_rows of warp 0 looks up the page of box g of tile `it` (rows g * box_rows ..): its page
  // id, or -1 (read as zeros: outside the table or the cache), and the box's first token in the page.
  __device__ __forceinline__ int2 lookup_box(const MLADecodeParams& a, const MLAWorkItem& w, int it, int box_rows,
                                             int lane) const {
    if (lane * box_rows >= BN) return make_int2(-1, 0);
    const int t = w.begin + it * BN + lane * box_rows;
    const int pi = t / a.page_size, off = t - pi * a.page_size;
    if (pi >= a.table_width) return make_int2(-1, off);
    const int page = a.block_table[w.batch * a.table_stride + pi];
    return make_int2(page < 0 || page >= a.num_pages ? -1 : page, off);
  }

  // A full tile into stage s by tensor copies: warp 0's lanes issue the BN / box_rows x 9 boxes (box g, 64-column
  // slice c lands in atom column c at row g * box_rows, the ring's swizzled layout); every producer thread arrives.
  __device__ __forceinline__ void load_tile_tma(const MLACacheMap& m, int2 box, int s, int warp, int lane) const {
    if (warp == 0) {
      const int boxes = BN / m.box_rows;
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        const int op = lane + 32 * j, g = op / 9, c = op - 9 * g;
        const int page = __shfl_sync(0xffffffffu, box.x, g % 32), off = __shfl_sync(0xffffffffu, box.y, g % 32);
        if (op < boxes * 9) {
          mbar_expect_tx(full(s), m.box_rows * kAtomRowBytes);
          tma_load_4d(stage(s) + (u32)(c * atom_col_bytes + g * m.box_rows * kAtomRowBytes), &m.map,
                      c * kAtomRowBytes, 0, off, page, full(s));
        }
      }
    }
    mbar_arrive(full(s));
  }

  // An FP8 tile into stage s, kBatch rows per lane loaded, then dequantized and stored.
  template <int kBatch, bool ROPE_FIRST>
  __device__ __forceinline__ void load_tile_fp8(const MLADecodeParams& a, const char* mine, int s, int warp,
                                                int lane) const {
    static_assert((BN / 4) % kBatch == 0, "rows per warp in whole batches");
    if constexpr (ROPE_FIRST) copy_rope(a, mine, s, warp, lane);
#pragma unroll 1
    for (int r0 = 0; r0 < BN / 4; r0 += kBatch) {
      CodeBatch<kBatch> b;
      load_codes(b, mine, r0, lane);
      store_codes<kBatch, ROPE_FIRST>(b, a, mine, s, warp, r0, lane);
    }
    commit_fp8(s);
  }

  // --- per-slice barriers (SLICES_) ---------------------------------------------------------------------------
  // The order in which a tile's slices are loaded and read by Q K^T: the V slices of the warpgroup that scores the tile
  // (`owner`, tile parity; released by that warpgroup's first P V), then the other warpgroup's (released by its
  // second); the rope slice first where Q K^T of the stage's previous tile was its only reader (it was released long
  // ago), last where it held that tile's P (p_in_rope: released with the other warpgroup's V slices).
  static __device__ __forceinline__ constexpr int slice_order(int owner, int j) {
    if (p_in_rope) return j == kSlices - 1 ? kSlices - 1 : (j + 4 * owner) % 8;
    return j == 0 ? kSlices - 1 : (j - 1 + 4 * owner) % 8;
  }

  // Tiles 0 .. tma_tiles - 1 of the item come by tensor copies (wholly inside the chunk, box_rows > 0), the rest by
  // cp.async (the consumers fence the generic-proxy copies of those before their wgmma reads).
  static __device__ __forceinline__ int tma_tiles(const MLAWorkItem& w, int box_rows) {
    return box_rows > 0 ? (w.end - w.begin) / BN : 0;
  }

  // The barrier the producer warps sync on among themselves (1-4 are the consumers')
  static constexpr int kProducerBarrier = 5;

  // A full tile `it` into stage it % STAGES by tensor copies, one slice at a time in slice_order, each once its empty
  // barrier has completed for the stage's previous tile: lane 0 arms the slice's full barrier with its bytes (boxes
  // outside the cache still count) and arrives; lane g < BN / box_rows copies box g (its page and offset from
  // lookup_box) of the slice (multicast: of the slices of this block's `rank`, into both blocks).
  __device__ __forceinline__ void load_tile_tma_slices(const MLACacheMap& m, int2 box, int it, int lane,
                                                      int rank = 0, int ring0 = 0) const {
    const int r = ring_pos(ring0, it), s = r % num_kv_stages, owner = it & 1;  // (the scorer: the item's tile)
#pragma unroll 1
    for (int j = 0; j < kSlices; ++j) {
      const int c = slice_order(owner, j);
      if (r >= num_kv_stages) mbar_wait(empty(s, c), ((r / num_kv_stages) - 1) & 1);
#ifdef CUKV_MLA_NO_LOAD  // probe only: after the first stages, the ring runs on the tiles already in it
      if (r >= num_kv_stages) {
        if (lane == 0) mbar_arrive(full(s, c));
        continue;
      }
#endif
      if (lane == 0) {  // (multicast: the other block's copies may land first; the phase completes with both)
        mbar_expect_tx(full(s, c), BN * kAtomRowBytes);
        mbar_arrive(full(s, c));
      }
      __syncwarp();
      if (lane * m.box_rows < BN) {
        const u32 dst = stage(s) + (u32)(c * atom_col_bytes + lane * m.box_rows * kAtomRowBytes);
        if constexpr (multicast) {
          if ((c & 1) == rank) tma_load_4d_multicast(dst, &m.map, c * kAtomRowBytes, 0, box.y, box.x, full(s, c), 3);
        } else {
          tma_load_4d(dst, &m.map, c * kAtomRowBytes, 0, box.y, box.x, full(s, c));
        }
      }
    }
  }

  // A tile `it` by cp.async (a chunk's last, partial tile; every tile of a page size tensor copies do not suit) keeps
  // whole-tile semantics: every producer lane waits for all 9 slices, copies its rows (copy_rows) and adds a
  // cp.async arrival to every slice's full barrier (cp.async.mbarrier.arrive without .noinc raises the pending count
  // now and counts it down once the lane's copies land); once all lanes have, lane 0 of warp 0 gives the one
  // arrival each barrier expects.
  __device__ __forceinline__ void load_tile_cp_async_slices(const MLADecodeParams& a, const char* mine, int it,
                                                            int warp, int lane, int ring0 = 0) const {
    const int r = ring_pos(ring0, it), s = r % num_kv_stages;
    if (r >= num_kv_stages)
      for (int c = 0; c < kSlices; ++c) mbar_wait(empty(s, c), ((r / num_kv_stages) - 1) & 1);
    copy_rows(a, mine, s, warp, lane);
    for (int c = 0; c < kSlices; ++c)
      mbar_track_cp_async(full(s, c));
    named_barrier_sync<128>(kProducerBarrier);
    if (warp == 0 && lane == 0)
      for (int c = 0; c < kSlices; ++c) mbar_arrive(full(s, c));
  }

  // SPARSE_ with SLICES_: the query block; then the tiles in two streams, producer warps 0 and 2 the even tiles (scored
  // by consumer warpgroup 0) and warps 1 and 3 the odd ones, warp w the tile's rows 32 (w / 2) .. + 31. Lane l looks
  // up row l of its half a tile ahead; a tile's 8 row addresses for each lane (rows 4 i + l / 8) come by shuffles.
  // Each slice is gathered once its empty barrier has completed, in the scorer's slice_order: 8 cp.async of 16 bytes
  // a lane, 8 lanes a row (128 contiguous bytes; zero fill for a skipped key), tracked by each lane's
  // mbar_track_cp_async, then one arrival per warp from its lane 0 (the slice's full barrier expects two).
  // Before its first slice lane 0 publishes its half's validity (a ballot word, tile_valid_words) for the scoring
  // consumers, who read it after waiting on every slice.
  // gather_pair: warp w < 2 gathers this block's half (rows 32 rank ..) of stream w's slices and publishes both
  // halves' validity, arriving on the slice's full barrier with the other block's half in bytes, and on `landed`;
  // warp w + 2 forwards each landed half into the other block's stage (a 4 KB bulk copy: 32 whole swizzled rows).
  // persistent: `ring0` is the ring position of the item's first tile, `item` the block's count of items before it.
  __device__ void gather_slices(const MLADecodeParams& a, const MLAWorkItem& w, int n_tiles, int warp, int lane,
                                int ring0 = 0, int item = 0) const {
    static_assert(SLICES_ && SPARSE_ && BN == 64, "sparse gathers into per-slice stages of 64-token tiles");
    static_assert(!(persistent && gather_pair), "persistent gathers without the cluster pair");
    if constexpr (persistent) {
      if (item > 0) {
        mbar_wait(q_empty(), (item - 1) & 1);  // the last item's query block is read
        // and both streams have issued its tiles (the parity waits below then see the phase they wait for or the one
        // before it, as in produce_slices)
        named_barrier_sync<128>(kProducerBarrier);
      }
    }
    load_q(a, w, warp, lane);
    const int stream = warp & 1, g = lane >> 3, k = lane & 7;
    const int rank = gather_pair ? cluster_rank() : 0;
    const int half = gather_pair ? rank : warp >> 1;
    if (gather_pair && warp >= 2) {
      forward_slices(n_tiles, stream, rank, lane);
      return;
    }
    const int key0 = w.begin + half * 32 + lane;  // this lane's row of the stream's tiles, tile 0
    const char* next = stream < n_tiles ? row_ptr(a, w, key0 + stream * BN) : nullptr;
#pragma unroll 1
    for (int it = stream; it < n_tiles; it += 2) {
      const char* mine = next;
      if (it + 2 < n_tiles) next = row_ptr(a, w, key0 + (it + 2) * BN);
      const u32 bits = __ballot_sync(0xffffffffu, mine != nullptr);
      u32 other_bits = 0u;  // gather_pair: the other block's half
      if constexpr (gather_pair)
        other_bits = __ballot_sync(0xffffffffu, row_ptr(a, w, key0 + it * BN + (1 - 2 * half) * 32) != nullptr);
      const char* rows[8];  // row 4 i + g of this warp's half
#pragma unroll
      for (int i = 0; i < 8; ++i) rows[i] = (const char*)__shfl_sync(0xffffffffu, (unsigned long long)mine, 4 * i + g);
      const int r = ring_pos(ring0, it), s = r % num_kv_stages, owner = it & 1;  // (the scorer: the item's tile)
      // this lane's chunk k of row 32 half + 4 i + g: the rows' swizzle (row % 8 = (4 i + g) % 8) alternates with i
      const u32 line = stage(s) + (u32)((half * 32 + g) * kAtomRowBytes);
      const u32 sw0 = (u32)((k ^ g) << 4), sw1 = (u32)((k ^ (g + 4)) << 4);
#pragma unroll 1
      for (int j = 0; j < kSlices; ++j) {
        const int c = slice_order(owner, j);
        if (r >= num_kv_stages) mbar_wait(empty(s, c), ((r / num_kv_stages) - 1) & 1);
        if (j == 0 && lane == 0) {
          tile_valid_words(r)[half] = bits;
          if constexpr (gather_pair) tile_valid_words(r)[1 - half] = other_bits;
        }
        const u32 dst = line + (u32)(c * atom_col_bytes);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const char* src = rows[i];
          cp_async16(dst + (u32)(4 * i * kAtomRowBytes) + (i & 1 ? sw1 : sw0), src ? src + 128 * c + 16 * k : a.cache,
                     src ? 16 : 0);
        }
        mbar_track_cp_async(full(s, c));
        if constexpr (gather_pair)
          mbar_track_cp_async(landed(s, c));
        __syncwarp();
        if (lane == 0) {
          if constexpr (gather_pair) {
            mbar_expect_tx(full(s, c), 32 * kAtomRowBytes);  // the other block's half, by its bulk copy
            mbar_arrive(landed(s, c));
          }
          mbar_arrive(full(s, c));
        }
      }
    }
    if constexpr (CUKV_MLA_NEXT_Q && !persistent) prefetch_next_q(a, warp, lane);  // (this item's tiles all issued)
    cp_async_wait<0>();
  }

  // persistent: gather_slices for this block's work items blockIdx.x, blockIdx.x + gridDim.x, ... (each cut at its
  // token's valid prefix), the ring running on across them. The consumers' mla_for_block_items walk, written out:
  // through its lambda the producer spills 20 bytes in its 56 registers, as a member loop 8.
  __device__ void gather_items(const MLADecodeParams& a, int warp, int lane) const {
    static_assert(persistent, "persistent blocks");
    int ring0 = 0;
#pragma unroll 1
    for (int j = 0; blockIdx.x + j * gridDim.x < (unsigned)*a.num_items; ++j) {
      MLAWorkItem w = mla_load_item(a, blockIdx.x + j * gridDim.x);
      w.end = mla_sparse_end(a, w);
      const int n_tiles = (w.end - w.begin + BN - 1) / BN;
      gather_slices(a, w, n_tiles, warp, lane, ring0, j);
      ring0 += n_tiles;
    }
  }

  // gather_pair: warp 2 + stream forwards this block's half of each of the stream's slices, once landed, into the
  // other block's stage (its full barrier counts the bytes). A stage's half is rewritten only after both blocks'
  // consumers have released the slice (kPeers), which follows the copy's completion there.
  __device__ void forward_slices(int n_tiles, int stream, int rank, int lane) const {
    const int peer = rank ^ 1;
#pragma unroll 1
    for (int it = stream; it < n_tiles; it += 2) {
      const int s = it % num_kv_stages, owner = it & 1;
      const u32 half_rows = stage(s) + (u32)(rank * 32 * kAtomRowBytes);
#pragma unroll 1
      for (int j = 0; j < kSlices; ++j) {
        const int c = slice_order(owner, j);
        mbar_wait(landed(s, c), (it / num_kv_stages) & 1);
        fence_proxy_async();  // the gathered half (generic proxy) -> the bulk copy's read
        if (lane == 0) {
          const u32 src = half_rows + (u32)(c * atom_col_bytes);
          bulk_copy_to_peer(cluster_map(src, peer), src, 32 * kAtomRowBytes, cluster_map(full(s, c), peer));
          tma_store_commit();
        }
      }
    }
    if (lane == 0) tma_store_wait_read<0>();  // the last copies have read this block's stages
  }

  // produce() for per-slice barriers (TMA kernels): the query block; then the full tiles in two streams, producer warp
  // 0 the even tiles (scored by consumer warpgroup 0) and warp 1 the odd ones, so neither scorer's next tile waits
  // behind the other's slices; each stream looks up its next tile's pages one tile ahead and prefetches that tile
  // into L2 once the current one is issued. Then the tiles left (the partial last one, or all where m.box_rows is 0)
  // by all four warps with cp.async.
  // persistent: `ring0` is the ring position of the item's first tile, `item` the block's count of items before it.
  __device__ void produce_slices(const MLADecodeParams& a, const MLAWorkItem& w, int n_tiles, int warp, int lane,
                                 const MLACacheMap& m, int ring0 = 0, int item = 0) const {
    static_assert(SLICES_, "per-slice barriers");
    const int box_rows = m.box_rows;
    const int full_tiles = tma_tiles(w, box_rows);
    const int rank = multicast ? cluster_rank() : 0;
    if constexpr (persistent) {
      if (item > 0) {
        mbar_wait(q_empty(), (item - 1) & 1);  // the last item's query block is read
        // and both streams have issued its tiles, so each stage's phase before the one a parity wait below waits for
        // has completed (as for the cp.async tiles further down)
        named_barrier_sync<128>(kProducerBarrier);
      }
    }
    load_q(a, w, warp, lane);
    if (warp < 2) {
      int2 next_box = warp < full_tiles ? lookup_box(a, w, warp, box_rows, lane) : make_int2(-1, 0);
#pragma unroll 1
      for (int it = warp; it < full_tiles; it += 2) {
        const int2 box = next_box;
        if (it + 2 < full_tiles) next_box = lookup_box(a, w, it + 2, box_rows, lane);
        load_tile_tma_slices(m, box, it, lane, rank, ring0);
#ifndef CUKV_MLA_NO_TMA_PREFETCH  // (the define: probes time the ring without it)
        // The stream's next tile into L2 as soon as this one is issued: its copies, issued once the slices free
        // (late in a pair), then wait on L2 rather than DRAM.
        if (it + 2 < full_tiles && lane * box_rows < BN)
          for (int c = 0; c < kSlices; ++c)
            if (!multicast || (c & 1) == rank) tma_prefetch_4d(&m.map, c * kAtomRowBytes, 0, next_box.y, next_box.x);
#endif
      }
    }
    if (full_tiles >= n_tiles) {
      cp_async_wait<0>();  // the query block's copies
      return;
    }
    const char* next = lookup(a, w, full_tiles, warp, lane);
    // A parity wait only tells the last two phases apart: warps 2-3 (and the stream of the other parity) skipped the
    // tensor-copied tiles' empty waits, so they wait here until both streams have issued theirs; the stage's phase
    // before the one load_tile_cp_async_slices waits for has then completed.
    if (full_tiles > 0) named_barrier_sync<128>(kProducerBarrier);
#pragma unroll 1
    for (int it = full_tiles; it < n_tiles; ++it) {
      const char* cur = next;
      if (it + 1 < n_tiles) next = lookup(a, w, it + 1, warp, lane);
      load_tile_cp_async_slices(a, cur, it, warp, lane, ring0);
    }
    cp_async_wait<0>();
  }

  // The query block, then the tiles through the ring. Each tile's page lookups (a dependent load of the block
  // table) are issued one tile ahead, so their latency hides behind the wait for a free stage. kTma: full tiles by
  // tensor copies where the page size allows (m->box_rows > 0), the rest by cp.async. PREFETCH > 0 (cp.async and
  // FP8 loads only): tile it + PREFETCH goes into L2 before tile it is loaded (its lookups made one tile earlier
  // still); FP8_ROWS: the FP8 rows each lane holds in flight; ROPE_FIRST: load_tile_fp8's rope order.
  template <bool kTma = false, int PREFETCH = 0, int FP8_ROWS = 8, bool ROPE_FIRST = false>
  __device__ void produce(const MLADecodeParams& a, const MLAWorkItem& w, int n_tiles, int warp, int lane,
                          const MLACacheMap* m = nullptr) const {
    static_assert(PREFETCH >= 0 && PREFETCH <= 4, "prefetch distance in tiles");
    static_assert(!(kTma && PREFETCH > 0), "tensor copies take no L2 prefetch");
    const int box_rows = kTma ? m->box_rows : 0;
    const int full_tiles = box_rows > 0 ? (w.end - w.begin) / BN : 0;  // tiles wholly inside the chunk
    const char* next = full_tiles == 0 && n_tiles > 0 ? lookup(a, w, 0, warp, lane) : nullptr;
    int2 next_box = full_tiles > 0 ? lookup_box(a, w, 0, box_rows, lane) : make_int2(-1, 0);
    const char* ahead = nullptr;  // the row of tile it + PREFETCH (lookup() is null past the item's end)
    if constexpr (PREFETCH > 0) {
      prefetch_row(next);
#pragma unroll
      for (int j = 1; j < PREFETCH; ++j) prefetch_row(lookup(a, w, j, warp, lane));
      ahead = lookup(a, w, PREFETCH, warp, lane);
    }
    load_q(a, w, warp, lane);
#pragma unroll 1
    for (int it = 0; it < n_tiles; ++it) {
      const int s = it % num_kv_stages;
      const char* cur = next;
      const int2 box = next_box;
      if (it + 1 < full_tiles)
        next_box = lookup_box(a, w, it + 1, box_rows, lane);
      else if (it + 1 < n_tiles)
        next = lookup(a, w, it + 1, warp, lane);
      if constexpr (PREFETCH > 0) {
        prefetch_row(ahead);
        ahead = lookup(a, w, it + PREFETCH + 1, warp, lane);
      }
      if (it >= num_kv_stages) mbar_wait(empty(s), ((it / num_kv_stages) - 1) & 1);
      if constexpr (SPARSE_) {  // kv_valid_producer: published before this thread's arrivals on full(s)
        const u32 bits = __ballot_sync(0xffffffffu, cur != nullptr);
        if (lane == 0) valid_words(s)[warp] = bits;
        __syncwarp();
      }
      if constexpr (FP8_) {
        load_tile_fp8<FP8_ROWS, ROPE_FIRST>(a, cur, s, warp, lane);
      } else {
        if (kTma && it < full_tiles)
          load_tile_tma(*m, box, s, warp, lane);
        else
          load_tile(a, cur, s, warp, lane);
      }
    }
    cp_async_wait<0>();
  }
};

}  // namespace cukv
