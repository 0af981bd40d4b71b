"""Ragged prefill over a paged (or contiguous) KV cache: Hopper wgmma kernel, FlashInfer-style plan/run.

``plan`` takes the host-side query offsets and KV lengths once per batch, fixes the mask and builds the
work list (one item per 64..192 query rows, heaviest first); ``run`` reads only device buffers, so it can
be captured in a CUDA graph.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from .arrays import as_device, attention_outputs, check_aligned, check_contiguous, element_dtype
from .device import sm_count
from .config import check_in
from .operand import KV_PARAMS, ONCE_ARGS, PREFILL_ARGS, as_kernel_arg, kv_params, ptr
# the configs and their defaults live in prefill_config; re-exported here, where users and tests have always found them
from .prefill_config import (DEFAULTS, DEQUANT_TILES, FP8_PINGPONG, FP8_TILES, FP8_SCORES_BN, FP8_SCORES_OFF, HEAD_DIMS,  # noqa: F401
                             PINGPONG_16BIT, SMEM_LIMIT, KVBufferConfig, PrefillConfig, default_config,
                             fp8_scores_unsupported, pingpong_16bit, pv_wait_16bit, tile_config, tma_applies, tma_box_rows)

MASKS = ("none", "causal")


#: convert_once runs on a persistent grid (``PrefillConfig.persistent``) up to this head dim. H100 (session 28,
#: benchmarks/probe_prefill_once.py, token scales, bf16/FP8): persistent against launch-per-item 1.03 / 0.87 at MHA d128
#: b8 L2048, 1.07 / 0.97 at GQA 4 b4 L4096, 1.07 / 0.97 at d64 GQA 4 b8 L2048. d256 joined in session 30 (1.02 / 0.93
#: at MHA b4 L4096, 1.00 / 0.91 at b2 L8192), once warp 0 fed each K/V element by one tensor copy per 64-dim atom
#: instead of one per quarter tile and atom: its 16 copies per element at d256 made the consumers wait for tiles
#: (0.90 before; benchmarks/NOTES.md sessions 28-30).
ONCE_PERSISTENT_MAX_HEAD_DIM = 256
#: probes force the grid: None follows ONCE_PERSISTENT_MAX_HEAD_DIM; ONCE_GRID caps the persistent grid's blocks
#: (the tests walk many items per block with a small grid)
ONCE_PERSISTENT: bool | None = None
ONCE_GRID: int | None = None


#: Convert-once tiles (BM, BN, BK, stages) per head dim where they differ from the 16-bit DEFAULTS; a tile that does not
#: fit (shared memory) falls back to the default. H100, session 35 (benchmarks/probe_once_tiles.py, 15 interleaved
#: rounds, bf16/FP8 for 128 x 64 x 4 stages / 128 x 80 x 3): MHA d256 b2 L8192 token 0.987 / 1.017, 64-dim blocks
#: 0.989 / 1.017, 32-dim 0.987 / 1.024, per-tensor 1.000 / 1.030; b4 L4096 0.996 / 0.990, 0.991 / 0.990, 0.972 /
#: 0.976, 0.986 / 0.984; GQA 4 b4 L4096 1.030 / 1.041, 1.036 / 1.046; b16 L1024 0.859 / 0.858. A first call had 80 x
#: 3 at 0.985 against 0.973 (b4 L4096) and 1.016 against 1.001 (b2 L8192); 80 x 2, 48 x 5 and 64 x 3 were 3-12%
#: slower. Session 43 (pv_wait, probe_once_tiles.py, 7 rounds, bf16/FP8 against the new 128-key 16-bit default for
#: 80 x 3 / 96 x 2 / 112 x 2): token MHA b4 L4096 0.870 / 0.894 / 0.891, b2 L8192 0.921 / 0.952 / 0.955, GQA 4 b4
#: L4096 0.924 / 0.951 / 0.957; 64-dim blocks 0.864 / 0.897 / 0.894, 0.903 / 0.929 / 0.937, 0.933 / 0.951 / 0.952.
#: So 112 keys in a ring of one tile (with pv_wait); 128 keys leave the converters' raw quarters no room. Launched per
#: item (four raw quarters) it does not fit either, and falls back to FP8_TILES' 64 x 4. Session 44 (11 rounds,
#: bf16/FP8 for 128 x 128 keys x 6 stages (the 16-bit default) / 5 / 4 / 3, d64 GQA 4): token b8 L2048 0.967 /
#: 0.975 / 0.987 / 0.993, b4 L4096 1.003 / 1.001 / 1.013 / 1.014, b16 L1024 0.936 / 0.939 / 0.952 / 0.962; per-tensor
#: 0.947 / 0.945 / 0.966 / 0.966, 0.992 / 0.985 / 0.998 / 0.997, 0.902 / 0.902 / 0.938 / 0.938 (a first call: 4
#: stages 0.983 and 1.013 against 0.968 and 1.003 at 6). So d64 converts once in a ring of 4.
ONCE_TILES: dict = {64: (128, 128, 64, 4), 256: (128, 112, 256, 2)}


def once_config(dtype: str, head_dim: int, page_size: int, kv_dtype: str, scale_block: int,
                persistent: bool | None = None) -> PrefillConfig:
    """The convert-once kernel (``PrefillConfig.convert_once``) of an FP8 cache: the head dim's ``ONCE_TILES`` tile
    where it fits, else the 16-bit default tile, else the FP8 fused kernels' (``FP8_TILES``), with the 16-bit
    ``pingpong`` and ``pv_wait`` (its consumers are the 16-bit kernel's), on a persistent grid up to
    ``ONCE_PERSISTENT_MAX_HEAD_DIM`` unless ``persistent`` (or ``ONCE_PERSISTENT``) says otherwise."""
    if head_dim not in DEFAULTS or head_dim > 256:
        raise ValueError(f"fp8_prefill='convert_once' supports head_dim up to 256, not {head_dim}")
    persistent = _once_persistent(head_dim) if persistent is None else persistent

    def build(tile):
        bm, bn, bk, st = tile
        return PrefillConfig(dtype, head_dim, page_size, bm, bn, bk, st, kv_dtype=kv_dtype, scale_block=scale_block,
                             tma=True, convert_once=True, pingpong=pingpong_16bit(head_dim, bm), persistent=persistent,
                             pv_wait=pv_wait_16bit(dtype, head_dim, bn, bk, st))

    # e.g. 32- and 64-dim blocks at d256 launched per item fit neither ONCE_TILES' tile nor d256's one-tile ring
    tiles = [t for t in (ONCE_TILES.get(head_dim), DEFAULTS[head_dim], FP8_TILES.get(head_dim)) if t is not None]
    for tile in tiles[:-1]:
        try:
            return build(tile)
        except ValueError:
            pass
    return build(tiles[-1])  # the last one says why not


def _once_persistent(head_dim: int) -> bool:
    return head_dim <= ONCE_PERSISTENT_MAX_HEAD_DIM if ONCE_PERSISTENT is None else ONCE_PERSISTENT


#: ``fp8_prefill`` choices (see BatchPrefill)
FP8_PREFILL = ("auto", "fused", "dequantize_first", "convert_once")
#: 'auto' dequantizes first, for token and block scales, from this many query rows per key. H100 (session 23,
#: benchmarks/probe_prefill_dequant.py), dequant + bf16 against the fused token kernel, in bf16 prefill's units:
#: 0.99 vs 0.80 at b4 L4096 GQA 4 (8192 rows per key), 1.03 vs 0.82 at b1 L16384 (32768), 0.96 vs 0.85 at d64 b8
#: L2048 GQA 4 (4096), 0.90 vs 0.84 at d256 b4 L4096 MHA (2048), 0.83 vs 0.82 at b8 L2048 MHA (1024).
DEQUANT_MIN_ROWS_PER_KEY = 2048
#: The same for per-tensor scales, whose fused kernel runs near bf16 speed. Two bench calls (session 23): 1.040 and
#: 1.052 ms against fused 1.076 and 1.072 at b4 L4096 GQA 4 (8192 rows per key), 3.530 and 3.575 against 3.704 and
#: 3.747 at b1 L16384 (32768); at 4096 rows (d64) a tie, below it fused wins by 10-20%.
DEQUANT_MIN_ROWS_PER_KEY_TENSOR = 8192
#: 'auto' dequantizes first only if the workspace (16-bit K and V of every planned key) fits this many bytes
DEQUANT_WORKSPACE_LIMIT = 1 << 30
#: 'auto' converts once (token scales, these head dims) from ONCE_MIN_ROWS_PER_KEY query rows per key, with no
#: upper bound since session 33: at b1 L16384 GQA 4 d128 (33024 rows per key), where 'auto' had dequantized first,
#: the bench's interleaved rounds gave convert_once / dequantize_first 3.667 / 3.794 ms (token), 3.624 / 3.722
#: (tensor), 3.542 / 3.814 (64-dim blocks), bf16 3.65-3.76 (until then ONCE_MAX_ROWS_PER_KEY = 16384, from session
#: 28's one call). Session 28 (persistent grid up to d128), one call, convert_once / dequantize_first: GQA 4 d128
#: b4 L4096 (8448) 1.07 / 0.97, b1 L16384 (33024) 0.98 / 1.02, MHA d128 b8 L2048 (1088) 1.03 / 0.82, MHA d256 b4
#: L4096 (2112) 0.89 / 0.88, d64 GQA 4 b8 L2048 (4096) 1.07 / 0.97.
#: Per-tensor scales (bench, session 28), convert_once / 'auto' before: 1.03 / 0.95 (dequantize_first) at GQA 4 b4
#: L4096, 1.06 / 0.98 (fused) at MHA d128, 1.08 / 0.98 (fused) at d64; 0.98 / 1.04 at b1 L16384; at d256 (no
#: persistent grid) 0.92 / 1.02 (fused): per-tensor scales convert once only where the grid is persistent.
#: Before it (launch per item everywhere), H100, one call (session 27,
#: benchmarks/probe_prefill_once.py), bf16/FP8 for fused / dequantize_first / convert_once, rows per key in brackets:
#: MHA d128 b32 L512 (320) 0.92 / 0.72 / 0.66, b16 L1024 (576) 0.87 / 0.77 / 0.74, b8 L2048 (1088) 0.82 / 0.83 /
#: 0.90, b4 L4096 (2112) 0.80 / 0.89 / 0.93, b2 L8192 (4160) 0.79 / 0.90 / 0.92; MHA d256 b16 L1024 (576) 0.87 / 0.75
#: / 0.72, b4 L4096 (2112) 0.84 / 0.90 / 0.92; GQA 2 d128 b8 L2048 (2176) 0.82 / 0.91 / 0.94; GQA 4 d128 b16 L1024
#: (2304) 0.87 / 0.94 / 0.95. At GQA 4 b4 L4096 (8448) and b1 L16384 (33024) dequantizing first led (0.98 / 1.01
#: against 0.97 / 0.98, session 26). At d64 (three consumer warpgroups) converting once lost everywhere (0.76-0.82
#: against 0.87-0.92) before the persistent grid. Block scales are unmeasured.
ONCE_MIN_ROWS_PER_KEY = 1024
ONCE_HEAD_DIMS = (64, 128, 256)
#: Where the grid is persistent, up to ONCE_LOW_MAX_HEAD_DIM, 'auto' converts once from fewer rows per key: token
#: scales from ONCE_MIN_ROWS_PER_KEY_PERSISTENT, block scales (whose fused kernel is the slowest) from
#: ONCE_MIN_ROWS_PER_KEY_BLOCK, per-tensor scales (whose fused kernel runs near bf16 speed) from
#: ONCE_MIN_ROWS_PER_KEY_TENSOR. Rows per key count each query tile's real rows (from session 29; before, whole
#: tiles, which made a decode step's one row BM). H100, session 29 (benchmarks/probe_prefill_once.py, one call each,
#: bf16/FP8 for fused / dequantize_first / convert_once, rows per key in brackets): token MHA d128 b64 L256 (192)
#: 0.95 / 0.70 / 0.88, b32 L512 (320) 0.92 / 0.72 / 0.97, b16 L1024 (576) 0.88 / 0.77 / 1.04, GQA 4 b64 L256 (768)
#: 0.91 / 0.89 / 1.31, d64 GQA 4 b32 L512 (1440) 0.90 / 0.95 / 1.20; 64-dim blocks MHA d128 b64 L256 (208) 0.73 /
#: 0.69 / 0.86, b32 L512 (344) 0.81 / 0.71 / 0.95, b16 L1024 (604) 0.66 / 0.76 / 1.03, b8 L2048 (1118) 0.62 / 0.82 /
#: 1.01, GQA 4 b4 L4096 (8572) 0.58 / 0.99 / 1.02, b1 L16384 (33151) 0.62 / 0.97 / 0.99, 32-dim blocks at d64 GQA 4
#: b8 L2048 (4476) 0.54 / 0.97 / 1.07 and at d128 0.40-0.63 / 0.71-1.01 / 0.95-1.05 (344 to 8572); per-tensor MHA
#: d128 b32 L512 (320) 1.04 / - / 1.00, b16 L1024 (576) 1.03 / - / 1.07, GQA 4 b64 L256 (768) 1.02 / - / 1.31. At
#: d256 (launch per item) token scales keep ONCE_MIN_ROWS_PER_KEY (b16 L1024 (576): 0.86 / 0.74 / 0.84); block
#: scales at d256: ONCE_MIN_ROWS_PER_KEY_BLOCK_D256.
ONCE_MIN_ROWS_PER_KEY_PERSISTENT = 256
ONCE_MIN_ROWS_PER_KEY_BLOCK = 192
ONCE_MIN_ROWS_PER_KEY_TENSOR = 512
#: On the persistent grid at d256 (session 30, one call, bf16/FP8 for fused / dequantize_first / convert_once on the
#: persistent grid, rows per key in brackets): token MHA b64 L256 (192) 0.90 / 0.65 / 0.73, b32 L512 (320) 0.91 / 0.69
#: / 0.81, b16 L1024 (576) 0.86 / 0.74 / 0.87, b4 L4096 (2112) - / - / 1.02, b2 L8192 (4160) 0.81 / 0.95 / 1.00, GQA 4
#: b4 L4096 (8448) 0.86 / 0.92 / 1.07: token scales keep ONCE_MIN_ROWS_PER_KEY there. 128-dim blocks 0.74 / 0.68 /
#: 0.78 (320), 0.59 / 0.74 / 0.85 (576), 0.51 / 0.91 / 1.00 (2112), 0.51 / 1.02 / 1.03 (8448):
#: ONCE_MIN_ROWS_PER_KEY_BLOCK_D256.
#: Per-tensor 0.97 / - / 0.83 (320), 0.97 / - / 0.89 (576), 1.00 / - / 0.97 (2112), 1.01 / - / 1.02 (8448): fused
#: stays, so per-tensor and the low token threshold apply up to ONCE_LOW_MAX_HEAD_DIM.
ONCE_LOW_MAX_HEAD_DIM = 128
#: Block scales at d256 convert once from ONCE_MIN_ROWS_PER_KEY_BLOCK_D256. Session 34 (32- and 64-dim blocks fit
#: convert-once there since; benchmarks/probe_prefill_once.py, one call, MHA h16, bf16/FP8 for fused /
#: dequantize_first / convert_once): 64-dim blocks b64 L256 (192) 0.82 / 0.65 / 0.72, b32 L512 (320) 0.73 / 0.69 /
#: 0.80, b16 L1024 (576) 0.58 / 0.74 / 0.84, b4 L4096 (2112) 0.47 / 0.89 / 0.98; 32-dim blocks 0.64 / 0.65 / 0.71,
#: 0.53 / 0.68 / 0.79, 0.40 / 0.74 / 0.84, 0.31 / 0.90 / 0.97. With 128-dim blocks (above) convert-once won from 320
#: rows; at 192 the fused kernel won for 64-dim blocks.
ONCE_MIN_ROWS_PER_KEY_BLOCK_D256 = 320
#: Per-tensor scales at d256 convert once from ONCE_MIN_ROWS_PER_KEY_TENSOR_D256 (before session 35: never). H100,
#: session 35, convert-once's 128 x 80 x 3 tile (ONCE_TILES; benchmarks/probe_once_tiles.py --fused, 15 rounds),
#: bf16/FP8 for fused / convert_once: MHA b2 L8192 (4160 rows per key) 0.999 / 1.030, b4 L4096 (2112) 0.987 / 0.984,
#: b16 L1024 (576) 0.944 / 0.887. Session 38 (the workspace holds a per-tensor cache's codes; H100,
#: benchmarks/ab_macros.sh CUKV_ONCE_TENSOR_CODES, probe_prefill_once.py --gran tensor, 9 rounds): b4 L4096 fused
#: 1.00 / convert_once 1.02 (0.98 before), so from 2048.
ONCE_MIN_ROWS_PER_KEY_TENSOR_D256 = 2048


def _once_min_rows(head_dim: int, scale_block: int) -> int | None:
    """The rows per key from which 'auto' converts once, or None. On the persistent grid up to ONCE_LOW_MAX_HEAD_DIM:
    every granularity (token / block / per-tensor thresholds); at d256 token scales from ONCE_MIN_ROWS_PER_KEY,
    block scales from ONCE_MIN_ROWS_PER_KEY_BLOCK_D256 and per-tensor scales (whose fused kernel is nearly as fast)
    from ONCE_MIN_ROWS_PER_KEY_TENSOR_D256; on a launch-per-item grid token scales only."""
    if head_dim not in ONCE_HEAD_DIMS:
        return None
    if not _once_persistent(head_dim):
        return ONCE_MIN_ROWS_PER_KEY if scale_block == head_dim else None
    if scale_block == 0:
        return ONCE_MIN_ROWS_PER_KEY_TENSOR if head_dim <= ONCE_LOW_MAX_HEAD_DIM else ONCE_MIN_ROWS_PER_KEY_TENSOR_D256
    if scale_block == head_dim:
        return ONCE_MIN_ROWS_PER_KEY_PERSISTENT if head_dim <= ONCE_LOW_MAX_HEAD_DIM else ONCE_MIN_ROWS_PER_KEY
    return ONCE_MIN_ROWS_PER_KEY_BLOCK if head_dim <= ONCE_LOW_MAX_HEAD_DIM else ONCE_MIN_ROWS_PER_KEY_BLOCK_D256


def once_unsupported(dtype: str, head_dim: int, page_size: int, kv_dtype: str, scale_block: int) -> str | None:
    """Why ``fp8_prefill='convert_once'`` cannot run this cache (its kernel is invalid: head dim, shared memory), or
    None."""
    return _once_unsupported(dtype, head_dim, page_size, kv_dtype, scale_block, _once_persistent(head_dim))


@lru_cache(maxsize=None)
def _once_unsupported(dtype, head_dim, page_size, kv_dtype, scale_block, persistent) -> str | None:
    # memoized: 'auto' asks on every plan, and building the config to find out takes ~70 us
    try:
        once_config(dtype, head_dim, page_size, kv_dtype, scale_block, persistent)
    except ValueError as e:
        return str(e)
    return None


class BatchPrefill:
    """Ragged prefill over a paged KV cache (``page_size``) or contiguous K/V (``page_size=None``).

    Parameters
    ----------
    num_qo_heads, num_kv_heads : int
        Query heads and KV heads (``num_qo_heads`` a multiple of ``num_kv_heads``).
    head_dim : int
        64, 80, 96, 128, 192, 256 or 512.
    page_size : int or None
        Tokens per page of the cache this will read; ``None`` for contiguous ``k[total_kv, H, D]``.
    dtype : {'bfloat16', 'float16'}
        Query and output type (and the cache's, unless ``kv_dtype`` says otherwise).
    kv_dtype : {None, 'fp8_e4m3'}
        An FP8 paged cache. With bf16 queries and token or tensor scales (head dims 80-256), K stays e4m3
        and ``S = Q K^T`` runs on the e4m3 tensor cores against the query split into two e4m3 terms
        (``PrefillConfig.fp8_scores``); the producer warps dequantize V (and otherwise K too: ``code *
        scale``, rounded to ``dtype``) into shared memory, so P V runs at the 16-bit rate.
    scale_granularity : {'token', 'tensor', 32, 64, 128}
        The FP8 cache's granularity (default 'token').
    config : PrefillConfig, optional
        Tile shape; by default the documented per-head-dim default (or an autotuned winner).
    fp8_prefill : {'auto', 'fused', 'dequantize_first', 'convert_once'}
        FP8 caches only. ``'fused'`` runs the FP8 kernel above. ``'dequantize_first'`` gathers each
        sequence's keys and values into ragged 16-bit K/V first (:func:`cukv.dequantize_kv`, one pass over
        the used codes, into a workspace ``plan`` allocates: 4 bytes per key, KV head and dim), then runs the
        16-bit contiguous prefill on them. ``'convert_once'`` (head dims up to 256) runs the 16-bit kernel over
        the same kind of workspace, which its own blocks fill while they run: three producer warps per block
        convert quarter tiles (the next KV head's ahead of time) and flag them, the fourth loads flagged tiles
        (``PrefillConfig.convert_once``); it needs no separate pass, and the workspace is only ever read after its
        flag says it is ready. The fused kernel converts each K/V tile once for every query tile that visits it,
        the other two once in all, so they win when many query rows share each key. ``'auto'`` (the default)
        takes ``'convert_once'`` by query rows per key (query heads of a KV head included, no upper bound): up
        to ``ONCE_LOW_MAX_HEAD_DIM`` from ``ONCE_MIN_ROWS_PER_KEY_PERSISTENT`` for token scales,
        ``ONCE_MIN_ROWS_PER_KEY_BLOCK`` for block scales and ``ONCE_MIN_ROWS_PER_KEY_TENSOR`` for per-tensor
        scales; at d256 for token scales from ``ONCE_MIN_ROWS_PER_KEY``, block scales from
        ``ONCE_MIN_ROWS_PER_KEY_BLOCK_D256`` and per-tensor scales from ``ONCE_MIN_ROWS_PER_KEY_TENSOR_D256``; else
        ``'dequantize_first'`` from ``DEQUANT_MIN_ROWS_PER_KEY`` rows per key (``DEQUANT_MIN_ROWS_PER_KEY_TENSOR``
        for per-tensor scales, whose fused kernel runs near bf16 speed), else ``'fused'``; the workspaces must
        fit ``DEQUANT_WORKSPACE_LIMIT`` bytes. ``strategy`` says which one ``plan`` chose, ``kernel_config`` the
        kernel it runs. All read the plan's
        ``kv_lengths`` keys per sequence; the table's lengths must agree.

    Examples
    --------
    >>> import cupy as cp, numpy as np, cukv                                        # doctest: +SKIP
    >>> cache = cukv.PagedKVCache(num_pages=16, page_size=16, num_kv_heads=2, head_dim=128)
    >>> seqs = cukv.SequenceTable(cache, max_batch=2, max_pages_per_seq=8)
    >>> q_lens = [40, 7]                                            # two prompts, no cached prefix
    >>> slots = cp.asarray(seqs.extend(q_lens))
    >>> k = cp.asarray(cukv.dtypes.to_storage(np.random.randn(47, 2, 128), "bfloat16"))
    >>> cukv.append_kv(cache, k, k, slots)                          # append first, then attend
    >>> pf = cukv.BatchPrefill(8, 2, 128, page_size=16)
    >>> pf.plan(np.array([0, 40, 47], np.int32), np.array(q_lens, np.int32), mask="causal")
    >>> q = cp.asarray(cukv.dtypes.to_storage(np.random.randn(47, 8, 128), "bfloat16"))
    >>> out, lse = pf.run(q, (cache, seqs.page_table()), return_lse=True)  # out [47, 8, 128], lse [47, 8]
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int | None = 16,
                 dtype="bfloat16", config: PrefillConfig | None = None, kv_dtype=None, scale_granularity=None,
                 fp8_prefill: str = "auto"):
        from .arrays import canonical_dtype
        from .fp8 import resolve_kv

        for n, v in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{n}={v!r} must be a positive integer")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if num_qo_heads > 65535:  # the grid's y dimension (work items run along x)
            raise ValueError(f"num_qo_heads={num_qo_heads} exceeds 65535, the most one prefill launch takes")
        if page_size is not None and (not isinstance(page_size, (int, np.integer)) or not 1 <= page_size <= 4096):
            raise ValueError(f"page_size={page_size!r} must be an integer in 1..4096, or None for contiguous K/V")
        dt = canonical_dtype(dtype)
        ps = 0 if page_size is None else int(page_size)
        kvd, sb = resolve_kv(dt, kv_dtype, scale_granularity, int(head_dim))
        if kvd is not None and ps == 0:
            raise ValueError("kv_dtype='fp8_e4m3' needs a paged cache: page_size=None (contiguous K/V) is 16-bit only")
        if config is None:
            config = default_config(dt, int(head_dim), ps, kvd, sb)
        elif not isinstance(config, PrefillConfig):
            raise TypeError(f"config must be a PrefillConfig, got {type(config).__name__}")
        if (config.dtype, config.head_dim, config.page_size, config.kv_dtype, config.scale_block) != (dt, head_dim, ps, kvd, sb):
            raise ValueError(f"config {config.name} does not match dtype={dt}, head_dim={head_dim}, page_size={ps}, "
                             f"kv_dtype={kvd}, scale block {sb}")
        check_in("BatchPrefill", "fp8_prefill", fp8_prefill, FP8_PREFILL)
        if fp8_prefill != "auto" and kvd is None:
            raise ValueError(f"fp8_prefill={fp8_prefill!r} applies to FP8 caches (kv_dtype='fp8_e4m3'); leave it 'auto'")
        if fp8_prefill == "convert_once" and (why := once_unsupported(dt, int(head_dim), ps, kvd, sb)):
            raise ValueError(f"fp8_prefill='convert_once' cannot run head_dim={head_dim} with scale_granularity "
                             f"{scale_granularity or 'token'!r} ({why}); use 'auto', 'fused' or 'dequantize_first'")
        self.num_qo_heads, self.num_kv_heads = int(num_qo_heads), int(num_kv_heads)
        self.head_dim, self.page_size, self.dtype, self.config = int(head_dim), page_size, dt, config
        self.fp8_prefill = fp8_prefill
        self.strategy = "fused" if kvd is not None else None
        self._dequant = self._once = None
        self._planned = False

    def plan(self, q_offsets, kv_lengths, *, mask: str = "causal", window: int | None = None,
             chunk: int | None = None) -> "BatchPrefill":
        """Fix the batch: ``q_offsets[B + 1]`` and ``kv_lengths[B]`` (host int arrays; ``kv_lengths`` counts
        every key a sequence sees, cached prefix plus the new tokens already appended). ``mask`` is
        ``'causal'`` (bottom-right aligned) or ``'none'``; ``window`` keeps keys in ``(p - window, p]``;
        ``chunk`` keeps keys in the query's chunk of ``chunk`` positions. Compiles (or loads) the kernel."""
        import cupy as cp

        qo = _host_ints(q_offsets, "q_offsets")
        kl = _host_ints(kv_lengths, "kv_lengths")
        if qo.ndim != 1 or qo.size < 2:
            raise ValueError(f"q_offsets has shape {qo.shape}; expected [batch + 1] with batch >= 1")
        if qo[0] != 0 or np.any(np.diff(qo) < 0):
            raise ValueError(f"q_offsets={qo.tolist()[:8]}... must start at 0 and never decrease")
        b = qo.size - 1
        if kl.shape != (b,) or np.any(kl < 0):
            raise ValueError(f"kv_lengths has shape {kl.shape} / min {kl.min(initial=0)}; expected [{b}] non-negative")
        check_in("plan", "mask", mask, MASKS)
        for n, v in (("window", window), ("chunk", chunk)):
            if v is not None and (not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{n}={v!r} must be a positive integer (or None)")
        cfg = self.config
        work = _work_list(np.diff(qo), kl, cfg, mask, window, chunk)
        self.batch_size, self.total_q = b, int(qo[-1])
        self._work, self._num_work = _work_array(work)
        self._q_offsets = cp.asarray(qo.astype(np.int32))
        self._mask, self._window, self._chunk = mask, int(window or 0), int(chunk or 0)
        self._dequant = self._once = None
        if cfg.quantized:
            self.strategy = self._choose_strategy(work, kl, np.diff(qo))
        if self.strategy == "dequantize_first":
            self._plan_dequant(qo, kl, mask, window, chunk)
        elif self.strategy == "convert_once":
            self._plan_once(qo, kl, mask, window, chunk)
        else:
            self._fn = cfg.compiled.function(cfg.name, cfg.smem_bytes)
            # the persistent grid's item counter and finished-block count (see OnceArgs.flags), zero between launches:
            # the kernel's last block resets them
            self._counters = cp.zeros(32, cp.int32) if cfg.persistent else None
        self._planned = True
        return self

    @property
    def kernel_config(self) -> PrefillConfig:
        """The config of the attention kernel ``run`` launches, once planned: ``config`` for the fused kernel (and
        16-bit caches), the convert-once kernel's (``once_config``: its own tile at d256), or the 16-bit kernel that
        'dequantize_first' runs over its workspace."""
        if self._once is not None:
            return self._once["cfg"]
        if self._dequant is not None:
            return self._dequant["inner"].config
        return self.config

    def _choose_strategy(self, work, kv_lengths, q_lengths) -> str:
        """'fused', 'dequantize_first' or 'convert_once' for an FP8 cache (see the class docstring): query rows per
        key from the work list's tile costs and each tile's real rows (a decode step's one row is one, not BM), the
        workspace from the planned key count."""
        if self.config.convert_once:
            return "convert_once"
        if self.fp8_prefill != "auto":
            return self.fp8_prefill
        keys = int(kv_lengths.sum())
        if keys == 0:
            return "fused"
        cfg = self.config
        pairs = sum(c * min(cfg.BM, int(q_lengths[b]) - t * cfg.BM) for c, b, t in work) * cfg.BN
        rows_per_key = pairs * (self.num_qo_heads // self.num_kv_heads) / keys
        workspace = 2 * keys * self.num_kv_heads * self.head_dim * 2
        if workspace > DEQUANT_WORKSPACE_LIMIT:
            return "fused"
        once_lo = _once_min_rows(self.head_dim, cfg.scale_block)
        if (once_lo is not None and once_lo <= rows_per_key
                and once_unsupported(self.dtype, self.head_dim, cfg.page_size, cfg.kv_dtype, cfg.scale_block) is None):
            return "convert_once"
        many = rows_per_key >= (DEQUANT_MIN_ROWS_PER_KEY_TENSOR if cfg.scale_block == 0 else DEQUANT_MIN_ROWS_PER_KEY)
        return "dequantize_first" if many else "fused"

    def _plan_once(self, qo, kl, mask, window, chunk) -> None:
        """The convert-once kernel (``PrefillConfig.convert_once``), its work list, workspace and flags: each
        sequence's rows start at a multiple of BN, so a tile's rows past the sequence (stored as zeros) stay its own."""
        import cupy as cp

        from . import tma
        from .dtypes import storage_dtype

        cfg = self.config if self.config.convert_once else once_config(self.dtype, self.head_dim, self.config.page_size,
                                                                       self.config.kv_dtype, self.config.scale_block)
        work, num_work = _work_array(_work_list(np.diff(qo), kl, cfg, mask, window, chunk))
        padded = -(-kl // cfg.BN) * cfg.BN
        offs = np.zeros(kl.size + 1, np.int64)
        np.cumsum(padded, out=offs[1:])
        if offs[-1] >= 2**31:
            raise ValueError(f"kv_lengths sum to {offs[-1]} workspace rows; at most 2**31 - 1")
        rows = max(int(offs[-1]), cfg.BN)
        st = storage_dtype(self.dtype)
        shape = (rows, self.num_kv_heads, self.head_dim)
        ws_k, ws_v, ws_offs = cp.empty(shape, st), cp.empty(shape, st), cp.asarray(offs.astype(np.int32))
        # the kernel's view of the workspace (rows from ws_offs, one page of every row) and its tensor maps, fixed
        # for the plan: run() only fills in the cache it converts from
        ws = np.zeros((), KV_PARAMS)
        ws["k"], ws["v"], ws["block_table"] = ptr(ws_k), ptr(ws_v), ptr(ws_offs)
        ws["k_stride"] = ws["v_stride"] = (0, self.num_kv_heads * self.head_dim, self.head_dim, 1)
        ws["num_pages"], ws["batch_size"] = rows, self.batch_size
        maps = tma.as_maps_arg(*[tma.encode_pages("workspace." + n, tma.OnePage(a.view(np.uint8)), 128, cfg.tma_rows,
                                                  tma.SWIZZLE_128B) for n, a in (("k", ws_k), ("v", ws_v))])
        ws_tiles = int(offs[-1]) // cfg.BN
        tile_seq = np.repeat(np.arange(kl.size, dtype=np.int32), padded // cfg.BN)  # the sequence of each tile
        tile_seq = np.concatenate([tile_seq, [0]]).astype(np.int32)  # a last 0: never empty (a real pointer)
        self._once = dict(cfg=cfg, work=work, num_work=num_work, k=ws_k, v=ws_v, offsets=ws_offs, kv=ws, maps=maps,
                          ws_tiles=ws_tiles, tile_seq=cp.asarray(tile_seq),
                          # 32 ints first: ONCE_STATS, and the persistent grid's two counters
                          flags=cp.zeros(32 + rows // cfg.BN * self.num_kv_heads * 4, cp.int32))
        self._fn = cfg.compiled.function(cfg.name, cfg.smem_bytes)

    def _plan_dequant(self, qo, kl, mask, window, chunk) -> None:
        """The 16-bit contiguous prefill the 'dequantize_first' strategy runs, and its workspace."""
        import cupy as cp

        from .dequant import DequantConfig, ragged_layout
        from .dtypes import storage_dtype

        cfg = self.config
        inner = BatchPrefill(self.num_qo_heads, self.num_kv_heads, self.head_dim, None, self.dtype)
        inner.plan(qo, kl, mask=mask, window=window, chunk=chunk)
        offs, shape = ragged_layout(kl, self.num_kv_heads, self.head_dim)
        st = storage_dtype(self.dtype)
        self._dequant = dict(cfg=DequantConfig(self.dtype, self.head_dim, cfg.page_size, cfg.scale_block),
                             inner=inner, k=cp.empty(shape, st), v=cp.empty(shape, st),
                             offsets=cp.asarray(offs.astype(np.int32)), max_len=int(kl.max(initial=0)))
        self._dequant["cfg"].compiled.function(self._dequant["cfg"].name)

    def run(self, q, kv, out=None, lse=None, *, return_lse: bool = False, sink=None, softcap: float | None = None,
            sm_scale: float | None = None, stream=None):
        """Attend ``q[total_q, num_qo_heads, head_dim]`` to ``kv``.

        ``kv`` is ``(cache, table)`` for a paged cache (``table.lengths`` = keys per sequence, prefix plus new
        tokens) or ``(k, v, kv_offsets)`` for contiguous ``k[total_kv, num_kv_heads, head_dim]`` with int32
        device ``kv_offsets[B + 1]``. Returns ``out`` (and ``lse[total_q, num_qo_heads]`` float32, natural
        log, without the sink, when ``return_lse``).

        On the persistent grids (16-bit defaults, convert-once) the plan owns the work counter (and convert-once's
        workspace), so runs of one planned ``BatchPrefill`` must not overlap on different streams; use one plan per
        stream.
        """
        import cupy as cp

        if not self._planned:
            raise RuntimeError("call plan(q_offsets, kv_lengths) before run()")
        cfg = self.config
        if self._dequant is not None:
            from . import dequant

            kv_rec, _ = self._kv_params(kv)  # checks the cache and table against the FP8 config
            d = self._dequant
            dequant.launch(d["cfg"], kv_rec, d["k"], d["v"], d["offsets"], d["max_len"], self.batch_size, stream)
            return d["inner"].run(q, (d["k"], d["v"], d["offsets"]), out, lse, return_lse=return_lse, sink=sink,
                                  softcap=softcap, sm_scale=sm_scale, stream=stream)
        qd, qdt = as_device(q, "q")
        dt = element_dtype(qd, qdt or (cfg.dtype if qd.dtype == cp.uint16 else None), "q")
        if dt != cfg.dtype:
            raise TypeError(f"q is {dt}; this BatchPrefill was built for {cfg.dtype}")
        if qd.ndim != 3 or qd.shape != (self.total_q, self.num_qo_heads, self.head_dim):
            raise ValueError(f"q has shape {tuple(qd.shape)}; expected [{self.total_q}, {self.num_qo_heads}, "
                             f"{self.head_dim}] (total_q from plan)")
        check_contiguous(qd, "q")
        check_aligned(qd, "q", 16)  # 16-byte loads of query rows
        rec = np.zeros((), PREFILL_ARGS)
        rec["kv"], kv_arrays = self._kv_params(kv)
        out, lse, sink = attention_outputs(qd, out, lse, self.total_q, self.num_qo_heads, return_lse, sink, softcap)
        check_aligned(out, "out", 4)  # stores of value pairs
        rec["q"], rec["out"], rec["lse"], rec["sink"] = ptr(qd), ptr(out), ptr(lse), ptr(sink)
        rec["q_offsets"], rec["work"] = ptr(self._q_offsets), ptr(self._work)
        rec["q_stride"] = (qd.strides[0] // 2, qd.strides[1] // 2)
        rec["o_stride"] = (out.strides[0] // 2, out.strides[1] // 2)
        if sm_scale is not None and not (float(sm_scale) > 0):
            raise ValueError(f"sm_scale={sm_scale!r} must be > 0 (or None for 1/sqrt(head_dim))")
        rec["sm_scale"] = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(self.head_dim)
        rec["softcap"] = float(softcap or 0.0)
        rec["window"], rec["chunk"], rec["causal"] = self._window, self._chunk, int(self._mask == "causal")
        rec["num_qo_heads"], rec["group"] = self.num_qo_heads, self.num_qo_heads // self.num_kv_heads
        num_work = self._num_work
        if self._once is not None:
            args, cfg, num_work = self._once_args(rec, qd)
        else:
            args = (as_kernel_arg(rec),) + ((self._tma_maps(*kv_arrays),) if cfg.tma else ())
            if cfg.persistent:
                args += self._persistent_args(qd)
        if num_work:
            with (stream or cp.cuda.get_current_stream()) as st:  # work items along x: see prefill.cuh run()
                if self._once is not None:
                    f = self._once["flags"]
                    cp.cuda.runtime.memsetAsync(f.data.ptr, 0, f.nbytes, st.ptr)
                grid = (num_work, self.num_qo_heads, cfg.num_v_slices)
                if cfg.persistent:  # one block per SM walks the items (templates/prefill.cuh PERSISTENT)
                    grid = (min(ONCE_GRID or sm_count(), num_work * self.num_qo_heads), 1, 1)
                self._fn(grid, (cfg.num_threads,), args, shared_mem=cfg.smem_bytes)
        return (out, lse) if return_lse else out

    def _once_args(self, rec, q):
        """convert_once: ``rec`` (checked, with the FP8 cache's params) rewired to the planned workspace, its tensor
        maps and the OnceArgs record (the persistent grid: and ``q``'s tensor map, boxes of BM rows of one head); the
        config and work count to launch."""
        d = self._once
        once = np.zeros((), ONCE_ARGS)
        once["fp8"], once["flags"], once["num_kv_heads"] = rec["kv"], ptr(d["flags"]) + 128, self.num_kv_heads
        once["tile_seq"], once["num_work"], once["ws_tiles"] = ptr(d["tile_seq"]), d["num_work"], d["ws_tiles"]
        rec["kv"], rec["work"] = d["kv"], ptr(d["work"])
        args = (as_kernel_arg(rec), d["maps"], as_kernel_arg(once))
        if d["cfg"].persistent:
            args += (_query_map(q, d["cfg"].BM),)
        return args, d["cfg"], d["num_work"]

    def _persistent_args(self, q):
        """A 16-bit cache's persistent grid: the OnceArgs record with only its work count and counters set, and
        ``q``'s tensor map (boxes of BM rows of one head), as convert-once's persistent grid takes them."""
        once = np.zeros((), ONCE_ARGS)
        once["flags"], once["num_work"] = ptr(self._counters) + 128, self._num_work
        return as_kernel_arg(once), _query_map(q, self.config.BM)

    def _tma_maps(self, k, v):
        """The K and V tensor maps of a ``tma`` config (cukv/tma.py) over the arrays the kernel reads: boxes of
        ``tma_rows`` tokens of one head, of bytes (16-bit values as byte pairs); contiguous K/V as one page."""
        import cupy as cp

        from . import tma

        cfg = self.config

        def as_pages(a):
            b = a.view(cp.uint8) if a.dtype != cp.uint8 else a
            return tma.OnePage(b) if cfg.page_size == 0 else b

        name = "" if cfg.page_size == 0 else "cache."
        maps = [tma.encode_pages(name + n, as_pages(a), cols, cfg.tma_rows,
                                 tma.SWIZZLE_128B if ring else tma.SWIZZLE_NONE)
                for n, a, cols, ring in (("k", k, cfg.tma_k_box_cols, cfg.tma_k_ring),
                                         ("v", v, cfg.tma_v_box_cols, cfg.tma_v_ring))]
        return tma.as_maps_arg(*maps)

    def _kv_params(self, kv):
        """The kernel's KV_PARAMS record for ``kv``, validated, and the (k, v) device arrays it reads."""
        import cupy as cp

        from .cache import check_paged_kv

        cfg = self.config
        if not isinstance(kv, tuple) or len(kv) not in (2, 3):
            raise TypeError("kv must be (cache, table) for a paged cache or (k, v, kv_offsets) for contiguous K/V")
        if len(kv) == 2:
            cache, table = kv
            if cfg.page_size == 0:
                raise ValueError("this BatchPrefill was built for contiguous K/V (page_size=None); pass (k, v, kv_offsets)")
            check_paged_kv("BatchPrefill", cfg, self.num_kv_heads, cache, table)
            if table.batch_size < self.batch_size:
                raise ValueError(f"table covers {table.batch_size} sequences; plan() has {self.batch_size}")
            return kv_params(cache, table), (cache.k, cache.v)
        k, v, offs = kv
        if cfg.page_size != 0:
            raise ValueError(f"this BatchPrefill reads a paged cache (page_size={cfg.page_size}); pass (cache, table)")
        kd, kdt = as_device(k, "k")
        vd, _ = as_device(v, "v")
        od, _ = as_device(offs, "kv_offsets")
        dt = element_dtype(kd, kdt or (cfg.dtype if kd.dtype == cp.uint16 else None), "k")
        if dt != cfg.dtype:
            raise TypeError(f"k is {dt}; this BatchPrefill was built for {cfg.dtype}")
        for n, a in (("k", kd), ("v", vd)):
            if a.ndim != 3 or a.shape[1:] != (self.num_kv_heads, self.head_dim) or a.dtype != kd.dtype:
                raise ValueError(f"{n} has shape {tuple(a.shape)}/{a.dtype}; expected [total_kv, {self.num_kv_heads}, "
                                 f"{self.head_dim}] of {kd.dtype}")
            if a.strides[2] != 2 or a.strides[1] % 16 or a.strides[0] % 16:
                raise ValueError(f"{n} must have a unit dim stride and 16-byte aligned token/head strides")
            check_aligned(a, n, 16)  # 16-byte copies of its rows
        if vd.shape[0] != kd.shape[0]:
            raise ValueError(f"v has {vd.shape[0]} tokens, k has {kd.shape[0]}")
        if od.dtype != cp.int32 or od.shape != (self.batch_size + 1,):
            raise ValueError(f"kv_offsets must be int32 of shape ({self.batch_size + 1},); got {od.dtype} {tuple(od.shape)}")
        rec = np.zeros((), KV_PARAMS)
        rec["k"], rec["v"], rec["block_table"] = ptr(kd), ptr(vd), ptr(od)
        rec["k_stride"] = (0, kd.strides[0] // 2, kd.strides[1] // 2, 1)
        rec["v_stride"] = (0, vd.strides[0] // 2, vd.strides[1] // 2, 1)
        rec["num_pages"] = kd.shape[0]
        rec["batch_size"] = self.batch_size
        self._keep = od  # kernels read it during run
        return rec, (kd, vd)


def _query_map(q, bm: int):
    """The persistent grids' query tensor map (kernel argument): boxes of ``bm`` rows of one head, one 128-byte
    swizzle atom wide, which warp 0 stages per work item (templates/prefill.cuh ``stage_item``)."""
    from . import tma

    return tma.as_maps_arg(tma.encode_pages("q", tma.OnePage(q.view(np.uint8)), 128, bm, tma.SWIZZLE_128B))


def _work_list(q_lens, kv_lengths, cfg, mask, window, chunk) -> list:
    """(cost, sequence, query tile) per block of ``cfg``'s BM query rows, longest first: the tail of the grid is
    short blocks."""
    work = []
    for s in range(q_lens.size):
        for t in range(-(-int(q_lens[s]) // cfg.BM)):
            work.append((_tile_cost(int(q_lens[s]), int(kv_lengths[s]), t, cfg, mask, window, chunk), s, t))
    work.sort(key=lambda w: -w[0])
    return work


def _work_array(work):
    """The kernel's ``work[num_work, 2]`` (device int32) and its length."""
    import cupy as cp

    arr = np.array([(s, t) for _, s, t in work], np.int32).reshape(-1, 2)
    return (cp.asarray(arr) if arr.size else cp.zeros((1, 2), cp.int32)), int(arr.shape[0])


def _tile_cost(q_len, kv_len, t, cfg, mask, window, chunk) -> int:
    """KV tiles a query tile visits (for ordering the work list)."""
    shift = kv_len - q_len
    p_first, p_last = shift + t * cfg.BM, shift + min(q_len, (t + 1) * cfg.BM) - 1
    hi = kv_len if mask == "none" else min(kv_len, p_last + 1)
    lo = 0
    if window:
        lo = max(lo, p_first - window + 1)
    if chunk:
        lo = max(lo, p_first // chunk * chunk)
        hi = min(hi, (p_last // chunk + 1) * chunk)
    return max(0, -(-(hi - lo) // cfg.BN))


def _host_ints(x, name):
    if hasattr(x, "get"):
        x = x.get()
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array (host), got dtype {a.dtype}")
    return a.astype(np.int64)


def prefill(q, q_offsets, kv, *, mask: str = "causal", window=None, chunk=None, **kwargs):
    """One-shot convenience: plan from ``q_offsets`` (host or device) and the KV lengths, then run."""
    qd, _ = as_device(q, "q")
    if qd.ndim != 3:
        raise ValueError(f"q has shape {tuple(qd.shape)}; expected [total_q, num_qo_heads, head_dim]")
    qo = _host_ints(q_offsets, "q_offsets")
    if isinstance(kv, tuple) and len(kv) == 2:
        cache, table = kv
        kl = table.lengths.get()[: qo.size - 1]
        if getattr(cache, "quantized", False):
            qdt = element_dtype(qd, _ or ("bfloat16" if qd.dtype.kind == "u" else None), "q")
            pf = BatchPrefill(qd.shape[1], cache.num_kv_heads, cache.head_dim, cache.page_size, qdt,
                              kv_dtype=cache.dtype, scale_granularity=cache.scale_granularity)
        else:
            pf = BatchPrefill(qd.shape[1], cache.num_kv_heads, cache.head_dim, cache.page_size, cache.dtype)
    elif isinstance(kv, tuple) and len(kv) == 3:
        k, _, offs = kv
        kd, kdt = as_device(k, "k")
        ko = _host_ints(offs, "kv_offsets")
        kl = np.diff(ko)
        dt = element_dtype(kd, kdt or ("bfloat16" if kd.dtype.kind == "u" else None), "k")
        pf = BatchPrefill(qd.shape[1], kd.shape[1], kd.shape[2], None, dt)
    else:
        raise TypeError("kv must be (cache, table) or (k, v, kv_offsets)")
    pf.plan(qo, kl, mask=mask, window=window, chunk=chunk)
    return pf.run(q, kv, **kwargs)
