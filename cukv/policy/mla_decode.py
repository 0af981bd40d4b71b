"""MLA decode policy: the default tile of an :class:`~cukv.configs.mla_decode.MLADecodeConfig` and the work list
``BatchMLADecode.plan`` builds (chunk length per batch). Measurements: docs/tuning.md ("MLA decode").

Examples
--------
>>> from cukv.policy.mla_decode import plan_items
>>> items, chunk_tiles = plan_items([4096, 100], row_blocks=1, block_n=64, num_sms=8)
>>> chunk_tiles, len(items), items[0]          # (batch, row block, first token, end token, chunks of that row)
(10, 8, (0, 0, 0, 640, 7))
"""
from __future__ import annotations

import heapq

import numpy as np

from ..configs.mla_decode import BLOCK_M, NARROW_ROWS, MLADecodeConfig
from ..configs.sparse_mla import SparseMLAConfig

#: tokens per K tile: 64 (block_n 32 with 4 stages was 11-40% slower on every bench shape; docs/tuning.md)
DEFAULT_BLOCK_N = 64
#: K tiles in the ring: 2 is all that fits beside the 72 KB query block at block_n 64 (docs/tuning.md)
DEFAULT_STAGES = 2
#: the consumers' schedule: "alternate" (each warpgroup scores every other tile whole) measured 5-8% slower
#: (docs/tuning.md "MLA decode")
DEFAULT_SCHEDULE = "split"
#: per-slice ring barriers (``MLADecodeConfig.slice_release``, with the alternating schedule) from this many heads on,
#: where they apply (16-bit cache, tensor copies): 1.02-1.10x the split schedule at h128, 0.93-0.95x at h16-h64 and
#: b1, where memory binds (H200, docs/tuning.md "MLA decode")
SLICE_RELEASE_MIN_HEADS = 128
#: full tiles of a 16-bit cache by TMA tensor copies (page sizes from 8 that tile 64): 4-12% faster than cp.async on
#: every bench shape, same output bits (docs/tuning.md "MLA decode")
DEFAULT_TMA = True
#: the producer's L2 prefetch distance in tiles, by cache: an FP8 producer's loads are synchronous (latency-bound),
#: one tile ahead made it 7-9% faster beside the split consumers (2 no better); the 16-bit producer's cp.async copies
#: lost 10-12% with it (H200, benchmarks/probe_mla_fp8.py; docs/tuning.md "MLA decode")
DEFAULT_PREFETCH = {None: 0, "fp8_e4m3": 1}
#: beside the narrow consumers the FP8 producer takes no L2 prefetch: 1-4 tiles ahead were 9-17% slower (H100)
NARROW_FP8_PREFETCH = 0
#: the FP8 producer issues a tile's rope copies before its code loads (``MLADecodeConfig.fp8_rope_first``), by kernel:
#: 3.5-5.5% faster beside the split consumers and 1.6% in the narrow sparse kernel (H100); the narrow dense kernel keeps
#: them behind each row's codes (5% faster there), as do 32-token tiles (the rope-first sparse kernel spills 8 bytes)
FP8_ROPE_FIRST = {"split": True, "narrow": False, "sparse": True}
#: FP8 rows each producer lane loads before dequantizing (16: one batch a tile; 1-5% faster than 8, same calls)
DEFAULT_FP8_ROWS = 16
#: the per-slice kernels' chunks run as cluster pairs of their two row blocks, each full tile copied once and
#: multicast into both (``MLADecodeConfig.multicast``; where the row blocks are even in number): 4-7% faster at b128
#: h128, 1% at s_q 2, level on the skewed batch's 40-tile chunks, 7% slower on b1's 8-tile ones (H100, docs/tuning.md)
DEFAULT_MULTICAST = True
#: ... so only where the plan's chunks hold at least this many tiles
MULTICAST_MIN_TILES = 64
#: an FP8 cache's "split" kernel with ``multicast``: each block of the pair dequantizes half of every tile and copies
#: it into the other's stage, 8 rows a producer lane, without L2 prefetch: 7-11% faster at b128 h128 (prefetch 1:
#: 4-9%; the next half's loads issued before the wait for its stage: 1-5%), 7% slower at b1 (H100, docs/tuning.md)
FP8_PAIR_ROWS, FP8_PAIR_PREFETCH = 8, 0
#: sparse MLA with FP8 rows and 128 heads: a token's two row blocks as a cluster pair sharing the dequantization
#: (``SparseMLA(multicast=True)``): level with the kernel without it on its 32-tile lists, 1.006x the time at b128 and
#: b8 s_q 2 (H100, docs/tuning.md), so off
SPARSE_MULTICAST = False
#: sparse MLA over 16-bit rows from this many heads on: the alternating consumers over per-slice barriers, each slice
#: gathered as it frees (``SparseMLA(schedule="alternate")``; docs/tuning.md "Sparse MLA")
SPARSE_SLICES_MIN_HEADS = 64
#: with them, a token's two row blocks (128 heads) as a cluster pair, each gathering half of every slice and forwarding
#: it into the other (``SparseMLA(multicast=)``)
SPARSE_SLICES_MULTICAST = False
#: with them, persistent blocks (``SparseMLA(persistent=)``): one per SM walking every grid-th token's row block
SPARSE_PERSISTENT = False
#: with them (one item a block), the next wave's query block into L2 once an item's tiles are issued
#: (``SparseMLAConfig.next_q``): 0.975-0.997x the time at h128 and h64 (H200, docs/tuning.md "Sparse MLA")
SPARSE_NEXT_Q = True
#: the consumers' lazy O rescale (``MLADecodeConfig.lazy_rescale``): a thread's 128 O values are rescaled only when a
#: row's max grows by 2^8: 1.04-1.06x at h128, 1.03-1.05x sparse prefill, 1.01-1.02x FP8 sparse decode, level where
#: memory binds (H100, benchmarks/probe_mla_rescale.py; docs/tuning.md "MLA decode")
DEFAULT_LAZY_RESCALE = True
#: the "narrow" consumers (tokens as the wgmma M, query rows as N) for a batch of at most this many query rows
#: (``s_q * num_heads``), in blocks of 16 or 32 rows (docs/tuning.md "MLA decode")
NARROW_MAX_ROWS = 32
#: a block's fixed cost (query load, ring fill, epilogue, combine share) in K tiles, fitted to H200 timings
#: (docs/tuning.md "MLA decode")
ITEM_OVERHEAD_TILES = 8.0
#: persistent blocks for the per-slice kernels (``MLADecodeConfig.persistent``): off until measured faster
DEFAULT_PERSISTENT = False
#: chunks per (sequence, row block): the combine kernel's shared arrays (kMlaMaxChunks in mla_decode_combine.cuh)
MAX_CHUNKS = 512

#: combine kernel blocks per SM (its grid strides over the rows to merge): 16 blocks of 128 threads fill an SM's
#: 2048 threads
COMBINE_BLOCKS_PER_SM = 16


def _even_row_blocks(rows: int | None) -> bool:
    """Whether ``rows`` (known) make an even count of 64-row blocks, as cluster pairs of row blocks need."""
    return rows is not None and (-(-rows // BLOCK_M)) % 2 == 0


def _makespan(costs: list[float], slots: int) -> float:
    """Finish time of blocks of these costs launched in order onto ``slots`` SMs (each takes the next block)."""
    heap = [0.0] * min(slots, len(costs))
    for c in costs:
        heapq.heapreplace(heap, heap[0] + c)
    return max(heap) if heap else 0.0


def plan_items(lengths, row_blocks: int, block_n: int, num_sms: int, chunk_tiles: int | None = None):
    """The work list: ``(batch, row_block, begin, end, chunks)`` items, longest first, and the chunk length in tiles.

    A chunk length of ``c`` tiles cuts each sequence of ``n`` tiles into ``ceil(n / c)`` chunks. Chunk lengths
    are tried from the one that fills every SM twice up to the longest sequence; the one whose greedy
    schedule (blocks taken in launch order by the first free SM, each costing its tiles plus
    ``ITEM_OVERHEAD_TILES``) ends first wins, the longest among near ties (fewer partials to merge)."""
    tiles = [-(-int(n) // block_n) for n in lengths]
    total = row_blocks * sum(tiles)
    most = max(tiles + [1])
    least = max(1, -(-total // (2 * num_sms)), -(-most // MAX_CHUNKS))  # <= 2 chunks per SM (+ 1 per row block)
    if chunk_tiles is None:
        cands = sorted({max(least, -(-most // k)) for k in range(1, most + 1) if -(-most // k) >= least}
                       | {least, most})
        if len(cands) > 48:
            idx = np.unique(np.geomspace(1, len(cands), 48).astype(int) - 1)
            cands = [cands[i] for i in idx]
        best = None
        for c in cands:
            costs = sorted((min(c, t - j * c) + ITEM_OVERHEAD_TILES for t in tiles for j in range(max(1, -(-t // c)))
                            for _ in range(row_blocks)), reverse=True)
            span = _makespan(costs, num_sms)
            if best is None or span < best[0] * 0.99 or (span <= best[0] * 1.01 and c > best[1]):
                best = (min(span, best[0]) if best else span, c)
        chunk_tiles = best[1]
    c = max(1, int(chunk_tiles), -(-most // MAX_CHUNKS))
    items = []
    for b, t in enumerate(tiles):
        n_chunks = max(1, -(-t // c))
        for j in range(n_chunks):
            begin = j * c * block_n
            end = min(int(lengths[b]), (j + 1) * c * block_n)
            items.extend((b, rb, begin, end, n_chunks) for rb in range(row_blocks))
    # longest first; a chunk's row blocks stay side by side (they read the same rows: the later ones from L2), in
    # pairs at even indices when row_blocks is even (MLADecodeConfig.multicast's cluster pairs)
    items.sort(key=lambda x: -(x[3] - x[2]))
    return items, c


def _narrow(rows: int | None, block_n: int | None) -> bool:
    """Whether ``rows`` query rows (``s_q * num_heads``; sparse MLA: heads) take the narrow consumers by default."""
    return rows is not None and rows <= NARROW_MAX_ROWS and block_n in (None, 64)


def _rope_first(kv_dtype: str | None, block_n: int, kernel: str) -> bool:
    """``MLADecodeConfig.fp8_rope_first`` for a ``kernel`` of :data:`FP8_ROPE_FIRST` (a schedule, or "sparse"); off
    for one it does not list (an FP8 cache's config for it then fails its own checks, naming the field)."""
    return kv_dtype is not None and block_n == 64 and FP8_ROPE_FIRST.get(kernel, False)


def mla_decode_config(dtype: str = "bfloat16", kv_dtype: str | None = None, block_n: int | None = None,
                      num_kv_stages: int | None = None, schedule: str | None = None,
                      tma: bool | None = None, prefetch_tiles: int | None = None,
                      fp8_rows: int | None = None, slice_release: bool | None = None,
                      num_heads: int | None = None, rows: int | None = None,
                      multicast: bool | None = None, chunk_tiles: int | None = None,
                      persistent: bool | None = None) -> MLADecodeConfig:
    """The config ``BatchMLADecode`` compiles: the caller's fields, None resolved to the defaults above (the lazy
    rescale always on; an FP8 cache keeps the "split" or "narrow" schedule, the ones it compiles without spills,
    and cp.async; ``slice_release`` asks for the alternating schedule, and is on by default from
    :data:`SLICE_RELEASE_MIN_HEADS` ``num_heads``; ``multicast``, for the per-slice kernels and an FP8 cache's
    "split" one, by default :data:`DEFAULT_MULTICAST` where ``rows`` make an even count of 64-row blocks and the
    plan's ``chunk_tiles``, when known, are at least :data:`MULTICAST_MIN_TILES`; an FP8 pair's producer
    defaults are :data:`FP8_PAIR_ROWS` and :data:`FP8_PAIR_PREFETCH`). ``rows`` (``s_q * num_heads``, when known)
    picks the "narrow" schedule up to :data:`NARROW_MAX_ROWS` and its block of 16 or 32 rows. ``persistent`` (per-slice
    kernels only) defaults to :data:`DEFAULT_PERSISTENT`."""
    asked_pf, asked_rows = prefetch_tiles, fp8_rows
    if schedule is None and not slice_release and _narrow(rows, block_n):
        schedule = "narrow"
    block_rows = BLOCK_M
    if schedule == "narrow":
        block_rows = NARROW_ROWS[0] if rows is not None and rows <= NARROW_ROWS[0] else NARROW_ROWS[-1]
        slice_release = False if slice_release is None else slice_release
    if slice_release is None:  # the default where it applies: 16-bit rows by tensor copies, alternating consumers
        slice_release = (num_heads is not None and num_heads >= SLICE_RELEASE_MIN_HEADS and kv_dtype is None
                         and schedule in (None, "alternate") and tma is not False and not prefetch_tiles)
    if schedule is None:
        schedule = "alternate" if slice_release else DEFAULT_SCHEDULE if kv_dtype is None else "split"
    if tma is None:  # tensor copies feed 16-bit tiles and take no L2 prefetch
        tma = DEFAULT_TMA and kv_dtype is None and not prefetch_tiles
    block_n = DEFAULT_BLOCK_N if block_n is None else block_n
    if prefetch_tiles is None:
        prefetch_tiles = NARROW_FP8_PREFETCH if kv_dtype is not None and schedule == "narrow" else \
            DEFAULT_PREFETCH[kv_dtype]
    if fp8_rows is None:  # 16 rows need 16 per warp and tile (block_n 64); the 32-row narrow consumers spill with them
        fp8_rows = (DEFAULT_FP8_ROWS if kv_dtype is not None and DEFAULT_FP8_ROWS <= block_n // 4
                    and not (schedule == "narrow" and block_rows > NARROW_ROWS[0]) else 8)
    pair_fp8 = kv_dtype is not None and schedule == "split" and block_n == 64  # FP8 rows shared by a pair
    if multicast is None:  # cluster pairs of row blocks: an even count of them
        multicast = (DEFAULT_MULTICAST and (slice_release or (pair_fp8 and asked_rows in (None, FP8_PAIR_ROWS)))
                     and _even_row_blocks(rows) and (chunk_tiles is None or chunk_tiles >= MULTICAST_MIN_TILES))
    if multicast and pair_fp8:
        fp8_rows = FP8_PAIR_ROWS if asked_rows is None else asked_rows
        prefetch_tiles = FP8_PAIR_PREFETCH if asked_pf is None else asked_pf
    persistent = DEFAULT_PERSISTENT and slice_release if persistent is None else persistent
    return MLADecodeConfig(dtype, block_n, DEFAULT_STAGES if num_kv_stages is None else num_kv_stages, kv_dtype,
                           schedule, tma=tma, prefetch_tiles=prefetch_tiles, fp8_rows=fp8_rows,
                           slice_release=slice_release, lazy_rescale=DEFAULT_LAZY_RESCALE, block_rows=block_rows,
                           fp8_rope_first=_rope_first(kv_dtype, block_n, schedule), multicast=bool(multicast),
                           persistent=bool(persistent))


def sparse_mla_config(dtype: str = "bfloat16", kv_dtype: str | None = None, block_n: int | None = None,
                      num_kv_stages: int | None = None, num_heads: int | None = None,
                      schedule: str | None = None, multicast: bool | None = None,
                      persistent: bool | None = None) -> SparseMLAConfig:
    """The config ``SparseMLA`` compiles: the decode's tile and a schedule ("narrow" up to :data:`NARROW_MAX_ROWS`
    heads; with 16-bit rows and 64-token tiles, "alternate" over per-slice barriers from
    :data:`SPARSE_SLICES_MIN_HEADS`, its cluster pair per :data:`SPARSE_SLICES_MULTICAST`; else "split", FP8 rows
    paired per :data:`SPARSE_MULTICAST`), and for FP8 rows its producer defaults (L2 prefetch, rows in flight); sparse
    rows always come by cp.async (each row its own gather); persistent blocks (:data:`SPARSE_PERSISTENT`) where the
    per-slice consumers run without the pair, else their next wave's query block prefetch (:data:`SPARSE_NEXT_Q`)."""
    if schedule is None:
        slices_apply = (kv_dtype is None and block_n in (None, 64) and num_heads is not None
                        and num_heads >= SPARSE_SLICES_MIN_HEADS)
        schedule = "narrow" if _narrow(num_heads, block_n) else "alternate" if slices_apply else "split"
    slices = schedule == "alternate"  # the alternating consumers over per-slice barriers, each slice gathered
    pair = False
    if slices:  # a token's two row blocks share each slice's gathers (an even count of row blocks)
        pair = SPARSE_SLICES_MULTICAST and _even_row_blocks(num_heads) if multicast is None else multicast
    elif multicast is None and not SPARSE_MULTICAST:
        multicast = False  # else the decode's rule: FP8 rows, "split", an even count of row blocks
    ps = bool((SPARSE_PERSISTENT if persistent is None else persistent) and slices and not pair)
    d = mla_decode_config(dtype, kv_dtype, block_n, num_kv_stages, schedule, tma=False, rows=num_heads,
                          multicast=False if slices else multicast, slice_release=False)
    return SparseMLAConfig(d.dtype, d.block_n, d.num_kv_stages, d.kv_dtype, d.schedule, tma=False,
                           slice_release=slices,
                           prefetch_tiles=d.prefetch_tiles, fp8_rows=d.fp8_rows, lazy_rescale=d.lazy_rescale,
                           block_rows=d.block_rows, fp8_rope_first=_rope_first(d.kv_dtype, d.block_n, "sparse"),
                           multicast=bool(pair) if slices else d.multicast,
                           persistent=ps, next_q=SPARSE_NEXT_Q and slices and not ps)


def shipped() -> list[MLADecodeConfig]:
    """The MLA decode specializations compiled ahead of time (cukv/specs.py): the default configs of each 16-bit
    dtype and of an FP8 cache (few heads, and from :data:`SLICE_RELEASE_MIN_HEADS` on, with cluster pairs and
    without)."""
    narrow = [mla_decode_config(dt, kvd, rows=r) for dt, kvd in (("bfloat16", None), ("float16", None),
                                                                 ("bfloat16", "fp8_e4m3")) for r in NARROW_ROWS]
    wide = SLICE_RELEASE_MIN_HEADS  # the h128 kernels with and without cluster pairs (by chunk length)
    pairs = [mla_decode_config(dt, kvd, num_heads=wide, rows=wide, multicast=mc)
             for dt, kvd in (("bfloat16", None), ("float16", None), ("bfloat16", "fp8_e4m3")) for mc in (True, False)]
    return [mla_decode_config(dt) for dt in ("bfloat16", "float16")] + pairs + narrow


def sparse_shipped() -> list[SparseMLAConfig]:
    """The sparse MLA specializations compiled ahead of time: the default configs per 16-bit dtype and for FP8 rows
    (heads unknown, few heads, and from :data:`SPARSE_SLICES_MIN_HEADS` on)."""
    configs = [sparse_mla_config(dt, kvd, num_heads=h) for dt, kvd in (("bfloat16", None), ("float16", None),
                                                                       ("bfloat16", "fp8_e4m3"))
               for h in (None,) + NARROW_ROWS + (SPARSE_SLICES_MIN_HEADS,)]
    return list(dict.fromkeys(configs))  # (one entry per config: FP8 rows take "split" either way)
