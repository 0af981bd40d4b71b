// PrefillKernel<Traits>: the ragged prefill's derived sizes, shared-memory layout and member functions, declared
// here and defined by concern in prefill_scheduler.cuh, prefill_producer.cuh, prefill_once.cuh,
// prefill_consumer.cuh and prefill.cuh (run). Traits is the struct prefill.cu.j2 renders from PrefillConfig.
#pragma once
#include "prefill_args.cuh"
#include "debug.cuh"  // timing aids, off as shipped

namespace cukv {

template <class Traits>
struct PrefillKernel {
  // the rendered options (prefill_args.cuh describes each)
  typedef typename Traits::T T;
  // DEPTH: Q's and K's width; DEPTH_V: V's and the output's (the MHA prefill's are equal; MLA prefill: 192 and 128)
  static constexpr int DEPTH = Traits::head_dim, DEPTH_V = Traits::head_dim_v, BM = Traits::BM, BN = Traits::BN, BK = Traits::BK,
                       STAGES = Traits::stages, PAGE_SIZE = Traits::page_size, SCALE_BLOCK = Traits::scale_block,
                       TMA_ROWS = Traits::tma_rows, ONCE_PAGE = Traits::once_page;
  static constexpr bool QUANTIZED = Traits::quantized, FP8_SCORES = Traits::fp8_scores, PINGPONG = Traits::pingpong,
                        PERSISTENT = Traits::persistent, PV_WAIT = Traits::pv_wait;

  typedef KVBuffer<T, BN, BK, DEPTH, STAGES> Buf;
  typedef RingState<STAGES> Ring;  // a role's position in the K/V ring (Buf)
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
  static_assert(!PERSISTENT || kOnce || (!QUANTIZED && (kTma || DEPTH_V < DEPTH) && Buf::full_kv && kConsumerWGs > 1),
                "the persistent grid: convert-once's, or a 16-bit cache's by tensor copies (the MLA producer: either), "
                "the whole head in one element, beside a producer warpgroup");
  static_assert(!PINGPONG || kConsumerWGs > 1, "PINGPONG orders two or three consumer warpgroups");
  static constexpr int kThreads = (kConsumerWGs + 1) * 128;  // warpgroup 0 produces
  // Register split between the producer warpgroup and the consumers (setmaxnreg), decided by
  // PrefillConfig.producer_registers / consumer_registers (cukv/prefill_config.py); 0: no setmaxnreg (one consumer
  // warpgroup keeps the launch's registers).
  static constexpr int kProducerRegs = Traits::producer_regs;
  static constexpr int kConsumerRegs = Traits::consumer_regs;
  static_assert(kConsumerWGs == 1 ? kProducerRegs == 0
                                  : kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0 && kProducerRegs >= 24 &&
                                        kConsumerRegs <= 256,
                "setmaxnreg takes multiples of 8 in [24, 256]");
  // setmaxnreg.inc waits for registers the block's other warps released: the split must fit in what the launch
  // gave every thread (the register file over kThreads, in multiples of 8), or the consumers wait forever.
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8 > 255 ? 255 : (65536 / kThreads) / 8 * 8;
  static_assert(kConsumerWGs == 1 || (kProducerRegs + kConsumerWGs * kConsumerRegs) <= (kConsumerWGs + 1) * kLaunchRegs,
                "registers: the setmaxnreg split exceeds the launch allocation");
  static constexpr int kQAtoms = (DEPTH + 63) / 64;
  static constexpr int kVCols = DEPTH_V < BK ? DEPTH_V : BK;       // V width one block accumulates (one element)
  static constexpr int kVSlices = (DEPTH_V + kVCols - 1) / kVCols; // blocks per (tile, head) along V's dims
  static constexpr int kKElems = Buf::num_k_tiles;
  static constexpr int kSRegs = BN / 2, kORegs = kVCols / 2;
  // Online softmax (Traits::lazy_rescale): a warp keeps its rows' running max, and skips the output rescale, until
  // some row's tile max exceeds it by more than kRescaleLog2 powers of two in the exponent (P then stays below
  // 2^kRescaleLog2, exact in the float32 accumulators; the final normalization and the LSE use the same max). Most
  // tiles of a long row skip the per-tile O multiply, as FlashAttention 4 does. Off: O is rescaled every tile.
  static constexpr int kRescaleLog2 = 8;
  static constexpr bool kLazyRescale = Traits::lazy_rescale;
  // V with a per-tensor scale is staged as the codes' exact f16 values and P V runs in f16 (P in [0, 1] keeps
  // 11 bits there); the scale multiplies the output once. One cvt per code pair instead of six instructions.
  static constexpr bool kVCodes = QUANTIZED && SCALE_BLOCK == 0;
  // Convert-once with per-tensor scales: the workspace holds the codes' exact values and the two scales join the
  // consumers' score factor and output normalization, as kVCodes does for V. The matrix units then multiply 3-bit
  // mantissas instead of full ones, which draws less power where the prefill runs at the H100's power limit: 0-4%
  // faster (docs/tuning.md), and the scale is applied in float32 instead of rounded into bf16.
  static constexpr bool kOnceCodes = kOnce && SCALE_BLOCK == 0;
  // The producer converts in Buf::conv_chunk's row pairs (no bank conflict on its ring stores) where the raw slot
  // comes by TMA and only V is converted: elsewhere a lane converts the chunks it copied, and the producers that
  // also convert K spilled with the pairs' addressing (ptxas, 4-12 bytes).
  static constexpr bool kConvPairs = kTma && FP8_SCORES;
  typedef typename Select<kVCodes, __half, T>::type PT;  // P and the staged V
  // FP8 scores: the query as two e4m3 terms, each BM rows x kQ8Atoms atoms of 128 codes (lo kQ8Half after hi)
  static constexpr int kQ8Atoms = (DEPTH + 127) / 128;
  static constexpr int kQ8Steps = (DEPTH + 31) / 32;  // k32 steps of the e4m3 wgmma
  static constexpr int kQ8Half = BM * kQ8Atoms * kAtomRowBytes;
  // Shared memory, in this order from a 1024-byte aligned base: the staged query (kQBytes), the ring, the raw slots
  // (kRawBytes), the K scales (kKScaleBytes), the output staging (kOutBytes, tma_store), then the barriers and the
  // persistent grid's staged item. The sizes are decided by PrefillConfig (q_bytes, raw_bytes, kscale_bytes,
  // smem_bytes; MLAPrefillConfig: out_bytes); here they are only checked to hold what the code below stores there.
  static constexpr int kQBytes = Traits::q_bytes;
  static_assert(kQBytes >= (FP8_SCORES ? 2 * kQ8Half : BM * kQAtoms * kAtomRowBytes) && kQBytes % 1024 == 0,
                "the staged query: BM rows of every atom (FP8 scores: two e4m3 terms), whole 1024-byte swizzle groups");
  // FP8 scores with token scales: the K rows' scales beside each ring element. kKsMma (TMA producer, BN a multiple of
  // 32, heads up to 128: d256's tile has no room for the extra 2 KB): they reach the consumers' score columns through
  // the tensor cores. Per ring element the producer writes B, BN/2 rows of 16 bytes: row j holds the scales of keys j
  // and j + BN/2 as three bf16 terms each (hi + mid + lo == the float32 scale exactly). A fixed A (64 rows of 16
  // bytes, 0.5 in row group 0's first three columns and row group 1's next three, alternating every 8 rows) makes one
  // m64n(BN/2)k16 wgmma give every thread the scales of its BN/4 score columns in accumulator order (rows g and g + 8
  // carry the two halves of the keys; both descriptors read their one 16-byte column twice, LBO = 0, hence the 0.5).
  // It replaces BN/8 LDS.64 per thread and tile, whose shared-memory wavefronts queued behind the wgmma operand reads
  // (docs/tuning.md). Otherwise the consumers load the scales from a float per row.
  // Decided by PrefillConfig.ks_mma (cukv/prefill_config.py); here only its prerequisites are checked.
  static constexpr bool kKsMma = Traits::ks_mma;
  static_assert(!kKsMma || (FP8_SCORES && SCALE_BLOCK > 0 && kTma && BN % 32 == 0),
                "K scales by wgmma: token scales of e4m3 scores from tensor copies, m64n(BN/2)k16 in multiples of 16");
  static constexpr int kKsOnesBytes = 64 * 16, kKsRowBytes = 16;
  static constexpr int kKScaleBytes = Traits::kscale_bytes;
  static_assert(kKScaleBytes >= (kKsMma                           ? kKsOnesBytes + STAGES * (BN / 2) * kKsRowBytes
                                 : FP8_SCORES && SCALE_BLOCK > 0 ? STAGES * BN * 4
                                                                 : 0),
                "the K scales of every ring element (kKsMma: and the fixed A)");
  static constexpr int kRingBytes = STAGES * Buf::stage_bytes;
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
  static constexpr int kRawBytes = Traits::raw_bytes;
  static_assert(kRawBytes >= (kOnce ? (Buf::kProducerWarps - kOnceFirstQuarter) * kOnceQuarterBytes : 2 * kRawTileBytes),
                "two raw tile slots (convert once: a quarter per converter warp)");
  static_assert(!kOnce || kOnceElemBytes * Buf::kProducerWarps == kRawElemBytes, "a quarter's rows, K or V");
  // FP8 TMA: one per raw slot; PERSISTENT: q_empty and the staged item (kItemInts), and for a 16-bit cache the next
  // item's index in two slots (kNextInts: the producer warps read it after a named barrier, see feed_persistent_16)
  static constexpr int kItemInts = 10, kNextInts = PERSISTENT && !kOnce ? 2 : 0;
  static constexpr int kBarBytes =
      (2 * STAGES + 1 + (kTma && QUANTIZED ? 2 : 0) + (PERSISTENT ? 1 + ((kItemInts + kNextInts) * 4 + 7) / 8 : 0)) * 8;
  // tma_store: each consumer warp writes its 16 output rows into its own staging tile (kOutAtoms 128-byte swizzle atoms
  // of 16 rows, through stmatrix: no bank conflict) and stores them with one tensor copy per atom (store_output_tma),
  // instead of each thread's 4-byte pairs straight to global memory; a warp whose rows cross the item's end copies its
  // rows from the tile with 16-byte stores. Decided by the config's tma_store (cukv/configs/mla_prefill.py); the MHA
  // prefill renders it off.
  static constexpr bool kTmaStore = Traits::tma_store;
  static constexpr int kOutAtoms = (kVCols + 63) / 64, kOutAtomBytes = 16 * kAtomRowBytes;
  static constexpr int kOutWarpBytes = kOutAtoms * kOutAtomBytes;
  static constexpr int kOutBytes = Traits::out_bytes;
  static_assert(!kTmaStore || (kOutBytes >= 4 * kConsumerWGs * kOutWarpBytes && kVSlices == 1 && kVCols % 64 == 0 &&
                               sizeof(T) == 2 && (kQBytes + kRingBytes + kRawBytes + kKScaleBytes) % 1024 == 0),
                "output staging: a tile per consumer warp of whole 64-column atoms (one V slice), 1024-byte aligned");
  static_assert(kTmaStore || kOutBytes == 0, "output staging only with tma_store");
  static constexpr int kSmemBytes = Traits::smem_bytes;
  static_assert(1024 /* alignment slack */ + kQBytes + kRingBytes + kRawBytes + kKScaleBytes + kOutBytes + kBarBytes <=
                    kSmemBytes,
                "the shared-memory layout fits the launch's dynamic shared memory");
  static_assert(kKScaleBytes % 16 == 0 && kRawBytes % 16 == 0 && Buf::stage_bytes % 1024 == 0,
                "16-byte raw and scale rows, 1024-byte aligned ring elements");
  static_assert(BM % 64 == 0 && BM <= 192, "BM: one to three consumer warpgroups");
  static_assert(DEPTH % 16 == 0, "head dims are multiples of 16");
  static_assert(Buf::full_kv ? BK == kQAtoms * 64 : DEPTH % BK == 0, "BK covers the head, or divides it");
  static_assert(kVCols % 16 == 0 && kVCols <= 256, "one wgmma spans V's columns");
  static_assert(DEPTH_V <= DEPTH && (DEPTH_V == DEPTH || (Buf::full_kv && !QUANTIZED && !kTma)),
                "a V narrower than K (MLA prefill): 16-bit, the whole head in one ring element, fed by the MLA "
                "producer (its own tensor copies: kTma describes the MHA producer's)");
  static_assert(STAGES >= kKElems + 1, "the ring holds a tile's K elements and the previous V element");

  // convert once: converting ahead stops when the block's ring feeder has fewer tiles left than this (0 and 1
  // measured slower: a quarter in flight then outlives the block's consumers; docs/tuning.md)
  static constexpr int kOnceMinLeft = 2;

  // One work item: BM query rows of one (sequence, query head) and the key tiles they see.
  struct Item {
    int b, head, kv_head, q_begin, q0, rows, kv_len, shift, n_first, n_tiles;  // b < 0: no more items
  };
  static_assert(sizeof(Item) == kItemInts * 4, "Item is staged in shared memory as kItemInts ints");

  struct Smem {
    u32 q, ring, raw, kscale, out;
    u32 full, empty, q_full, raw_full;  // barrier addresses
    u32 q_empty, item, next;            // PERSISTENT
  };

  static __device__ __forceinline__ Smem carve(unsigned char* raw) {
    Smem s;
    u32 base = (smem_addr(raw) + 1023u) & ~1023u;
    s.q = base;
    s.ring = base + kQBytes;
    s.raw = base + kQBytes + kRingBytes;
    s.kscale = s.raw + kRawBytes;
    s.out = s.kscale + kKScaleBytes;
    s.full = s.out + kOutBytes;
    s.empty = s.full + 8 * STAGES;
    s.q_full = s.empty + 8 * STAGES;
    s.raw_full = s.q_full + 8;
    s.q_empty = s.q_full + 8;  // PERSISTENT (never QUANTIZED: no raw_full)
    s.item = s.q_full + 16;
    s.next = s.item + 4 * kItemInts;
    return s;
  }

  // ---- tile scheduler (prefill_scheduler.cuh): visible keys, work items, the persistent grid's staging
  static __device__ __forceinline__ int key_hi(const PrefillArgs& a, int p, int kv_len);
  static __device__ __forceinline__ int key_lo(const PrefillArgs& a, int p);
  static __device__ __forceinline__ void store_item(u32 addr, const Item& t);
  static __device__ __forceinline__ Item load_item(u32 addr);
  static __device__ __forceinline__ Item make_item(const PrefillArgs& a, const OnceArgs* once, const Cache& cache,
                                                   int w, int head);
  static __device__ __forceinline__ Item make_item(const PrefillArgs& a, const OnceArgs* once, const Cache& cache,
                                                   int i);
  static __device__ __forceinline__ void stage_item(const Smem& sm, const CUtensorMap* qmap, const Item& t);

  // ---- the kernel (prefill.cuh): barriers, register split, roles
  static __device__ void run(const PrefillArgs& a, const PrefillMaps* maps, const OnceArgs* once = nullptr,
                             const CUtensorMap* qmap = nullptr);
  static __device__ __forceinline__ void init_barriers(const Smem& sm);
  // PERSISTENT: a consumer warp's walk over the items the producer stages (sm.item), until one with b < 0
  // (tma_store: omap is the output's tensor map, and every bulk group has completed when it returns)
  static __device__ __forceinline__ void consume_persistent(const PrefillArgs& a, const Smem& sm, const Buf& buf,
                                                            const Cache& cache, int warp, int lane,
                                                            const OnceArgs* once, const CUtensorMap* omap = nullptr);

  // ---- producer (prefill_producer.cuh): the query and the K/V ring, by cp.async or TMA (16-bit and FP8 caches)
  static __device__ __forceinline__ void load_query(const PrefillArgs& a, const Smem& sm, int head, int q_begin, int q0,
                                                    int rows, int pw, int lane);
  static __device__ __forceinline__ void produce(const PrefillArgs& a, const PrefillMaps* maps, const Smem& sm,
                                                 const Buf& buf, const Cache& cache, int b, int kv_head, int head,
                                                 int q_begin, int q0, int rows, int kv_len, int n_first, int n_tiles,
                                                 int vslice, int pw, int lane, Ring& ring);
  static __device__ __forceinline__ void produce_fp8(const PrefillArgs& a, const PrefillMaps* maps, const Smem& sm,
                                                     const Buf& buf, const Cache& cache, int b, int kv_head, int kv_len,
                                                     int n_first, int n_tiles, int vslice, int pw, int lane);
  static __device__ __forceinline__ void issue_fp8(const PrefillArgs& a, const PrefillMaps* maps, const Smem& sm,
                                                   const Buf& buf, const Cache& cache, int b, int kv_head, int kv_len,
                                                   int vslice, int pw, int lane, const KVT* kbase, const KVT* vbase,
                                                   int n, i64 key_lane, int t, float& ks_held, int& ks_stage);
  static __device__ __forceinline__ void produce_16(const PrefillArgs& a, const PrefillMaps* maps, const Smem& sm,
                                                    const Buf& buf, const Cache& cache, int b, int kv_head, int kv_len,
                                                    int n_first, int n_tiles, int vslice, int pw, int lane,
                                                    i64 key_next, const KVT* kbase, const KVT* vbase, Ring& ring);
  // PERSISTENT (16-bit): the producer warpgroup's walk over the work items; produce_item(t) issues item t's tiles
  template <class ProduceItem>
  static __device__ __forceinline__ void feed_items(const PrefillArgs& a, const OnceArgs& o, const CUtensorMap* qmap,
                                                    const Smem& sm, const Cache& cache, int pw, int lane,
                                                    ProduceItem&& produce_item);
  static __device__ __forceinline__ void feed_persistent_16(const PrefillArgs& a, const PrefillMaps* maps,
                                                            const OnceArgs& o, const CUtensorMap* qmap, const Smem& sm,
                                                            const Buf& buf, const Cache& cache, int pw, int lane);

  // ---- convert-once producer (prefill_once.cuh): the ring fed from a workspace the converter warps fill
  static __device__ __forceinline__ void feed_once(const PrefillMaps* maps, const OnceArgs& o, const Smem& sm,
                                                   const Buf& buf, int ws0, int kv_head, int n_first, int n_tiles,
                                                   Ring& ring, int lane);
  static __device__ __forceinline__ float tensor_scale(const Fp8Cache& f, bool is_k);
  static __device__ __forceinline__ int* once_flag(const OnceArgs& o, int ws0, int n, int k, int q);
  static __device__ __forceinline__ void convert_quarter(const PrefillArgs& a, const OnceArgs& o, const Smem& sm,
                                                         const Buf& buf, const Fp8Cache& f, float k_scale,
                                                         float v_scale, int b, int kv_len, int ws0, int n, int k, int q,
                                                         u32 quarter, int lane);
  static __device__ __forceinline__ void produce_once(const PrefillArgs& a, const PrefillMaps* maps, const OnceArgs& o,
                                                      const Smem& sm, const Buf& buf, const Cache& ws, int b,
                                                      int kv_head, int head, int q_begin, int q0, int rows, int kv_len,
                                                      int n_first, int n_tiles, int pw, int lane);
  static __device__ __forceinline__ void feed_persistent(const PrefillArgs& a, const PrefillMaps* maps,
                                                         const OnceArgs& o, const CUtensorMap* qmap, const Smem& sm,
                                                         const Buf& buf, const Cache& ws, int lane);
  static __device__ __forceinline__ u32 raw_quarter(const Smem& sm, int pw);
  static __device__ __forceinline__ void convert_persistent(const PrefillArgs& a, const OnceArgs& o, const Smem& sm,
                                                            const Buf& buf, const Cache& ws, u32 quarter, int lane);

  // ---- consumer (prefill_consumer.cuh): S = Q K^T, mask, online softmax, O += P V, epilogue
  typedef Wgmma<T, BN> MmaS;                                     // S = Q K^T, 16-bit
  typedef Wgmma8<BN> MmaS8;                                      // S = Q K^T, e4m3 (FP8 scores)
  typedef Wgmma<__nv_bfloat16, kKsMma ? BN / 2 : 16> MmaKs;     // kKsMma: the K scales
  typedef Wgmma<PT, kVCols> MmaO;                                // O += P V
  static __device__ __forceinline__ void split_query(const PrefillArgs& a, const Smem& sm, int head, int q_begin,
                                                     int q0, int rows, int r0, int r1, int c, float& f0, float& f1);
  static __device__ __forceinline__ float exp_base(float m, float sl);
  static __device__ __forceinline__ void consume(const PrefillArgs& a, const Smem& sm, const Buf& buf,
                                                 const Cache& cache, int head, int q_begin, int q0, int rows,
                                                 int kv_len, int shift, int n_first, int n_tiles, int vslice, int warp,
                                                 int lane, Ring& ring, int q_phase, const OnceArgs* once = nullptr,
                                                 const CUtensorMap* omap = nullptr);
  static __device__ __forceinline__ void issue_scores(const Smem& sm, const Buf& buf, const Ring& ring, u64 q_desc,
                                                      float (&s)[kSRegs], float (&kb)[MmaKs::kRegs],
                                                      float (&o)[kORegs], int wg, int it, bool ring_wait,
                                                      WaitStats& ws);
  static __device__ __forceinline__ void scale_scores(const Smem& sm, const Ring& ring, float (&s)[kSRegs],
                                                      float (&kb)[MmaKs::kRegs], int c);
  static __device__ __forceinline__ void mask_scores(float (&s)[kSRegs], int key0, int c, int lo0, int hi0, int lo1,
                                                     int hi1);
  static __device__ __forceinline__ void row_max(const float (&s)[kSRegs], float& mx0, float& mx1);
  static __device__ __forceinline__ void stage_query(const PrefillArgs& a, const Smem& sm, const Cache& cache,
                                                     const OnceArgs* once, int head, int q_begin, int q0, int rows,
                                                     int r0, int r1, int c, int wg, int q_phase, float& f0, float& f1);
  static __device__ __forceinline__ void store_output(const PrefillArgs& a, const Cache& cache, const OnceArgs* once,
                                                      const float (&o)[kORegs], float l0, float l1, float m0, float m1,
                                                      float sl0, float sl1, int r0, int r1, int head, int q_begin, int q0,
                                                      int rows, int vslice, int c, const Smem& sm,
                                                      const CUtensorMap* omap);
  static __device__ __forceinline__ void store_output_tma(const PrefillArgs& a, const Smem& sm,
                                                          const CUtensorMap* omap, const float (&o)[kORegs],
                                                          float inv0, float inv1, int r0, int head, int token0,
                                                          int rows, int col_base);
  // tma_store: this warp's bulk groups have completed (before the block exits)
  static __device__ __forceinline__ void drain_output(int lane) {
    if constexpr (kTmaStore) {
      if (lane == 0) tma_store_wait<0>();
    }
  }
};

}  // namespace cukv
