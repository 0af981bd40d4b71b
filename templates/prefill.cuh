// Ragged prefill over a paged (or contiguous) KV cache on Hopper: warp-specialized, wgmma.
//
// A block owns BM query rows of one (sequence, query head) and walks its visible KV tiles from the last
// (the masked diagonal) to the first. One producer warp gathers K and V rows through the page table with
// cp.async into the KVBuffer ring; BM / 64 consumer warpgroups each compute S = Q K^T for 64 rows with
// wgmma (Q and K from shared memory), run the online softmax in registers, and accumulate O += P V with P
// straight from registers. Ring elements are handed over by mbarriers: `full` counts the producer lanes'
// cp.async completions, `empty` the consumer warps that finished reading.
#pragma once
#include "kv_buffer.cuh"
#include "trace.cuh"  // trace_mark(it, event): benchmarks/trace_prefill.py; compiles to nothing as shipped

// timing aid, off (0): 1 sums the consumer warpgroups' waits into cukv_wait_stats (ns; benchmarks/probe_waits.py):
// [0] K tiles, [1] V tiles, [2] the ring order's named barrier, [3] consume() in all, [4] tiles, [5] items; convert
// once: [6] K waits and [7] tiles of the items begun in the first 400 us (from the earliest block start, the word
// ONCE_STATS keeps)
#ifndef CUKV_WAIT_STATS
#define CUKV_WAIT_STATS 0
#endif
#if CUKV_WAIT_STATS
extern "C" {
__device__ unsigned long long cukv_wait_stats[8];  // a definition: the block form of extern "C"
}
#endif

namespace cukv {

struct alignas(8) PrefillArgs {
  KVCacheParams kv;     // paged cache, or contiguous K/V (block_table = kv_offsets[B + 1], PAGE_SIZE 0)
  const void* q;        // [tokens, Hq, D]
  void* out;            // [tokens, Hq, D]
  float* lse;           // [tokens, Hq] natural log, or nullptr
  const float* sink;    // [Hq] or nullptr
  const int* q_offsets; // [B + 1]
  const int* work;      // [num_work, 2]: (sequence, q tile), heaviest first
  i64 q_stride[2];      // elements: token, head
  i64 o_stride[2];
  float sm_scale;
  float softcap;        // 0: off
  int window;           // 0: off; keys in (p - window, p]
  int chunk;            // 0: off; keys in the query's chunk of `chunk` positions
  int num_qo_heads;
  int group;
  int causal;
  int pad_;
};

// QUANTIZED: an FP8 e4m3 cache (scales per SCALE_BLOCK dims, 0 = per tensor). The producer dequantizes V
// to T on the way into shared memory (per tensor: V's codes as exact f16, P V in f16, the V scale applied to
// the output). K either takes the same path, or, with FP8_SCORES (bf16 queries,
// scales per token or per tensor, heads up to 256), goes into the ring as the cache's codes and S = Q K^T
// runs on the e4m3 tensor cores: each consumer warpgroup splits its query rows once into two e4m3 terms,
// q * 2^k = hi + lo (2^k per row), so S = (hi K + lo K) * k_scale / 2^k keeps about bf16's precision at the
// bf16 rate (an e4m3 wgmma is twice as fast) and the producer converts only V.
// TMA_ROWS > 0: K/V come by tensor copies (TMA) instead of per-lane cp.async, one box of TMA_ROWS rows (within a
// page; contiguous K/V is one page) per leading lane; maps->k and maps->v describe the cache as 4-d tensors
// [pages][token][head][dim]. 16-bit caches: bytes, boxes of one 128-byte atom straight into the ring (128-byte
// swizzle); the tile holding a sequence's end keeps cp.async. FP8: codes into raw slots (K into the ring when
// FP8_SCORES), and the scales keep their per-lane copies (token K scales: a register per lane, see kKsMma).
// PV_WAIT: each tile's P V completes before the next tile's S is issued (cuDNN's order), so S and P are never live
// together (a 128-key tile at d256 fits the consumers' registers) and the V element is released a tile earlier, which
// a ring of one tile needs; elsewhere P V(t) overlapping S(t + 1) measured 2-4% faster (benchmarks/NOTES.md
// session 43).
// PINGPONG: the consumer warpgroups issue their S wgmmas in a fixed ring order (named barriers 4 + wg), so the
// tensor cores finish one warpgroup's scores before the next one's and the softmax phases drift apart instead of
// running in lock-step (FP8 at d128/d256: 2-4% faster on H100, benchmarks/NOTES.md session 17).
struct alignas(64) PrefillMaps {
  CUtensorMap k, v;
};

// ONCE_PAGE > 0 (convert once): the block reads 16-bit K/V from a workspace (a.kv: contiguous rows, each sequence's
// first row a multiple of BN, maps->k / maps->v its tensor maps), which the blocks fill themselves from an FP8
// cache of ONCE_PAGE tokens per page (fp8). Each (workspace tile, KV head, quarter of BN / 4 rows) has a flag: 0 free,
// 1 claimed, 2 ready (zeroed before the launch). The producer warpgroup splits: warp 0 feeds the ring by TMA from the
// workspace once a tile's four flags read ready, and warps 1-3 claim free quarters, convert them from the FP8 cache
// (rows past the sequence as zeros) into the workspace and release them (produce_once). Each quarter is converted
// once per call instead of once per visiting query tile (benchmarks/NOTES.md sessions 25-27).
// timing aid: 1 counts visits in the 32 ints before the flags (benchmarks/probe_prefill_once.py --stats): [1] quarters
// converted, [2] warp 0's flag reads that found their tiles ready, [3] those that had to wait, [4] its polls, [5] its
// wait time in 64 ns units, [6] the converters' time in 64 ns units, [7] / [8] the blocks' first items' waits, summed
// / longest, in 64 ns units, [16] the first consumer warpgroup's query waits at item boundaries (64 ns units)
// ([10..15]: see run(); [30] and [31] are PERSISTENT's counters, [29] the 16-bit one's finished blocks)
#ifndef CUKV_ONCE_STATS
#define CUKV_ONCE_STATS 0
#endif
// Online softmax: a warp keeps its rows' running max, and skips the output rescale, until some row's tile max
// exceeds it by more than this many powers of two in the exponent (P then stays below 2^CUKV_RESCALE_LOG2, exact in
// the float32 accumulators; the final normalization and the LSE use the same max). Most tiles of a long row skip
// the per-tile O multiply (head-dim/2 FMULs per thread), as FlashAttention 4 does. Only where a thread's O holds 128
// or more values (kLazyRescale): at d256 it made bf16 and FP8 prefill 2-4% faster, at d64 the vote cost 1-2%; a vote
// that rescaled whenever any max moved was slower everywhere (benchmarks/NOTES.md session 41). 0: rescale every tile.
#ifndef CUKV_RESCALE_LOG2
#define CUKV_RESCALE_LOG2 8
#endif
// A/B switch (session 38): 0 stores per-tensor convert-once workspaces as code x scale (the layout before)
#ifndef CUKV_ONCE_TENSOR_CODES
#define CUKV_ONCE_TENSOR_CODES 1
#endif

struct alignas(8) OnceArgs {
  KVCacheParams fp8;    // the FP8 cache and its page table (lengths: the keys per sequence)
  int* flags;           // [workspace tiles, kv heads, 4], after 32 ints: statistics, [29..31] PERSISTENT's counters
  const int* tile_seq;  // [workspace tiles]: the sequence whose rows a tile holds (PERSISTENT's converters)
  i64 num_kv_heads;
  int num_work;         // work items per head (PERSISTENT)
  int ws_tiles;         // workspace tiles
};

template <typename T, int DEPTH, int BM, int BN, int BK, int STAGES, int PAGE_SIZE, bool QUANTIZED = false,
          int SCALE_BLOCK = 0, bool FP8_SCORES = false, int TMA_ROWS = 0, bool PINGPONG = false, int ONCE_PAGE = 0,
          bool PERSISTENT = false, bool PV_WAIT = false>
struct PrefillKernel {
  typedef KVBuffer<T, BN, BK, DEPTH, STAGES> Buf;
  typedef typename Select<QUANTIZED, unsigned char, T>::type KVT;
  typedef KVCacheOperand<KVT, PAGE_SIZE, QUANTIZED> Cache;
  static_assert(!QUANTIZED || PAGE_SIZE > 0, "FP8 prefill reads a paged cache");
  static_assert(!QUANTIZED || SCALE_BLOCK == 0 || DEPTH % SCALE_BLOCK == 0, "scale block divides the head");
  static_assert(!FP8_SCORES || (QUANTIZED && sizeof(T) == 2 &&
                                (SCALE_BLOCK == 0 || SCALE_BLOCK == DEPTH) && Buf::full_kv && DEPTH <= 256),
                "FP8 scores: one scale per K row (token or tensor) and the whole head in one element");
  static constexpr bool kTma = TMA_ROWS > 0;
  static_assert(!kTma || (TMA_ROWS % 8 == 0 && PAGE_SIZE % TMA_ROWS == 0 &&
                          ((BN / 4) % TMA_ROWS == 0 || ONCE_PAGE > 0) && (!QUANTIZED || PAGE_SIZE > 0)),
                "TMA boxes: whole 8-row swizzle groups within a page (if paged) and within a producer warp's rows (convert "
                "once: the tile's rows)");
  static constexpr int kConsumerWGs = BM / 64;
  static constexpr bool kOnce = ONCE_PAGE > 0;
  static_assert(!kOnce || (!QUANTIZED && PAGE_SIZE == 0 && kTma && TMA_ROWS == BN && Buf::full_kv &&
                           (SCALE_BLOCK == 0 || DEPTH % SCALE_BLOCK == 0)),
                "convert once: a contiguous 16-bit workspace by TMA, one box per tile and atom, the whole head in one "
                "element");
  typedef KVCacheOperand<unsigned char, (ONCE_PAGE > 0 ? ONCE_PAGE : 1), true> Fp8Cache;
  static_assert(!PERSISTENT || kOnce || (!QUANTIZED && kTma && Buf::full_kv && kConsumerWGs > 1),
                "the persistent grid: convert-once's, or a 16-bit cache's by tensor copies, the whole head in one "
                "element, beside a producer warpgroup");
  static_assert(!PINGPONG || kConsumerWGs > 1, "PINGPONG orders two or three consumer warpgroups");
  static constexpr int kThreads = (kConsumerWGs + 1) * 128;  // warpgroup 0 produces
  // Register split between the producer warpgroup and the consumers (setmaxnreg needs whole warpgroups
  // and multiples of 8). The 16-bit producer takes 56 and the consumers share the rest (224 each beside two
  // consumer warpgroups, 152 beside three); a producer that takes more is paid for by the consumers equally. An
  // FP8 producer holds an element's raw chunks between its shared loads and their conversion: 80 beside three
  // consumer warpgroups, 72 beside two, 88 when it also forms the K code copies' addresses (FP8 scores) or
  // issues tensor copies there. Beside three, a TMA producer (no copy addresses) fits in 56 like the 16-bit one,
  // so the consumers keep their 152 (at 144 the token K-scale multiply spilled). A TMA producer with e4m3 scores
  // fits in 72 up to d128 (d256 spilled): its consumers' 8 more registers measured 1-2% faster (session 20).
  // The convert-once producer's converters hold two 8-code pieces and their scales: 72 beside two (80 beside three,
  // so that the consumers' share stays a multiple of 8); 72 and 88 cost the 16-bit consumers nothing (session 24).
  static constexpr int kProducerRegs = kConsumerWGs == 1                          ? 0
                                       : kOnce                                    ? (kConsumerWGs == 3 ? 80 : 72)
                                       : !QUANTIZED || (kTma && kConsumerWGs == 3) ? 56
                                       : kConsumerWGs == 3                        ? 80
                                       : FP8_SCORES && kTma && DEPTH <= 128       ? 72
                                       : FP8_SCORES || kTma                       ? 88
                                                                                  : 72;
  static constexpr int kConsumerRegs =
      kConsumerWGs == 1 ? 255 : (kConsumerWGs == 2 ? 224 : 152) - (kProducerRegs - 56) / kConsumerWGs;
  // setmaxnreg.inc waits for registers the block's other warps released: the split must fit in what the launch
  // gave every thread (the register file over kThreads, in multiples of 8), or the consumers wait forever.
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8 > 255 ? 255 : (65536 / kThreads) / 8 * 8;
  static_assert(kConsumerWGs == 1 || (kProducerRegs + kConsumerWGs * kConsumerRegs) <= (kConsumerWGs + 1) * kLaunchRegs,
                "registers: the setmaxnreg split exceeds the launch allocation");
  static constexpr int kQAtoms = (DEPTH + 63) / 64;
  static constexpr int kVCols = DEPTH < BK ? DEPTH : BK;       // V width one block accumulates (one element)
  static constexpr int kVSlices = (DEPTH + kVCols - 1) / kVCols; // blocks per (tile, head) along V's dims
  static constexpr int kKElems = Buf::num_k_tiles;
  static constexpr int kSRegs = BN / 2, kORegs = kVCols / 2;
  static constexpr bool kLazyRescale = CUKV_RESCALE_LOG2 > 0 && kORegs >= 128;  // see CUKV_RESCALE_LOG2
  // V with a per-tensor scale is staged as the codes' exact f16 values and P V runs in f16 (P in [0, 1] keeps
  // 11 bits there); the scale multiplies the output once. One cvt per code pair instead of six instructions.
  static constexpr bool kVCodes = QUANTIZED && SCALE_BLOCK == 0;
  // Convert-once with per-tensor scales: the workspace holds the codes' exact values and the two scales join the
  // consumers' score factor and output normalization, as kVCodes does for V. The matrix units then multiply 3-bit
  // mantissas instead of full ones, which draws less power where the prefill runs at the H100's power limit: 0-4%
  // faster (benchmarks/NOTES.md session 38), and the scale is applied in float32 instead of rounded into bf16.
  static constexpr bool kOnceCodes = kOnce && SCALE_BLOCK == 0 && CUKV_ONCE_TENSOR_CODES;
  // The producer converts in Buf::conv_chunk's row pairs (no bank conflict on its ring stores) where the raw slot
  // comes by TMA and only V is converted: elsewhere a lane converts the chunks it copied, and the producers that
  // also convert K spilled with the pairs' addressing (ptxas, 4-12 bytes).
  static constexpr bool kConvPairs = kTma && FP8_SCORES;
  typedef typename Select<kVCodes, __half, T>::type PT;  // P and the staged V
  // FP8 scores: the query as two e4m3 terms, each BM rows x kQ8Atoms atoms of 128 codes (lo kQ8Half after hi)
  static constexpr int kQ8Atoms = (DEPTH + 127) / 128;
  static constexpr int kQ8Steps = (DEPTH + 31) / 32;  // k32 steps of the e4m3 wgmma
  static constexpr int kQ8Half = BM * kQ8Atoms * kAtomRowBytes;
  static constexpr int kQBytes = FP8_SCORES ? 2 * kQ8Half : BM * kQAtoms * kAtomRowBytes;
  // FP8 scores with token scales: the K rows' scales beside each ring element. kKsMma (TMA producer, BN a multiple of
  // 32, heads up to 128: d256's tile has no room for the extra 2 KB): they reach the consumers' score columns through
  // the tensor cores. Per ring element the producer writes B, BN/2 rows of 16 bytes: row j holds the scales of keys j
  // and j + BN/2 as three bf16 terms each (hi + mid + lo == the float32 scale exactly). A fixed A (64 rows of 16
  // bytes, 0.5 in row group 0's first three columns and row group 1's next three, alternating every 8 rows) makes one
  // m64n(BN/2)k16 wgmma give every thread the scales of its BN/4 score columns in accumulator order (rows g and g + 8
  // carry the two halves of the keys; both descriptors read their one 16-byte column twice, LBO = 0, hence the 0.5).
  // It replaces BN/8 LDS.64 per thread and tile, whose shared-memory wavefronts queued behind the wgmma operand reads
  // (benchmarks/NOTES.md sessions 20, 22). Otherwise the consumers load the scales from a float per row.
  static constexpr bool kKsMma = FP8_SCORES && SCALE_BLOCK > 0 && kTma && BN % 32 == 0 && DEPTH <= 128;
  static constexpr int kKsOnesBytes = 64 * 16, kKsRowBytes = 16;
  static constexpr int kKScaleBytes =
      kKsMma ? kKsOnesBytes + STAGES * (BN / 2) * kKsRowBytes : (FP8_SCORES && SCALE_BLOCK > 0 ? STAGES * BN * 4 : 0);
  static constexpr int kRingBytes = STAGES * Buf::stage_bytes;
  static constexpr int kRowOffBytes = 0;
  // FP8: raw codes and scales of a whole tile (K elements and the V element) land by cp.async in one of two
  // raw slots, a tile ahead of the conversion into the ring (kRawElemBytes per element).
  static constexpr int kRawElemBytes = Buf::template raw_elem_bytes<SCALE_BLOCK>();
  static constexpr int kRawTileBytes = QUANTIZED ? ((FP8_SCORES ? 0 : kKElems) + 1) * kRawElemBytes : 0;
  // kOnce: a raw quarter per converter warp (its rows of K, then of V: codes, then scales). Warp 0 converts
  // nothing; the launch-per-item kernel keeps its quarter for the tiles-issued word, the persistent one drops it,
  // which is what lets 32- and 64-dim scale blocks fit at d256.
  static constexpr int kOnceCodeBytes = Buf::kWarpRows * BK;
  static constexpr int kOnceElemBytes = kRawElemBytes / Buf::kProducerWarps;
  static constexpr int kOnceQuarterBytes = 2 * kOnceElemBytes;
  static constexpr int kOnceFirstQuarter = PERSISTENT ? 1 : 0;
  static constexpr int kRawBytes =
      kOnce ? (Buf::kProducerWarps - kOnceFirstQuarter) * kOnceQuarterBytes : 2 * kRawTileBytes;
  static_assert(!kOnce || kOnceElemBytes * Buf::kProducerWarps == kRawElemBytes, "a quarter's rows, K or V");
  // FP8 TMA: one per raw slot; PERSISTENT: q_empty and the staged item (kItemInts), and for a 16-bit cache the next
  // item's index in two slots (kNextInts: the producer warps read it after a named barrier, see feed_persistent_16)
  static constexpr int kItemInts = 10, kNextInts = PERSISTENT && !kOnce ? 2 : 0;
  static constexpr int kBarBytes =
      (2 * STAGES + 1 + (kTma && QUANTIZED ? 2 : 0) + (PERSISTENT ? 1 + ((kItemInts + kNextInts) * 4 + 7) / 8 : 0)) * 8;
  static constexpr int kSmemBytes =
      1024 /* alignment slack */ + kQBytes + kRingBytes + kRowOffBytes + kRawBytes + kKScaleBytes + kBarBytes;
  static_assert(BM % 64 == 0 && BM <= 192, "BM: one to three consumer warpgroups");
  static_assert(DEPTH % 16 == 0, "head dims are multiples of 16");
  static_assert(Buf::full_kv ? BK == kQAtoms * 64 : DEPTH % BK == 0, "BK covers the head, or divides it");
  static_assert(kVCols % 16 == 0 && kVCols <= 256, "one wgmma spans V's columns");
  static_assert(STAGES >= kKElems + 1, "the ring holds a tile's K elements and the previous V element");

  struct Smem {
    u32 q, ring, raw, kscale;
    u32 full, empty, q_full, raw_full;  // barrier addresses
    u32 q_empty, item, next;            // PERSISTENT
  };

  static __device__ __forceinline__ Smem carve(unsigned char* raw) {
    Smem s;
    u32 base = (smem_addr(raw) + 1023u) & ~1023u;
    s.q = base;
    s.ring = base + kQBytes;
    s.raw = base + kQBytes + kRingBytes + kRowOffBytes;
    s.kscale = s.raw + kRawBytes;
    s.full = s.kscale + kKScaleBytes;
    s.empty = s.full + 8 * STAGES;
    s.q_full = s.empty + 8 * STAGES;
    s.raw_full = s.q_full + 8;
    s.q_empty = s.q_full + 8;  // PERSISTENT (never QUANTIZED: no raw_full)
    s.item = s.q_full + 16;
    s.next = s.item + 4 * kItemInts;
    return s;
  }

  // Visible key range [lo, hi) of query positions [p_lo, p_hi] (inclusive), and per-position limits.
  static __device__ __forceinline__ int key_hi(const PrefillArgs& a, int p, int kv_len) {
    int hi = kv_len;
    if (a.causal) hi = min(hi, p + 1);
    if (a.chunk > 0) hi = min(hi, (p / a.chunk + 1) * a.chunk);
    return hi;
  }
  static __device__ __forceinline__ int key_lo(const PrefillArgs& a, int p) {
    int lo = 0;
    if (a.window > 0) lo = max(lo, p - a.window + 1);
    if (a.chunk > 0) lo = max(lo, (p / a.chunk) * a.chunk);
    return lo;
  }

  // One work item: BM query rows of one (sequence, query head) and the key tiles they see.
  struct Item {
    int b, head, kv_head, q_begin, q0, rows, kv_len, shift, n_first, n_tiles;  // b < 0: no more items
  };
  static_assert(sizeof(Item) == kItemInts * 4, "Item is staged in shared memory as kItemInts ints");
  static __device__ __forceinline__ void store_item(u32 addr, const Item& t) {
    const int* w = reinterpret_cast<const int*>(&t);
#pragma unroll
    for (int i = 0; i < kItemInts; ++i) asm volatile("st.shared.u32 [%0], %1;" :: "r"(addr + 4 * i), "r"(w[i]) : "memory");
  }
  static __device__ __forceinline__ Item load_item(u32 addr) {
    Item t;
    int* w = reinterpret_cast<int*>(&t);
#pragma unroll
    for (int i = 0; i < kItemInts; ++i) asm volatile("ld.shared.u32 %0, [%1];" : "=r"(w[i]) : "r"(addr + 4 * i) : "memory");
    return t;
  }
  // work item w of the heaviest-first list for query head `head`
  static __device__ __forceinline__ Item make_item(const PrefillArgs& a, const OnceArgs* once, const Cache& cache, int w,
                                                   int head) {
    Item t;
    t.head = head;
    t.kv_head = head / a.group;
    t.b = a.work[2 * w];
    const int qtile = a.work[2 * w + 1];
    t.q_begin = a.q_offsets[t.b];
    const int q_len = a.q_offsets[t.b + 1] - t.q_begin;
    // convert once: the FP8 table's keys, within the rows the workspace holds for the sequence
    t.kv_len = kOnce ? min(Fp8Cache(once->fp8).cache_length(t.b), cache.cache_length(t.b)) : cache.cache_length(t.b);
    t.q0 = qtile * BM;
    t.rows = min(BM, q_len - t.q0);
    t.shift = t.kv_len - q_len;  // query i sits at position shift + i
    // the item's key range: union over its rows (positions shift+q0 .. shift+q0+rows-1)
    const int p_first = t.shift + t.q0, p_last = t.shift + t.q0 + t.rows - 1;
    const int lo = max(0, key_lo(a, p_first));
    const int hi = min(t.kv_len, key_hi(a, p_last, t.kv_len));
    t.n_first = lo / BN;
    t.n_tiles = hi > lo ? (hi - 1) / BN - t.n_first + 1 : 0;
    return t;
  }
  // PERSISTENT: item index i runs along the launch grid's x (work items) first, then y (heads)
  static __device__ __forceinline__ Item make_item(const PrefillArgs& a, const OnceArgs* once, const Cache& cache,
                                                   int i) {
    return make_item(a, once, cache, i % once->num_work, i / once->num_work);
  }

  static __device__ void run(const PrefillArgs& a, const PrefillMaps* maps, const OnceArgs* once = nullptr,
                             const CUtensorMap* qmap = nullptr) {
    extern __shared__ unsigned char smem_raw[];
    const Smem sm = carve(smem_raw);
    const Cache cache(a.kv);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

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
        int count = 0;
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
            return;
          }
          consume(a, sm, buf, cache, t.head, t.q_begin, t.q0, t.rows, t.kv_len, t.shift, t.n_first, t.n_tiles, 0,
                  warp - 4, lane, count, i & 1, once);
        }
      }
      return;
    }
    // work items along x (launched first), heads along y: the blocks in flight are the query tiles of one or two
    // heads, which read the same K/V rows while they are in L2 (heads along x had each KV head's rows read by
    // blocks far apart in time: 2-40% slower on H100, most at MHA, benchmarks/NOTES.md session 19)
    const Item t = make_item(a, once, cache, blockIdx.x, blockIdx.y);
    const int vslice = blockIdx.z;
    if (warp < 4) {
      if constexpr (kProducerRegs > 0) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(kProducerRegs));
      if constexpr (kOnce)
        produce_once(a, maps, *once, sm, buf, cache, t.b, t.kv_head, t.head, t.q_begin, t.q0, t.rows, t.kv_len,
                     t.n_first, t.n_tiles, warp, lane);
      else {
        int count = 0;
        produce(a, maps, sm, buf, cache, t.b, t.kv_head, t.head, t.q_begin, t.q0, t.rows, t.kv_len, t.n_first,
                t.n_tiles, vslice, warp, lane, count);
      }
    } else {
      if constexpr (kProducerRegs > 0) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(kConsumerRegs));
      int count = 0;
      consume(a, sm, buf, cache, t.head, t.q_begin, t.q0, t.rows, t.kv_len, t.shift, t.n_first, t.n_tiles, vslice,
              warp - 4, lane, count, 0, once);
    }
  }

  // Q: BM rows x all atoms, rows past the sequence and columns past DEPTH as zeros (FP8 scores: the consumers stage
  // their own rows as e4m3 terms instead)
  // (every producer lane arrives on q_full when its copies land)
  static __device__ __forceinline__ void load_query(const PrefillArgs& a, const Smem& sm, int head, int q_begin, int q0,
                                                    int rows, int pw, int lane) {
    const T* q = static_cast<const T*>(a.q);
    for (int i = pw * 32 + lane; i < BM * kQAtoms * 8; i += 128) {
      const int chunk = i % 8, r = (i / 8) % BM, atom = i / (8 * BM);
      const int col = atom * 64 + chunk * 8;
      const bool ok = r < rows && col < DEPTH;
      const T* src = ok ? q + (i64)(q_begin + q0 + r) * a.q_stride[0] + (i64)head * a.q_stride[1] + col : q;
      cp_async16(sm.q + (u32)(atom * BM * kAtomRowBytes) + swizzle128(r, chunk), src, ok ? 16 : 0);
    }
    mbar_arrive_cp_async(sm.q_full);
  }

// timing only (benchmarks/NOTES.md sessions 25-26): 1 loads every tile from the workspace as a previous run left it
// (warp 0 reads no flags, the converters return at once)
#ifndef CUKV_ONCE_UB
#define CUKV_ONCE_UB 0
#endif

  // kOnce's producer (benchmarks/NOTES.md sessions 26-28). Warp 0 only feeds the ring: per visited tile it waits
  // until the tile's four quarters are ready in the workspace and loads them by TMA, so nothing it does waits on a
  // conversion's copies or stores (a producer that converted between its ring loads passed each step's latency on to
  // the consumers). Warps 1-3 convert, one quarter at a time through their own quarter of the raw tile. A claimed
  // quarter is released once its rows are in the workspace; its claimer never waits on anything but its own copies
  // and stores, so warp 0's unbounded wait always ends.

  // Warp 0's ring loads of one item's tiles, the last first (`count`: ring elements issued so far, kept across
  // items by the persistent kernel).
  static __device__ __forceinline__ void feed_once(const PrefillMaps* maps, const OnceArgs& o, const Smem& sm,
                                                   const Buf& buf, int ws0, int kv_head, int n_first, int n_tiles,
                                                   int& count, int lane) {
    const int n_last = n_first + n_tiles - 1;
    int ready_to = 0;  // tiles [it, ready_to) of the walk are known ready
    const bool first_item = CUKV_ONCE_STATS && count == 0;
    u64 first_wait = 0;
    for (int it = 0; it < n_tiles; ++it) {
      const int n = n_last - it;
      if (CUKV_ONCE_UB != 1 && it >= ready_to) {
        // lane l acquires quarter l % 4 of the walk's tile it + l / 4: one round trip covers the next 8 tiles (a
        // flag per tile cost a round trip and a proxy fence on the ring's path each). The ballot orders those
        // acquires before lane 0's copies, as __syncwarp would.
        const int t = it + lane / 4;
        int ready = t >= n_tiles, polls = 0;
        const u64 t0 = CUKV_ONCE_STATS ? globaltimer_ns() : 0;
        for (;;) {
          if (!ready) ready = ld_acquire_gpu(once_flag(o, ws0, n_last - t, kv_head, lane % 4)) == 2;
          const unsigned late = __ballot_sync(0xffffffffu, !ready);
          const int upto = late ? (__ffs(late) - 1) / 4 : 8;  // whole tiles ready from it on
          if (upto > 0) {
            ready_to = min(n_tiles, it + upto);
            break;
          }
          __nanosleep(128);
          ++polls;
        }
        if (CUKV_ONCE_STATS && lane == 0) {
          atomicAdd(o.flags - 32 + (polls ? 3 : 2), 1);
          atomicAdd(o.flags - 32 + 4, polls);
          if (polls) atomicAdd(o.flags - 32 + 5, (int)((globaltimer_ns() - t0) >> 6));
          if (polls && first_item) first_wait += globaltimer_ns() - t0;
        }
        if (lane == 0) fence_proxy_async_global();  // the acquired rows -> this thread's tensor copies
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int stage = count % STAGES;
        mbar_wait(sm.empty + 8 * stage, ((count / STAGES) & 1) ^ 1);
        if (lane == 0) {
          const u32 bar = sm.full + 8 * stage;
          mbar_expect_tx(bar, kQAtoms * BN * kAtomRowBytes);
          // one box of the tile's BN rows per atom (the four quarters' flags are all acquired): a quarter's box
          // each made warp 0 issue four times the tensor copies
#pragma unroll
          for (int atom = 0; atom < kQAtoms; ++atom)
            tma_load_4d(buf.element(stage) + (u32)(atom * BN * kAtomRowBytes), e ? &maps->v : &maps->k,
                        atom * kAtomRowBytes, kv_head, ws0 + n * BN, 0, bar);
        }
        mbar_arrive_n(sm.full + 8 * stage, Buf::kProducerWarps);  // the full barrier counts 128 producer arrivals
        ++count;
      }
      // tiles issued so far, for the converters' stop rule (the first word of warp 0's raw quarter, which it never
      // uses; the persistent converters have no stop rule)
      if (!PERSISTENT && lane == 0) asm volatile("st.volatile.shared.u32 [%0], %1;" :: "r"(sm.raw), "r"(it + 1) : "memory");
    }
    if (CUKV_ONCE_STATS && first_item && lane == 0) {  // [7] the first items' waits, [8] the longest (64 ns units)
      atomicAdd(o.flags - 32 + 7, (int)(first_wait >> 6));
      atomicMax(o.flags - 32 + 8, (int)(first_wait >> 6));
    }
  }

  // what the converters multiply a per-tensor cache's codes by: its K or V scale, or 1 where the workspace holds the
  // codes (kOnceCodes); token and block scales: 0, unused (each row's scales come with its codes)
  static __device__ __forceinline__ float tensor_scale(const Fp8Cache& f, bool is_k) {
    return SCALE_BLOCK > 0 ? 0.f : kOnceCodes ? 1.f : f.template load_scale<0>(is_k, 0, 0, 0);
  }

  // the flag of quarter q of the sequence's workspace tile n (its first row ws0) for KV head k
  static __device__ __forceinline__ int* once_flag(const OnceArgs& o, int ws0, int n, int k, int q) {
    return o.flags + ((i64)(ws0 / BN + n) * o.num_kv_heads + k) * 4 + q;
  }

  // A converter warp: quarter q of sequence b's tile n for KV head k (rows past kv_len as zeros) through its raw
  // quarter (raw_quarter) into the workspace, then its flag released (2).
  static __device__ __forceinline__ void convert_quarter(const PrefillArgs& a, const OnceArgs& o, const Smem& sm,
                                                         const Buf& buf, const Fp8Cache& f, float k_scale,
                                                         float v_scale, int b, int kv_len, int ws0, int n, int k,
                                                         int q, u32 quarter, int lane) {
    constexpr int kWarpRows = BN / Buf::kProducerWarps;
    const u64 t0 = CUKV_ONCE_STATS ? globaltimer_ns() : 0;
    const int tok_lane = n * BN + q * kWarpRows + lane;
    const i64 row = (lane < kWarpRows && tok_lane < kv_len) ? f.row_idx(b, tok_lane) : (i64)-1;
    auto copy = [&](auto is_k) {
      constexpr bool IS_K = decltype(is_k)::value;
      i64 lane_off = -1, lane_scale = 0;
      if (row >= 0) {
        lane_off = Fp8Cache::offset(IS_K ? o.fp8.k_stride : o.fp8.v_stride, row, k, 0);
        if constexpr (SCALE_BLOCK > 0)
          lane_scale = f.template scale_ptr<SCALE_BLOCK>(IS_K, row, k, 0) - (IS_K ? o.fp8.k_scales : o.fp8.v_scales);
      }
      buf.template copy_raw_fp8<SCALE_BLOCK, kOnceCodeBytes>(
          quarter + (u32)(IS_K ? 0 : kOnceElemBytes), static_cast<const unsigned char*>(IS_K ? o.fp8.k : o.fp8.v),
          IS_K ? o.fp8.k_scales : o.fp8.v_scales, [&](int r) { return __shfl_sync(0xffffffffu, lane_off, r); },
          lane_off, lane_scale, 0, DEPTH, 0, lane);
    };
    if (CUKV_ONCE_DIAG != 4 && CUKV_ONCE_DIAG != 5) {
      copy(Bool<true>());
      copy(Bool<false>());
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncwarp();  // and the scales the rows' lanes copied
    const i64 row0 = CUKV_ONCE_DIAG == 6 ? (ws0 + n * BN + q * kWarpRows) % 1024 : ws0 + n * BN + q * kWarpRows;
    if (CUKV_ONCE_DIAG != 1 && CUKV_ONCE_DIAG != 5) {
      buf.template convert_raw_fp8_to_global<SCALE_BLOCK, kOnceCodeBytes>(
          quarter, static_cast<T*>(const_cast<void*>(a.kv.k)) + Cache::offset(a.kv.k_stride, row0, k, 0),
          a.kv.k_stride[1], k_scale, DEPTH, 0, lane);
      buf.template convert_raw_fp8_to_global<SCALE_BLOCK, kOnceCodeBytes>(
          quarter + (u32)kOnceElemBytes,
          static_cast<T*>(const_cast<void*>(a.kv.v)) + Cache::offset(a.kv.v_stride, row0, k, 0), a.kv.v_stride[1],
          v_scale, DEPTH, 0, lane);
    }
    if (CUKV_ONCE_DIAG == 7) {  // timing only: the rows just written dropped from L2 unwritten (no write-back)
      constexpr int kLines = DEPTH * (int)sizeof(T) / 128;
      __syncwarp();
      for (int i = lane; i < 2 * kWarpRows * kLines; i += 32) {
        const int kv = i / (kWarpRows * kLines), r = (i / kLines) % kWarpRows, c = i % kLines;
        const T* base = static_cast<const T*>(kv ? a.kv.v : a.kv.k) +
                        Cache::offset(kv ? a.kv.v_stride : a.kv.k_stride, row0 + r, k, c * (128 / (int)sizeof(T)));
        asm volatile("discard.global.L2 [%0], 128;" :: "l"(base) : "memory");
      }
    }
    if (CUKV_ONCE_DIAG != 2 && CUKV_ONCE_DIAG != 5) __threadfence();  // this lane's workspace rows are visible
    __syncwarp();     // every lane's, and every lane has read its raw chunks before the next copy
    if (lane == 0) st_release_gpu(once_flag(o, ws0, n, k, q), 2);
    if (CUKV_ONCE_STATS && lane == 0) {
      atomicAdd(o.flags - 32 + 1, 1);
      atomicAdd(o.flags - 32 + 6, (int)((globaltimer_ns() - t0) >> 6));
    }
  }

  // The launch-per-item producer: warp 0 feeds the item's tiles; warps 1-3 convert any free quarter of the tiles the
  // block visits (the first KV head, or keys nobody converted ahead), then greedily the free quarters of the
  // sequence's next KV head, whose blocks the grid launches next (heads along y).
  static __device__ __forceinline__ void produce_once(const PrefillArgs& a, const PrefillMaps* maps, const OnceArgs& o,
                                                       const Smem& sm, const Buf& buf, const Cache& ws, int b, int kv_head,
                                                       int head, int q_begin, int q0, int rows, int kv_len, int n_first,
                                                       int n_tiles, int pw, int lane) {
    const int ws0 = (int)ws.row_key(b, 0);  // the sequence's first workspace row, a multiple of BN
    const int n_last = n_first + n_tiles - 1;
    if (pw == 0 && lane == 0) asm volatile("st.volatile.shared.u32 [%0], 0;" :: "r"(sm.raw) : "memory");
    asm volatile("bar.sync 15, 128;" ::: "memory");  // the producer warpgroup (15: no other user): the count is 0 before converters look
    load_query(a, sm, head, q_begin, q0, rows, pw, lane);
    if (pw == 0) {
      int count = 0;
      feed_once(maps, o, sm, buf, ws0, kv_head, n_first, n_tiles, count, lane);
      asm volatile("cp.async.wait_all;" ::: "memory");  // the query's copies have landed
      return;
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    if (CUKV_ONCE_UB == 1) return;
    const Fp8Cache f(o.fp8);
    const float k_scale = tensor_scale(f, true), v_scale = tensor_scale(f, false);
    // claims quarter q of tile n of KV head k if it is free (relaxed look first: most are taken or ready)
    auto claim = [&](int n, int k, int q) {
      int won = 0;
      int* flag = once_flag(o, ws0, n, k, q);
      if (lane == 0 && ld_relaxed_gpu(flag) == 0) won = atomicCAS(flag, 0, 1) == 0;
      return __shfl_sync(0xffffffffu, won, 0) != 0;
    };
    constexpr int kConverters = Buf::kProducerWarps - 1;
    // The free quarters of KV head k's tiles top, top - 1, ... (tiles of them), in that order: 32 flags looked at in
    // one round trip, quarter i of the walk goes to warp 1 + i % 3. With `ahead`, it stops once warp 0 has fewer than
    // CUKV_ONCE_MINLEFT tiles left to issue: a quarter takes a converter about as long as a few tiles take the
    // consumers, and a block whose consumers are done waits for its converters.
    auto convert_free = [&](int k, int top, int tiles, bool ahead) {
      auto stop = [&] {
        if (!ahead) return false;
        int fed;  // tiles warp 0 has issued
        asm volatile("ld.volatile.shared.u32 %0, [%1];" : "=r"(fed) : "r"(sm.raw) : "memory");
        return n_tiles - fed < CUKV_ONCE_MINLEFT;
      };
      for (int base = 0; base < 4 * tiles; base += 32) {
        if (stop()) return;
        const int i = base + lane;
        const bool mine = i < 4 * tiles && i % kConverters == pw - 1;
        unsigned free = __ballot_sync(0xffffffffu, mine && ld_relaxed_gpu(once_flag(o, ws0, top - i / 4, k, i % 4)) == 0);
        for (; free; free &= free - 1) {
          if (stop()) return;
          const int j = base + __ffs(free) - 1;
          if (claim(top - j / 4, k, j % 4))
            convert_quarter(a, o, sm, buf, f, k_scale, v_scale, b, kv_len, ws0, top - j / 4, k, j % 4,
                            raw_quarter(sm, pw), lane);
        }
      }
    };
    // First the visited tiles, in the order warp 0 needs them; then, greedily, the sequence's tiles for the next KV
    // head, top tile first (the heaviest query tiles, which visit the top tiles first, launch first).
    convert_free(kv_head, n_last, n_tiles, false);
    const int seq_tiles = (kv_len + BN - 1) / BN;
    if (kv_head + 1 < o.num_kv_heads) convert_free(kv_head + 1, seq_tiles - 1, seq_tiles, true);
  }

  // PERSISTENT (convert once): one block per SM walks the work items (query tile, head) in the launch grid's order.
  // Warp 0 takes the next item from a counter (the first is blockIdx.x), stages its query once the consumers are
  // done with the previous one (q_empty: their last S of the item has completed) and publishes the item (Item, in
  // shared memory) with it (q_full); the ring's position carries over, so the next item's tiles load while the consumers finish the
  // last one. Warps 1-3 take quarters from a second counter in the order the items need them (KV head, then
  // workspace tile), until none is left: nobody claims by compare-and-swap, and no converter holds an SM whose
  // consumers are done.
  // Warp 0's lane 0: the item and its query on q_full (BM rows of the head by tensor copies: rows past the sequence
  // read the next one's or zeros, and their outputs are never stored); b < 0 tells the consumers to stop.
  static __device__ __forceinline__ void stage_item(const Smem& sm, const CUtensorMap* qmap, const Item& t) {
    store_item(sm.item, t);
    if (t.b >= 0) {
      mbar_expect_tx(sm.q_full, kQAtoms * BM * kAtomRowBytes);
      for (int atom = 0; atom < kQAtoms; ++atom)
        tma_load_4d(sm.q + (u32)(atom * BM * kAtomRowBytes), qmap, atom * kAtomRowBytes, t.head, t.q_begin + t.q0, 0,
                    sm.q_full);
    }
    mbar_arrive(sm.q_full);  // release: the item
  }

  static __device__ __forceinline__ void feed_persistent(const PrefillArgs& a, const PrefillMaps* maps,
                                                         const OnceArgs& o, const CUtensorMap* qmap, const Smem& sm,
                                                         const Buf& buf, const Cache& ws, int lane) {
    const int total = o.num_work * a.num_qo_heads;
    int count = 0;
    Item t;
    t.b = -1;
    if ((int)blockIdx.x < total) t = make_item(a, &o, ws, blockIdx.x);
    for (int i = 0;; ++i) {
      if (i > 0) mbar_wait(sm.q_empty, (i - 1) & 1);  // the consumers are done with the staged query and item
      if (lane == 0) stage_item(sm, qmap, t);
      if (t.b < 0) return;
      if (t.n_tiles > 0)
        feed_once(maps, o, sm, buf, (int)ws.row_key(t.b, 0), t.kv_head, t.n_first, t.n_tiles, count, lane);
      // The next item, taken only now that this one's tiles are issued (its consumers are a ring behind): a block
      // takes work when it is about to be free, as the hardware hands out blocks, so the heaviest-first order holds.
      // Taken at the item's start, a block that had just begun a long item held the next one back for its whole length
      // (d256: 12% slower, benchmarks/NOTES.md session 28).
      int next = 0;
      if (lane == 0) next = gridDim.x + atomicAdd(o.flags - 2, 1);
      next = __shfl_sync(0xffffffffu, next, 0);
      t.b = -1;
      if (next < total) t = make_item(a, &o, ws, next);
    }
  }

  // Converter warp pw's raw quarter.
  static __device__ __forceinline__ u32 raw_quarter(const Smem& sm, int pw) {
    return sm.raw + (u32)((pw - kOnceFirstQuarter) * kOnceQuarterBytes);
  }

  static __device__ __forceinline__ void convert_persistent(const PrefillArgs& a, const OnceArgs& o, const Smem& sm,
                                                            const Buf& buf, const Cache& ws, u32 quarter, int lane) {
    if (CUKV_ONCE_UB == 1) return;
    const Fp8Cache f(o.fp8);
    const float k_scale = tensor_scale(f, true), v_scale = tensor_scale(f, false);
    const int per_head = 4 * o.ws_tiles, total = per_head * (int)o.num_kv_heads;
    for (;;) {
      int i = 0;
      if (lane == 0) i = atomicAdd(o.flags - 1, 1);
      i = __shfl_sync(0xffffffffu, i, 0);
      if (i >= total) return;
      const int k = i / per_head, q = i % 4;
      const int tile = (i % per_head) / 4;  // sequence by sequence, bottom up (benchmarks/NOTES.md session 33)
      const int b = __ldg(o.tile_seq + tile);
      const int ws0 = (int)ws.row_key(b, 0);
      const int kv_len = min(f.cache_length(b), ws.cache_length(b));
      convert_quarter(a, o, sm, buf, f, k_scale, v_scale, b, kv_len, ws0, tile - ws0 / BN, k, q, quarter, lane);
    }
  }

  static __device__ __forceinline__ void produce(const PrefillArgs& a, const PrefillMaps* maps, const Smem& sm,
                                                 const Buf& buf, const Cache& cache,
                                                 int b, int kv_head, int head, int q_begin, int q0, int rows,
                                                 int kv_len, int n_first, int n_tiles, int vslice, int pw, int lane,
                                                 int& count) {
    if constexpr (!FP8_SCORES && !PERSISTENT) load_query(a, sm, head, q_begin, q0, rows, pw, lane);

    const KVT* kbase = static_cast<const KVT*>(a.kv.k);
    const KVT* vbase = static_cast<const KVT*>(a.kv.v);
    float k_tensor_scale = 0.f, v_tensor_scale = 0.f;
    if constexpr (QUANTIZED && SCALE_BLOCK == 0) {
      k_tensor_scale = cache.template load_scale<0>(true, 0, 0, 0);
      v_tensor_scale = cache.template load_scale<0>(false, 0, 0, 0);
    }
    constexpr int kWarpRows = BN / Buf::kProducerWarps;
    // Lane j of a producer warp loads the table entry of the warp's j-th row one tile ahead (row_key: the
    // load's latency hides behind this tile's copies) and forms that row's 64-bit K and V offsets (and FP8
    // scale offsets) from it once (row_from_key checks the entry there); every lane that copies a chunk of
    // that row takes them by shuffle, so the address math is not repeated.
    auto lane_tok = [&](int n) -> int { return n * BN + pw * kWarpRows + lane; };  // this lane's token of tile n
    auto lookup = [&](int n) -> i64 {
      const int tok = lane_tok(n);
      return (lane < kWarpRows && tok < kv_len) ? cache.row_key(b, tok) : (i64)-1;
    };
    static_assert(kWarpRows <= 32, "BN <= 128: one row per producer lane");
    // this lane's row of tile n (a cache row), or -1 when it reads as zeros
    auto lane_row = [&](int n, i64 key_lane) -> i64 {
      const int tok_lane = lane_tok(n);
      return (lane < kWarpRows && tok_lane < kv_len) ? cache.row_from_key(key_lane, tok_lane) : (i64)-1;
    };
    // TMA: (page, token in the page) of the box that starts at this lane's row of tile n. Paged: from the checked
    // row `row` (a box stays in one page, so its rows share the entry's check; page -1 is outside the tensor and
    // reads as zeros). Contiguous (k/v seen as one page): the unchecked row, whose rows outside k/v read as zeros,
    // as cp.async's holes do.
    auto box_coords = [&](int n, i64 key_lane, i64 row) -> int2 {
      if constexpr (PAGE_SIZE > 0)
        return row >= 0 ? make_int2((int)(row / PAGE_SIZE), (int)(row % PAGE_SIZE)) : make_int2(-1, 0);
      else
        return make_int2(0, (int)(key_lane + lane_tok(n)));
    };
    // TMA straight into ring element `stage` (the leading lane of a box): one box of this lane's TMA_ROWS rows per
    // 128-byte swizzle atom, from byte column `col_bytes` of the map's rows, counted on the element's full barrier
    auto ring_boxes = [&](int stage, const CUtensorMap* map, int col_bytes, int atoms, int2 box) {
      const u32 bar = sm.full + 8 * stage;
      mbar_expect_tx(bar, atoms * TMA_ROWS * kAtomRowBytes);
#pragma unroll
      for (int atom = 0; atom < atoms; ++atom)
        tma_load_4d(buf.element(stage) + (u32)((atom * BN + pw * kWarpRows + lane) * kAtomRowBytes), map,
                    col_bytes + atom * kAtomRowBytes, kv_head, box.y, box.x, bar);
    };
    auto row_offsets = [&](int n, i64 key_lane, i64& k_lane, i64& v_lane, i64& ks_lane, i64& vs_lane) {
      k_lane = -1, v_lane = -1, ks_lane = 0, vs_lane = 0;
      const i64 row = lane_row(n, key_lane);
      if (row >= 0) {
        k_lane = Cache::offset(a.kv.k_stride, row, kv_head, 0);
        v_lane = Cache::offset(a.kv.v_stride, row, kv_head, 0);
        if constexpr (QUANTIZED && SCALE_BLOCK > 0) {
          ks_lane = cache.template scale_ptr<SCALE_BLOCK>(true, row, kv_head, 0) - a.kv.k_scales;
          vs_lane = cache.template scale_ptr<SCALE_BLOCK>(false, row, kv_head, 0) - a.kv.v_scales;
        }
      }
    };
    auto row_of = [&](i64 x, int i) -> i64 { return __shfl_sync(0xffffffffu, x, (lane / 8 + 4 * i) % 32); };
    i64 key_next = n_tiles > 0 ? lookup(n_first + n_tiles - 1) : (i64)-1;
    if constexpr (QUANTIZED) {
      // FP8: tile it + 1's codes and scales land in raw slot (it + 1) % 2 while tile it is converted from slot
      // it % 2 into the ring (tile t's elements are ring indices t * (kKElems + 1) + e, V last). FP8_SCORES: the
      // raw slot holds V only; the K element's codes go straight into the ring, with its rows' scales beside it,
      // when the tile is issued (a tile ahead of V's conversion: the ring fills out of order, which the
      // per-element barriers allow). The codes come one of two ways:
      // - kTma: lane j looks up row j as above, and every TMA_ROWS-th lane issues a tensor copy of the box starting
      //   at its row (a box stays within a page and within the warp's rows). The lanes still copy their rows'
      //   scales with cp.async, so raw_full[t % 2] (and a K element's full barrier) completes when the boxes'
      //   bytes and every lane's scale copies have landed. Rows past the sequence arrive as the cache holds them
      //   (unused slots may be NaN): the last tile's conversion zeroes them and the consumers' mask drops their K
      //   columns (a select). Holes, and boxes wholly past the sequence, take page -1: outside the tensor, which
      //   TMA reads as zeros. A __syncwarp orders the refill of a warp's rows after its lanes' reads of them.
      // - cp.async: each lane copies 16-code chunks and converts exactly the codes it copied (its own
      //   cp.async.wait_group orders those); a row's scales come from the row's lane, so a __syncwarp follows the
      //   wait. Refilling a slot is ordered after every lane's reads of it by the full-warp shuffles at the start
      //   of copy_raw_fp8 (before its scale copies), which no lane passes before all have finished converting.
      // FP8_SCORES with token scales: the lane's row's K scale beside the K element in ring slot `stage` (zero for
      // a row that reads as zeros)
      auto copy_k_scale = [&](int stage, bool ok, const float* src) {
        if (lane < kWarpRows)
          cp_async4(sm.kscale + (u32)((stage * BN + pw * kWarpRows + lane) * 4), ok ? src : a.kv.k_scales, ok ? 4 : 0);
      };
      float ks_held = 0.f;  // kKsMma: this lane's row's K scale of the tile issued last, for ring element ks_stage
      int ks_stage = 0;
      // kKsMma: B of the K-scale wgmma (see kKsMma) for the K element issued last, then its full barrier
      auto split_k_scales = [&] {
        if constexpr (kKsMma) {
          const int r = pw * kWarpRows + lane;
          if (lane < kWarpRows) {
            const uint2 t = bf16x3_from_float(ks_held);
            const u32 dst = sm.kscale + (u32)(kKsOnesBytes + (ks_stage * (BN / 2) + r % (BN / 2)) * kKsRowBytes +
                                              (r / (BN / 2)) * 8);
            asm volatile("st.shared.v2.u32 [%0], {%1,%2};" ::"r"(dst), "r"(t.x), "r"(t.y) : "memory");
            fence_proxy_async();
          }
          mbar_arrive(sm.full + 8 * ks_stage);
        }
      };
      auto issue_tile = [&](int n, i64 key_lane, int t) {
        const u32 slot = sm.raw + (u32)((t & 1) * kRawTileBytes);
        const u32 vdst = slot + (u32)((FP8_SCORES ? 0 : kKElems) * kRawElemBytes);
        const int idx = t * (kKElems + 1), stage = idx % STAGES;  // FP8_SCORES: the K element's ring index
        if constexpr (kTma) {
          const int r0 = pw * kWarpRows + lane;
          const i64 row = lane_row(n, key_lane);
          const u32 raw_bar = sm.raw_full + 8 * (t & 1);
          __syncwarp();  // the warp's lanes have read their rows of this slot (tile t - 2) before it is refilled
          // the scales first: their offsets die before the boxes' coordinates are formed
          if constexpr (FP8_SCORES) {
            mbar_wait(sm.empty + 8 * stage, ((idx / STAGES) & 1) ^ 1);
            if constexpr (kKsMma) {
              // held in a register until split_k_scales, after the next raw wait has hidden the load
              ks_held = row >= 0 ? __ldg(cache.template scale_ptr<SCALE_BLOCK>(true, row, kv_head, 0)) : 0.f;
              ks_stage = stage;
            } else if constexpr (SCALE_BLOCK > 0)
              copy_k_scale(stage, row >= 0, cache.template scale_ptr<SCALE_BLOCK>(true, row, kv_head, 0));
          } else if constexpr (SCALE_BLOCK > 0) {
            const i64 ks_lane =
                row >= 0 ? cache.template scale_ptr<SCALE_BLOCK>(true, row, kv_head, 0) - a.kv.k_scales : 0;
#pragma unroll
            for (int e = 0; e < kKElems; ++e)
              buf.template copy_raw_scales<SCALE_BLOCK>(slot + (u32)(e * kRawElemBytes), a.kv.k_scales, row, ks_lane,
                                                        e * BK, min(BK, DEPTH - e * BK), pw, lane);
          }
          if constexpr (SCALE_BLOCK > 0) {
            const i64 vs_lane =
                row >= 0 ? cache.template scale_ptr<SCALE_BLOCK>(false, row, kv_head, 0) - a.kv.v_scales : 0;
            buf.template copy_raw_scales<SCALE_BLOCK>(vdst, a.kv.v_scales, row, vs_lane, vslice * kVCols, kVCols, pw,
                                                      lane);
          }
          if (lane < kWarpRows && lane % TMA_ROWS == 0) {
            const int2 box = box_coords(n, key_lane, row);
            const int page = box.x, tip = box.y;
            if constexpr (FP8_SCORES) {
              ring_boxes(stage, &maps->k, 0, Buf::code_atoms, box);
            } else {
#pragma unroll
              for (int e = 0; e < kKElems; ++e) {
                mbar_expect_tx(raw_bar, TMA_ROWS * BK);
                tma_load_4d(slot + (u32)(e * kRawElemBytes + r0 * BK), &maps->k, e * BK, kv_head, tip, page, raw_bar);
              }
            }
            mbar_expect_tx(raw_bar, TMA_ROWS * BK);
            tma_load_4d(vdst + (u32)(r0 * BK), &maps->v, vslice * kVCols, kv_head, tip, page, raw_bar);
          }
          if constexpr (FP8_SCORES && !kKsMma) mbar_arrive_cp_async(sm.full + 8 * stage);
          mbar_arrive_cp_async(raw_bar);
        } else {
          i64 k_lane, v_lane, ks_lane, vs_lane;
          row_offsets(n, key_lane, k_lane, v_lane, ks_lane, vs_lane);
          if constexpr (FP8_SCORES) {
            mbar_wait(sm.empty + 8 * stage, ((idx / STAGES) & 1) ^ 1);
            buf.load_codes_from_dram(stage, kbase, [&](int i) { return row_of(k_lane, i); }, pw, lane);
            if constexpr (SCALE_BLOCK > 0) copy_k_scale(stage, k_lane >= 0, a.kv.k_scales + ks_lane);
            mbar_arrive_cp_async(sm.full + 8 * stage);
          } else {
#pragma unroll
            for (int e = 0; e < kKElems; ++e)
              buf.template copy_raw_fp8<SCALE_BLOCK>(slot + (u32)(e * kRawElemBytes), kbase, a.kv.k_scales,
                                                     [&](int r) { return __shfl_sync(0xffffffffu, k_lane, r); }, k_lane,
                                                     ks_lane, e * BK, min(BK, DEPTH - e * BK), pw, lane);
          }
          buf.template copy_raw_fp8<SCALE_BLOCK>(vdst, vbase, a.kv.v_scales,
                                                 [&](int r) { return __shfl_sync(0xffffffffu, v_lane, r); }, v_lane,
                                                 vs_lane, vslice * kVCols, kVCols, pw, lane);
        }
      };
      if (n_tiles > 0) {
        const i64 key_lane = key_next;
        if (n_tiles > 1) key_next = lookup(n_first + n_tiles - 2);
        issue_tile(n_first + n_tiles - 1, key_lane, 0);
        split_k_scales();  // the first tile's: nothing to hide its load behind
      }
      if constexpr (!kTma) cp_async_commit();
      for (int it = 0; it < n_tiles; ++it) {
        const int n = n_first + n_tiles - 1 - it;
        trace_mark(it, 0);
        if (it + 1 < n_tiles) {
          const i64 key_lane = key_next;
          if (it + 2 < n_tiles) key_next = lookup(n - 2);
          issue_tile(n - 1, key_lane, it + 1);
        }
        trace_mark(it, 1);
        if constexpr (kTma) {
          mbar_wait(sm.raw_full + 8 * (it & 1), (it >> 1) & 1);
        } else {
          cp_async_commit();
          cp_async_wait<1>();  // this lane's copies of tile it have landed
          __syncwarp();        // and the scales its row's lane copied
        }
        if (it + 1 < n_tiles) split_k_scales();
        trace_mark(it, 2);
        const u32 slot = sm.raw + (u32)((it & 1) * kRawTileBytes);
        const int valid = kv_len - n * BN;  // rows of this tile inside the sequence (TMA: the rest must be zeroed)
#pragma unroll
        for (int e = FP8_SCORES ? kKElems : 0; e <= kKElems; ++e) {
          const int idx = it * (kKElems + 1) + e, stage = idx % STAGES;
          const u32 src = slot + (u32)((FP8_SCORES ? 0 : e) * kRawElemBytes);
          const float ts = e < kKElems ? k_tensor_scale : v_tensor_scale;
          auto wait_slot = [&] {
            mbar_wait(sm.empty + 8 * stage, ((idx / STAGES) & 1) ^ 1);
            trace_mark(it, 3);
          };
          // V with a per-tensor scale goes in as its codes (kVCodes); the TMA producer's last tile zeroes the rows
          // past the sequence, full tiles pay nothing for that
          auto convert = [&](auto codes) {
            constexpr bool kCodes = decltype(codes)::value;
            if (kTma && valid < BN)
              buf.template convert_raw_fp8<SCALE_BLOCK, true, kCodes, kConvPairs>(stage, src, ts, pw, lane, wait_slot, valid);
            else
              buf.template convert_raw_fp8<SCALE_BLOCK, false, kCodes, kConvPairs>(stage, src, ts, pw, lane, wait_slot);
          };
          if (e == kKElems)
            convert(Bool<kVCodes>());
          else
            convert(Bool<false>());
          fence_proxy_async();  // generic-proxy stores -> the consumers' wgmma reads
          mbar_arrive(sm.full + 8 * stage);
        }
        trace_mark(it, 4);
      }
    } else {
      for (int it = 0; it < n_tiles; ++it) {
        const int n = n_first + n_tiles - 1 - it;
        const i64 key_lane = key_next;
        if (it + 1 < n_tiles) key_next = lookup(n - 1);
        // kTma: a tile wholly inside the sequence comes as tensor copies straight into the ring (every TMA_ROWS-th
        // lane issues one box of its rows per 64-dim atom). The tile holding the sequence's end keeps the
        // cp.async path below: its zero fill past the sequence is what keeps unused (possibly NaN) slots out of
        // P V, where a masked score's zero weight would still multiply them.
        if constexpr (kTma) {
          if ((n + 1) * BN <= kv_len) {
            const int2 box = box_coords(n, key_lane, PAGE_SIZE > 0 ? lane_row(n, key_lane) : (i64)-1);
            const bool lead = lane < kWarpRows && lane % TMA_ROWS == 0;
#pragma unroll
            for (int e = 0; e <= kKElems; ++e) {
              const int stage = count % STAGES;
              trace_mark(it, 2 * min(e, 1));
              mbar_wait(sm.empty + 8 * stage, ((count / STAGES) & 1) ^ 1);
              trace_mark(it, 2 * min(e, 1) + 1);
              if (lead) {
                // dims of this element: a K element's BK, or V's slice; boxes past the head read as zeros
                const int col0 = e < kKElems ? e * BK : vslice * kVCols;
                const int ncols = e < kKElems ? min(BK, DEPTH - e * BK) : kVCols;
                ring_boxes(stage, e < kKElems ? &maps->k : &maps->v, col0 * (int)sizeof(T), (ncols + 63) / 64, box);
              }
              mbar_arrive(sm.full + 8 * stage);
              ++count;
            }
            trace_mark(it, 4);
            continue;
          }
        }
        i64 k_lane, v_lane, ks_lane, vs_lane;
        row_offsets(n, key_lane, k_lane, v_lane, ks_lane, vs_lane);
        auto koff = [&](int i) -> i64 { return row_of(k_lane, i); };
        auto voff = [&](int i) -> i64 { return row_of(v_lane, i); };
#pragma unroll
        for (int e = 0; e <= kKElems; ++e) {
          const int stage = count % STAGES;
          trace_mark(it, 2 * min(e, 1));  // events 0-1: the (last) K element's slot; 2-3: V's
          mbar_wait(sm.empty + 8 * stage, ((count / STAGES) & 1) ^ 1);
          trace_mark(it, 2 * min(e, 1) + 1);
          if (e < kKElems)
            buf.load_from_dram(stage, kbase, koff, e * BK, min(BK, DEPTH - e * BK), pw, lane);
          else
            buf.load_from_dram(stage, vbase, voff, vslice * kVCols, kVCols, pw, lane);
          mbar_arrive_cp_async(sm.full + 8 * stage);
          ++count;
        }
        trace_mark(it, 4);
      }
    }
    // leave only after every copy has landed (PERSISTENT: the ring's position carries into the next item)
    if constexpr (!PERSISTENT) asm volatile("cp.async.wait_all;" ::: "memory");
  }

  // PERSISTENT, 16-bit cache: the producer warpgroup walks the work items as convert-once's warp 0 does
  // (feed_persistent), all four warps issuing each tile's boxes as the launch-per-item producer does (produce). Warp 0
  // stages each item's query once the consumers are done with the last one and takes the next item from the counter
  // once this one's tiles are issued; the other warps read its index from shared memory after the producers' named
  // barrier (two slots, so a slot is rewritten only after every warp has passed the barrier that follows its read).
  // The counter resets itself: the last block to finish zeroes it, so a launch needs no memset (CUDA graphs replay it).
  static __device__ __forceinline__ void feed_persistent_16(const PrefillArgs& a, const PrefillMaps* maps,
                                                            const OnceArgs& o, const CUtensorMap* qmap, const Smem& sm,
                                                            const Buf& buf, const Cache& cache, int pw, int lane) {
    const int total = o.num_work * a.num_qo_heads;
    int count = 0, idx = blockIdx.x;
    for (int i = 0;; ++i) {
      Item t;
      t.b = -1;
      if (idx < total) t = make_item(a, &o, cache, idx);
      if (pw == 0) {
        if (i > 0) mbar_wait(sm.q_empty, (i - 1) & 1);  // the consumers are done with the staged query and item
        if (lane == 0) stage_item(sm, qmap, t);
      }
      if (t.b < 0) break;
      produce(a, maps, sm, buf, cache, t.b, t.kv_head, t.head, t.q_begin, t.q0, t.rows, t.kv_len, t.n_first,
              t.n_tiles, 0, pw, lane, count);
      const u32 slot = sm.next + (u32)(4 * (i & 1));
      if (pw == 0 && lane == 0)
        asm volatile("st.shared.u32 [%0], %1;" :: "r"(slot), "r"((int)gridDim.x + atomicAdd(o.flags - 2, 1)) : "memory");
      asm volatile("bar.sync 15, 128;" ::: "memory");  // the producer warpgroup (15: no other user)
      asm volatile("ld.shared.u32 %0, [%1];" : "=r"(idx) : "r"(slot) : "memory");
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    if (pw == 0 && lane == 0) {
      __threadfence();  // this block's last take of the counter, before its count of finished blocks
      if (atomicAdd(o.flags - 3, 1) == (int)gridDim.x - 1) {
        atomicExch(o.flags - 2, 0);
        atomicExch(o.flags - 3, 0);
      }
    }
  }

  // FP8 scores: this thread's two query rows r0, r1 (block rows) as e4m3 hi + lo terms in shared memory. Lane c
  // of the row's quad takes the 8-dim pieces c, c + 4, ... (zeros past the head and past the sequence); the
  // row's factor 2^k = 256 / (power of two >= its largest |q|) puts every |q * 2^k| <= 256, hi = e4m3(q * 2^k),
  // lo = e4m3(q * 2^k - hi) (the difference is exact in float32). Returns 2^-k per row in f0, f1.
  static __device__ __forceinline__ void split_query(const PrefillArgs& a, const Smem& sm, int head, int q_begin,
                                                     int q0, int rows, int r0, int r1, int c, float& f0, float& f1) {
    const T* q = static_cast<const T*>(a.q);
    uint4 x[2][kQ8Steps];
    float amax[2] = {0.f, 0.f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = h ? r1 : r0;
      const T* src = q + (i64)(q_begin + q0 + r) * a.q_stride[0] + (i64)head * a.q_stride[1];
#pragma unroll
      for (int t = 0; t < kQ8Steps; ++t) {
        const int d = 8 * (c + 4 * t);
        x[h][t] = (r < rows && d < DEPTH) ? __ldg(reinterpret_cast<const uint4*>(src + d)) : make_uint4(0, 0, 0, 0);
        const T* e = reinterpret_cast<const T*>(&x[h][t]);
#pragma unroll
        for (int i = 0; i < 8; ++i) amax[h] = fmaxf(amax[h], fabsf(ElemTraits<T>::to_float(e[i])));
      }
    }
    float up[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) up[h] = pow2_at_least(fmaxf(quad_max(amax[h]), 0x1p-100f)) * (1.f / 256.f);
    f0 = up[0];
    f1 = up[1];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = h ? r1 : r0;
      const float k = 1.f / up[h];  // a power of two: exact
#pragma unroll
      for (int t = 0; t < kQ8Steps; ++t) {
        const T* e = reinterpret_cast<const T*>(&x[h][t]);
        u32 hi[2], lo[2];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float v0 = ElemTraits<T>::to_float(e[2 * i]) * k, v1 = ElemTraits<T>::to_float(e[2 * i + 1]) * k;
          const u16 h2 = e4m3x2_from_floats(v0, v1);
          const float2 back = floats_from_e4m3x2(h2);
          const u16 l2 = e4m3x2_from_floats(v0 - back.x, v1 - back.y);
          if (i % 2 == 0) {
            hi[i / 2] = h2;
            lo[i / 2] = l2;
          } else {
            hi[i / 2] |= (u32)h2 << 16;
            lo[i / 2] |= (u32)l2 << 16;
          }
        }
        const int byte = 8 * (c + 4 * t);
        const u32 dst = sm.q + (u32)((byte / 128) * BM * kAtomRowBytes) + swizzle128(r, (byte % 128) / 16) + (byte % 16);
        asm volatile("st.shared.v2.u32 [%0], {%1,%2};" :: "r"(dst), "r"(hi[0]), "r"(hi[1]) : "memory");
        asm volatile("st.shared.v2.u32 [%0], {%1,%2};" :: "r"(dst + (u32)kQ8Half), "r"(lo[0]), "r"(lo[1]) : "memory");
      }
    }
  }

  // a row's exponent base in log2 units (its running max times the score factor); a row with nothing visible yet
  // keeps base 0, so exp2(-inf - 0) = 0 and never NaN
  static __device__ __forceinline__ float exp_base(float m, float sl) { return m == -CUKV_INF ? 0.f : m * sl; }

  static __device__ __forceinline__ void consume(const PrefillArgs& a, const Smem& sm, const Buf& buf, const Cache& cache,
                                                 int head, int q_begin, int q0, int rows, int kv_len, int shift,
                                                 int n_first, int n_tiles, int vslice, int warp, int lane, int& count,
                                                 int q_phase, const OnceArgs* once = nullptr) {
    typedef Wgmma<T, BN> MmaS;
    typedef Wgmma8<BN> MmaS8;
    typedef Wgmma<__nv_bfloat16, kKsMma ? BN / 2 : 16> MmaKs;
    float kb[MmaKs::kRegs];  // kKsMma: the score columns' K scales
    typedef Wgmma<PT, kVCols> MmaO;
    // the warpgroup, broadcast from lane 0 so that ptxas knows it is warp-uniform: the query descriptor built
    // from it then stays in uniform registers, one add per wgmma (desc_add) instead of moves from vector ones
    const int wg = __shfl_sync(0xffffffffu, warp / 4, 0), wq = warp % 4;
    const int g = lane / 4, c = lane % 4;
    // this thread's two rows (within the block) and their positions
    const int r0 = wg * 64 + wq * 16 + g, r1 = r0 + 8;
    const int p0 = shift + q0 + r0, p1 = shift + q0 + r1;
    const int hi0 = key_hi(a, p0, kv_len), hi1 = key_hi(a, p1, kv_len);
    const int lo0 = key_lo(a, p0), lo1 = key_lo(a, p1);
    // positions of the warpgroup's rows bound which tiles need the element-wise mask
    const int wp_first = shift + q0 + wg * 64, wp_last = wp_first + 63;
    const int wg_hi_min = key_hi(a, wp_first, kv_len), wg_lo_max = key_lo(a, wp_last);

    const float scale_log2 = a.sm_scale * kLog2e;
    const bool capped = a.softcap > 0.f;
    // Scores leave the mma as s * f_row (FP8 scores: the query's 2^-k and a per-tensor K scale; token K scales
    // are applied per column below); f0, f1 fold into the exponent's one FMA (sl0, sl1) or the soft-cap.
    float f0 = 1.f, f1 = 1.f;
    if constexpr (FP8_SCORES) {
      split_query(a, sm, head, q_begin, q0, rows, r0, r1, c, f0, f1);
      if constexpr (SCALE_BLOCK == 0) {
        const float ks = cache.template load_scale<0>(true, 0, 0, 0);
        f0 *= ks;
        f1 *= ks;
      }
      fence_proxy_async();  // the generic-proxy stores -> wgmma; then every warp of the warpgroup has stored
      named_barrier_sync<128>(1 + wg);
    } else {
      mbar_wait(sm.q_full, q_phase);
      fence_proxy_async();
    }
    if constexpr (kOnceCodes) {  // the workspace's K holds codes: its tensor scale scales the scores
      const float ks = Fp8Cache(once->fp8).template load_scale<0>(true, 0, 0, 0);
      f0 *= ks;
      f1 *= ks;
    }
    const float sl0 = capped ? kLog2e : scale_log2 * f0, sl1 = capped ? kLog2e : scale_log2 * f1;
    const float cap0 = a.sm_scale * f0 / a.softcap, cap1 = a.sm_scale * f1 / a.softcap;
    float o[kORegs];
#pragma unroll
    for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
    float m0 = -CUKV_INF, m1 = -CUKV_INF, l0 = 0.f, l1 = 0.f;

    // this warpgroup's query rows; each wgmma adds its offset (desc_add)
    const u64 q_desc = sw128_desc(sm.q + (u32)(wg * 64 * kAtomRowBytes), 1, 1024);

    int pending_v = -1;
    u32 ws_k = 0, ws_v = 0, ws_bar = 0, ws_k_early = 0;  // ns, 32 bits: an item's waits stay far below 4 s
    const u32 ws_t0 = CUKV_WAIT_STATS ? (u32)globaltimer_ns() : 0;
    // convert-once's persistent grid: an item begun in the kernel's first 400 us (while the converters run), from the
    // blocks' start (an item that reads the word before any block's start is visible counts as later; the form that
    // handles it spilled 20 bytes at d256). The 16-bit grid has no converters.
    const bool early = CUKV_WAIT_STATS && PERSISTENT && kOnce &&
                       globaltimer_ns() - ~*reinterpret_cast<const volatile unsigned long long*>(once->flags - 32 + 10) <
                           400000ull;
    // PINGPONG: wait for the previous warpgroup's S issue, then let the next one go. Warpgroup 0 goes first
    // and the last skips its final pass, so every named barrier sees as many passes as waits.
    const int ring_next = 4 + (wg + 1) % kConsumerWGs;
    for (int it = 0; it < n_tiles; ++it) {
      const int n = n_first + n_tiles - 1 - it;
      float s[kSRegs];
      trace_mark(it, 0);
      const bool ring_wait = PINGPONG && !(wg == 0 && it == 0);
      const bool ring_pass = PINGPONG && !(wg == kConsumerWGs - 1 && it == n_tiles - 1);
      // ---- S = Q K^T over the K elements of this tile
      if constexpr (FP8_SCORES) {
        const int stage = count % STAGES;
        mbar_wait(sm.full + 8 * stage, (count / STAGES) & 1);
        trace_mark(it, 1);
        if constexpr (kKsMma) {
          // P V(t - 1) completes first: its P registers hold kb while S is in flight (both beside P and the
          // output made ptxas serialize the wgmmas, C7512)
          wgmma_wait<0>();
          fence_regs(o);
        }
        if (ring_wait) named_barrier_sync<256>(4 + wg);
        fence_proxy_async();
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < kQ8Steps; ++k) {
          const u32 qa = (u32)((k / 4) * BM * kAtomRowBytes + (k % 4) * 32);
          const u64 kd = buf.k_desc(stage, k / 4, k % 4);
          MmaS8::ss(s, desc_add(q_desc, qa), kd, k > 0);
          MmaS8::ss(s, desc_add(q_desc, qa + (u32)kQ8Half), kd, 1);
        }
        if constexpr (kKsMma)
          MmaKs::ss(kb, plain_desc(sm.kscale, 0, 128),
                    plain_desc(sm.kscale + (u32)(kKsOnesBytes + stage * (BN / 2) * kKsRowBytes), 0, 128), 0);
        wgmma_commit();
      } else {
        const u32 tb0 = CUKV_WAIT_STATS ? (u32)globaltimer_ns() : 0;
        if (ring_wait) named_barrier_sync<256>(4 + wg);
        if (CUKV_WAIT_STATS) ws_bar += (u32)globaltimer_ns() - tb0;
#pragma unroll
        for (int e = 0; e < kKElems; ++e) {
          const int stage = (count + e) % STAGES;
          const u32 tk0 = CUKV_WAIT_STATS ? (u32)globaltimer_ns() : 0;
          mbar_wait(sm.full + 8 * stage, ((count + e) / STAGES) & 1);
          if (CUKV_WAIT_STATS) {
            const u32 dk = (u32)globaltimer_ns() - tk0;
            ws_k += dk;
            if (early) ws_k_early += dk;
          }
          trace_mark(it, 1);
          fence_proxy_async();
          wgmma_fence();
#pragma unroll
          for (int k = 0; k < Buf::num_k_mmas2; ++k) {
            const int dim = e * BK + k * 16;
            if (dim < DEPTH) {
              const int qa = dim / 64;
              const u64 qd = desc_add(q_desc, (u32)(qa * BM * kAtomRowBytes + (dim % 64) * 2));
              MmaS::ss(s, qd, buf.k_desc(stage, k / 4, k % 4), e > 0 || k > 0);
            }
          }
          wgmma_commit();
        }
      }
      if (ring_pass) named_barrier_arrive<256>(ring_next);
      wgmma_wait<0>();
      trace_mark(it, 2);
      // PERSISTENT: the item's last S has read the staged query; warp 0 may stage the next item's
      if (PERSISTENT && it == n_tiles - 1 && lane == 0) mbar_arrive(sm.q_empty);
      fence_regs(s);
      fence_regs(o);
      if constexpr (kKsMma) {
        fence_regs(kb);
        // key columns 8j + 2c (+1): the first half's scales on row g's registers, the second's on row g + 8's
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          const int i = j < BN / 16 ? 4 * j : 4 * (j - BN / 16) + 2;
          s[4 * j] *= kb[i];
          s[4 * j + 1] *= kb[i + 1];
          s[4 * j + 2] *= kb[i];
          s[4 * j + 3] *= kb[i + 1];
        }
      } else if constexpr (FP8_SCORES && SCALE_BLOCK > 0) {
        // token K scales multiply the score columns (before the mask: a masked column's scale may be zero)
        const u32 ks = sm.kscale + (u32)(((count % STAGES) * BN + 2 * c) * 4);
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          float k0, k1;
          asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];" : "=f"(k0), "=f"(k1) : "r"(ks + (u32)(32 * j)) : "memory");
          s[4 * j] *= k0;
          s[4 * j + 1] *= k1;
          s[4 * j + 2] *= k0;
          s[4 * j + 3] *= k1;
        }
        __syncwarp();  // every lane has read the scales before lane 0 releases the element
      }
      // every wgmma so far is complete: release this tile's K elements and the previous tile's V
      if (lane == 0) {
        for (int e = 0; e < kKElems; ++e) mbar_arrive(sm.empty + 8 * ((count + e) % STAGES));
        if (pending_v >= 0) mbar_arrive(sm.empty + 8 * pending_v);
      }
      count += kKElems;

      // ---- scores, mask, online softmax (rows r0 and r1; 4 lanes share a row). Scores stay unscaled
      // until the exponent (one FMA); soft-cap and masks are uniform branches, not per-element selects.
      if (capped) {
#pragma unroll
        for (int i = 0; i < kSRegs; ++i) s[i] = a.softcap * tanhf(s[i] * (i % 4 < 2 ? cap0 : cap1));
      }
      const int key0 = n * BN;
      if (key0 + BN > wg_hi_min || key0 < wg_lo_max) {
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
          for (int h = 0; h < 4; ++h) {
            const int key = key0 + 8 * j + 2 * c + (h & 1);
            const bool vis = h < 2 ? (key >= lo0 && key < hi0) : (key >= lo1 && key < hi1);
            s[4 * j + h] = vis ? s[4 * j + h] : -CUKV_INF;  // select, never multiply: NaN cannot leak
          }
        }
      }
      float mx0 = m0, mx1 = m1;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        mx0 = fmaxf(mx0, fmaxf(s[4 * j], s[4 * j + 1]));
        mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
      }
      mx0 = quad_max(mx0);
      mx1 = quad_max(mx1);
      // The running max moves (and O is rescaled) only when some row of the warp grew past CUKV_RESCALE_LOG2; a row
      // seeing its first keys (m = -inf) always counts as grown, one with none still visible never does.
      const bool grow = !kLazyRescale || (mx0 - m0) * sl0 > (float)CUKV_RESCALE_LOG2 ||
                        (mx1 - m1) * sl1 > (float)CUKV_RESCALE_LOG2;
      if (!kLazyRescale || __any_sync(0xffffffffu, grow)) {
        const float alpha0 = fast_exp2(m0 * sl0 - exp_base(mx0, sl0)), alpha1 = fast_exp2(m1 * sl1 - exp_base(mx1, sl1));
        m0 = mx0;
        m1 = mx1;
        l0 *= alpha0;
        l1 *= alpha1;
#pragma unroll
        for (int j = 0; j < kORegs / 4; ++j) {
          o[4 * j] *= alpha0;
          o[4 * j + 1] *= alpha0;
          o[4 * j + 2] *= alpha1;
          o[4 * j + 3] *= alpha1;
        }
      }
      const float base0 = exp_base(m0, sl0), base1 = exp_base(m1, sl1);
      u32 p[BN / 2];
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const float e0 = fast_exp2(fmaf(s[4 * j], sl0, -base0)), e1 = fast_exp2(fmaf(s[4 * j + 1], sl0, -base0));
        const float e2 = fast_exp2(fmaf(s[4 * j + 2], sl1, -base1)), e3 = fast_exp2(fmaf(s[4 * j + 3], sl1, -base1));
        l0 += e0 + e1;
        l1 += e2 + e3;
        p[2 * j] = ElemTraits<PT>::pack(e0, e1);
        p[2 * j + 1] = ElemTraits<PT>::pack(e2, e3);
      }

      // ---- O += P V (P from registers: k16 step kk uses score columns 16kk .. 16kk + 15)
      const int vstage = count % STAGES;
      trace_mark(it, 3);
      const u32 tv0 = CUKV_WAIT_STATS ? (u32)globaltimer_ns() : 0;
      mbar_wait(sm.full + 8 * vstage, (count / STAGES) & 1);
      if (CUKV_WAIT_STATS) ws_v += (u32)globaltimer_ns() - tv0;
      trace_mark(it, 4);
      fence_proxy_async();
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        const u32 frag[4] = {p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3]};
        MmaO::rs(o, frag, buf.v_desc(vstage, kk), 1);
      }
      wgmma_commit();
      trace_mark(it, 5);
      if constexpr (PV_WAIT) {
        wgmma_wait<0>();
        fence_regs(o);
        if (lane == 0) mbar_arrive(sm.empty + 8 * vstage);
      } else {
        fence_regs(o);
        pending_v = vstage;
      }
      count += 1;
    }
    wgmma_wait<0>();
    fence_regs(o);
    if (lane == 0 && pending_v >= 0) mbar_arrive(sm.empty + 8 * pending_v);
    if (PERSISTENT && n_tiles == 0 && lane == 0) mbar_arrive(sm.q_empty);
#if CUKV_WAIT_STATS
    if (wq == 0 && lane == 0) {
      atomicAdd(&cukv_wait_stats[0], (unsigned long long)ws_k);
      atomicAdd(&cukv_wait_stats[1], (unsigned long long)ws_v);
      atomicAdd(&cukv_wait_stats[2], (unsigned long long)ws_bar);
      atomicAdd(&cukv_wait_stats[3], (unsigned long long)((u32)globaltimer_ns() - ws_t0));
      atomicAdd(&cukv_wait_stats[4], (unsigned long long)n_tiles);
      atomicAdd(&cukv_wait_stats[5], 1ull);
      atomicAdd(&cukv_wait_stats[6], (unsigned long long)ws_k_early);
      if (early) atomicAdd(&cukv_wait_stats[7], (unsigned long long)n_tiles);
    }
#endif

    // ---- epilogue: normalize, sink, write O and LSE
    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
    const float base0 = exp_base(m0, sl0), base1 = exp_base(m1, sl1);
    float d0 = l0, d1 = l1;
    if (a.sink != nullptr) {
      const float sk = a.sink[head] * kLog2e;
      d0 += fast_exp2(sk - base0);
      d1 += fast_exp2(sk - base1);
    }
    // V staged as codes: its tensor scale joins the normalization
    const float vs = kVCodes      ? cache.template load_scale<0>(false, 0, 0, 0)
                     : kOnceCodes ? Fp8Cache(once->fp8).template load_scale<0>(false, 0, 0, 0)
                                  : 1.f;
    const float inv0 = d0 > 0.f ? vs / d0 : 0.f, inv1 = d1 > 0.f ? vs / d1 : 0.f;
    T* out = static_cast<T*>(a.out);
    const int col_base = vslice * kVCols;
#pragma unroll
    for (int j = 0; j < kORegs / 4; ++j) {
      const int col = col_base + 8 * j + 2 * c;
      if (r0 < rows)
        *reinterpret_cast<u32*>(out + (i64)(q_begin + q0 + r0) * a.o_stride[0] + (i64)head * a.o_stride[1] + col) =
            ElemTraits<T>::pack(o[4 * j] * inv0, o[4 * j + 1] * inv0);
      if (r1 < rows)
        *reinterpret_cast<u32*>(out + (i64)(q_begin + q0 + r1) * a.o_stride[0] + (i64)head * a.o_stride[1] + col) =
            ElemTraits<T>::pack(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
    }
    if (a.lse != nullptr && c == 0 && vslice == 0) {
      if (r0 < rows)
        a.lse[(i64)(q_begin + q0 + r0) * a.num_qo_heads + head] = l0 > 0.f ? (base0 + __log2f(l0)) * kLn2 : -CUKV_INF;
      if (r1 < rows)
        a.lse[(i64)(q_begin + q0 + r1) * a.num_qo_heads + head] = l1 > 0.f ? (base1 + __log2f(l1)) * kLn2 : -CUKV_INF;
    }
  }
};

}  // namespace cukv
