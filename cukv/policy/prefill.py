"""Prefill policy: the default tile per head dim and cache kind, and which FP8 strategy ``BatchPrefill.plan`` runs.

Tables of data first, then the pure functions that read them. Each number has its measurement in docs/tuning.md.

Examples
--------
>>> from cukv.policy.prefill import DEFAULTS, ONCE_MIN_ROWS, default_config, fp8_strategy
>>> DEFAULTS[128]                                                  # (BM, BN, BK, stages) for 16-bit caches
(128, 128, 128, 4)
>>> cfg = default_config("bfloat16", head_dim=128, page_size=16, kv_dtype="fp8_e4m3", scale_block=128)
>>> cfg.fp8_scores                                                 # S = Q K^T on the e4m3 tensor cores
True
>>> ws = 8192 * 8 * 128 * 4                                         # a 16-bit copy of 8192 keys, 8 KV heads
>>> fp8_strategy("auto", cfg, keys=8192, rows_per_key=1, workspace_bytes=ws)    # a decode-like step
'fused'
>>> fp8_strategy("auto", cfg, keys=8192, rows_per_key=ONCE_MIN_ROWS["token"][0], workspace_bytes=ws)
'convert_once'
>>> default_config("bfloat16", head_dim=100, page_size=16)
Traceback (most recent call last):
...
ValueError: head_dim=100 is not supported by prefill; accepted: 64, 80, 96, 128, 192, 256, 512
"""
from __future__ import annotations

from functools import lru_cache

from ..configs.prefill import (HEAD_DIMS, KVBufferConfig, PrefillConfig, fp8_scores_unsupported, persistent_grid_fits,
                               tma_applies)

# ----------------------------------------------------------------------------------------------
# tiles: (BM, BN, BK, stages)

#: 16-bit caches, per head dim (docs/tuning.md "prefill tiles")
DEFAULTS = {
    64: (128, 128, 64, 6),    # 128 x 128 on the persistent grid beat 192 x 96 by 1-18%
    80: (128, 128, 128, 4),
    96: (128, 128, 128, 4),
    128: (128, 128, 128, 4),
    192: (128, 64, 192, 4),
    256: (128, 128, 256, 2),  # 128 keys in a ring of one tile (pv_wait) beat 64 keys x 4 stages by 8-13%
    512: (64, 64, 256, 4),
}
#: FP8 fused kernels, where they differ from DEFAULTS: the tiles they were measured with (d64), and d256's raw
#: slots do not fit beside a 128-key one-tile ring (docs/tuning.md)
FP8_TILES = {64: (192, 96, 64, 6), 256: (128, 64, 256, 4)}
#: FP8 kernels whose producer also dequantizes K (block scales, float16 queries): measured only at this tile
DEQUANT_TILES = {128: (192, 64, 128, 4)}
#: ``fp8_scores`` tiles: DEFAULTS with BN capped here (BN=128 spills the 88-register producer; ptxas)
FP8_SCORES_BN = {80: 64, 96: 64}
#: head dims whose FP8 default dequantizes K although ``fp8_scores`` applies, unless K comes by TMA (docs/tuning.md)
FP8_SCORES_OFF = (64,)
#: convert-once tiles where they differ from DEFAULTS; one that does not fit falls back (docs/tuning.md)
ONCE_TILES: dict = {64: (128, 128, 64, 4), 256: (128, 112, 256, 2)}

# ----------------------------------------------------------------------------------------------
# issue order and grid

#: (head dim, scales) whose ``fp8_scores`` default issues S in ring order (2-7% faster; per-tensor d256 spills)
FP8_PINGPONG = {(128, "token"), (128, "tensor"), (256, "token")}
#: head dims whose 16-bit default (and convert-once) issues S in ring order (3-4% faster at d256; mixed at d128)
PINGPONG_16BIT = {256}
#: 16-bit tiles run on the persistent grid wherever it applies (5-16% faster at the bench shapes; docs/tuning.md)
PERSISTENT_16BIT = True
#: convert-once runs on a persistent grid up to this head dim (docs/tuning.md)
ONCE_PERSISTENT_MAX_HEAD_DIM = 256

# ----------------------------------------------------------------------------------------------
# FP8 strategy: 'auto' picks by query rows per key (query heads of a KV head included)

#: ``fp8_prefill`` choices (see BatchPrefill)
FP8_PREFILL = ("auto", "fused", "dequantize_first", "convert_once")
#: head dims where 'auto' may convert once
ONCE_HEAD_DIMS = (64, 128, 256)
#: up to this head dim the persistent grid's low thresholds apply (ONCE_MIN_ROWS' first column)
ONCE_LOW_MAX_HEAD_DIM = 128
#: rows per key from which 'auto' converts once, by scales: (persistent grid up to ONCE_LOW_MAX_HEAD_DIM, persistent
#: grid at d256, launch per item); None: never (docs/tuning.md "convert once")
ONCE_MIN_ROWS = {
    "token": (256, 1024, 1024),
    "block": (192, 320, None),
    "tensor": (512, 2048, None),
}
#: rows per key from which 'auto' dequantizes first (token and block scales; per-tensor scales, whose fused kernel
#: runs near bf16 speed): where converting once does not apply (docs/tuning.md)
DEQUANT_MIN_ROWS_PER_KEY = 2048
DEQUANT_MIN_ROWS_PER_KEY_TENSOR = 8192
#: 'auto' takes a workspace strategy only if the 16-bit K and V of every planned key fit this many bytes
DEQUANT_WORKSPACE_LIMIT = 1 << 30


# ----------------------------------------------------------------------------------------------
# 16-bit tiles


def persistent_16bit(head_dim: int, BM: int, BK: int, tma: bool) -> bool:
    """Whether a 16-bit tile runs on the persistent grid: ``PERSISTENT_16BIT``, wherever ``persistent_grid_fits``."""
    return PERSISTENT_16BIT and persistent_grid_fits(head_dim, BM, BK, tma)


def pingpong_16bit(head_dim: int, BM: int) -> bool:
    """Whether a 16-bit tile (and convert-once's, which runs the 16-bit consumers) issues S in ring order: at the
    PINGPONG_16BIT head dims, where there are two or more consumer warpgroups to order."""
    return head_dim in PINGPONG_16BIT and BM >= 128


def pv_wait_16bit(dtype: str, head_dim: int, BN: int, BK: int, stages: int) -> bool:
    """Whether a 16-bit tile (and convert-once's) waits for each P V before the next S (``PrefillConfig.pv_wait``):
    where the ring holds one tile, whose V element must be free before the next tile's V can land (elsewhere the
    overlap is faster; docs/tuning.md)."""
    return stages == KVBufferConfig(dtype, BN, BK, head_dim, stages).one_tile_stages


def tile_config(dtype: str, head_dim: int, page_size: int, BM: int, BN: int, BK: int, stages: int) -> PrefillConfig:
    """The 16-bit config of this tile with the producer, issue order and grid the defaults use: tensor copies (``tma``)
    wherever the pages allow them, S in warpgroup ring order where ``pingpong_16bit`` says, the persistent grid where
    ``persistent_16bit`` says, P V waited for in a ring of one tile (``pv_wait_16bit``). The documented default, the
    autotuner's candidates and its stored records all come from here, so a tuned tile keeps the same order."""
    tma = tma_applies(page_size, BN)
    return PrefillConfig(dtype, head_dim, page_size, BM, BN, BK, stages, tma=tma, pingpong=pingpong_16bit(head_dim, BM),
                         persistent=persistent_16bit(head_dim, BM, BK, tma),
                         pv_wait=pv_wait_16bit(dtype, head_dim, BN, BK, stages))


def default_config(dtype: str, head_dim: int, page_size: int, kv_dtype: str | None = None,
                   scale_block: int = 0) -> PrefillConfig:
    """The documented default (pure: a stored autotune winner is :func:`cukv.tuned.lookup`'s, which
    ``BatchPrefill`` asks first). FP8 caches where S can run on the e4m3 tensor cores (``fp8_scores``: bf16 queries,
    token or tensor scales, head dim 80-256; not 64 without TMA) take the 16-bit default tile, with ``pingpong``
    where FP8_PINGPONG says. Other FP8 caches take it with BN halved until BN * BK <= 8192 (4096 with 32-dim scale
    blocks): the producer's conversion bounds them either way, and wider tiles need more shared memory."""
    if head_dim not in DEFAULTS:
        raise ValueError(f"head_dim={head_dim!r} is not supported by prefill; accepted: {', '.join(map(str, HEAD_DIMS))}")
    bm, bn, bk, st = DEFAULTS[head_dim] if kv_dtype is None else FP8_TILES.get(head_dim, DEFAULTS[head_dim])
    if kv_dtype is not None and fp8_scores_unsupported(dtype, kv_dtype, scale_block, head_dim) is None:
        bn8 = min(bn, FP8_SCORES_BN.get(head_dim, bn))
        tma = tma_applies(page_size, bn8)
        if head_dim not in FP8_SCORES_OFF or tma:
            return PrefillConfig(dtype, head_dim, page_size, bm, bn8, bk, st, kv_dtype=kv_dtype,
                                 scale_block=scale_block, fp8_scores=True, tma=tma,
                                 pingpong=(head_dim, "tensor" if scale_block == 0 else "token") in FP8_PINGPONG)
    if kv_dtype is not None:
        bm, bn, bk, st = DEQUANT_TILES.get(head_dim, (bm, bn, bk, st))
        # 32-dim scale blocks hold two scales per 64-dim chunk column: half the rows again (measured spills)
        limit = 4096 if scale_block == 32 else 8192
        while bn * bk > limit and bn > 16:
            bn //= 2
        return PrefillConfig(dtype, head_dim, page_size, bm, bn, bk, st, kv_dtype=kv_dtype, scale_block=scale_block,
                             tma=tma_applies(page_size, bn))
    return tile_config(dtype, head_dim, page_size, bm, bn, bk, st)


# ----------------------------------------------------------------------------------------------
# convert-once


def once_persistent(head_dim: int, persistent: bool | None = None) -> bool:
    """Whether convert-once runs on the persistent grid: ``persistent`` if given, else up to
    ``ONCE_PERSISTENT_MAX_HEAD_DIM``."""
    return head_dim <= ONCE_PERSISTENT_MAX_HEAD_DIM if persistent is None else bool(persistent)


def once_config(dtype: str, head_dim: int, page_size: int, kv_dtype: str, scale_block: int,
                persistent: bool | None = None) -> PrefillConfig:
    """The convert-once kernel (``PrefillConfig.convert_once``) of an FP8 cache: the head dim's ``ONCE_TILES`` tile
    where it fits, else the 16-bit default tile, else the FP8 fused kernels' (``FP8_TILES``), with
    the 16-bit ``pingpong`` and ``pv_wait`` (its consumers are the 16-bit kernel's), on the grid
    :func:`once_persistent` says."""
    if head_dim not in DEFAULTS or head_dim > 256:
        raise ValueError(f"fp8_prefill='convert_once' supports head_dim up to 256, not {head_dim}")
    persistent = once_persistent(head_dim, persistent)

    def build(tile):
        bm, bn, bk, st = tile
        return PrefillConfig(dtype, head_dim, page_size, bm, bn, bk, st, kv_dtype=kv_dtype, scale_block=scale_block,
                             tma=True, convert_once=True, pingpong=pingpong_16bit(head_dim, bm), persistent=persistent,
                             pv_wait=pv_wait_16bit(dtype, head_dim, bn, bk, st))

    # e.g. 32- and 64-dim blocks at d256 launched per item fit neither ONCE_TILES' tile nor d256's one-tile ring
    candidates = [t for t in (ONCE_TILES.get(head_dim), DEFAULTS[head_dim], FP8_TILES.get(head_dim)) if t is not None]
    for tile in candidates[:-1]:
        try:
            return build(tile)
        except ValueError:
            pass
    return build(candidates[-1])  # the last one says why not


def once_unsupported(dtype: str, head_dim: int, page_size: int, kv_dtype: str, scale_block: int,
                     persistent: bool | None = None) -> str | None:
    """Why ``fp8_prefill='convert_once'`` cannot run this cache (its kernel is invalid: head dim, shared memory), or
    None."""
    return _once_unsupported(dtype, head_dim, page_size, kv_dtype, scale_block, once_persistent(head_dim, persistent))


@lru_cache(maxsize=None)
def _once_unsupported(dtype, head_dim, page_size, kv_dtype, scale_block, persistent) -> str | None:
    # memoized: 'auto' asks on every plan, and building the config to find out takes ~70 us
    try:
        once_config(dtype, head_dim, page_size, kv_dtype, scale_block, persistent)
    except ValueError as e:
        return str(e)
    return None


def scales_kind(head_dim: int, scale_block: int) -> str:
    """'tensor', 'token' or 'block' for an FP8 cache's ``scale_block``."""
    return "tensor" if scale_block == 0 else "token" if scale_block == head_dim else "block"


def once_min_rows(head_dim: int, scale_block: int, persistent: bool | None = None) -> int | None:
    """The rows per key from which 'auto' converts once (``ONCE_MIN_ROWS``), or None."""
    if head_dim not in ONCE_HEAD_DIMS:
        return None
    low, d256, per_item = ONCE_MIN_ROWS[scales_kind(head_dim, scale_block)]
    if not once_persistent(head_dim, persistent):
        return per_item
    return low if head_dim <= ONCE_LOW_MAX_HEAD_DIM else d256


def fp8_strategy(requested: str, config: PrefillConfig, keys: int, rows_per_key: float, workspace_bytes: int,
                 persistent: bool | None = None) -> str:
    """The FP8 strategy a plan runs: 'fused', 'dequantize_first' or 'convert_once'. ``requested`` is
    ``BatchPrefill``'s ``fp8_prefill``; for 'auto', from ``keys`` planned keys, ``rows_per_key`` query rows per key
    and the ``workspace_bytes`` a 16-bit copy of them takes: convert once from ``once_min_rows``, else dequantize
    first from ``DEQUANT_MIN_ROWS_PER_KEY`` (``_TENSOR`` for per-tensor scales), else fused; the workspace must fit
    ``DEQUANT_WORKSPACE_LIMIT``."""
    if config.convert_once:
        return "convert_once"
    if requested != "auto":
        return requested
    if keys == 0 or workspace_bytes > DEQUANT_WORKSPACE_LIMIT:
        return "fused"
    c = config
    once_lo = once_min_rows(c.head_dim, c.scale_block, persistent)
    if (once_lo is not None and once_lo <= rows_per_key
            and once_unsupported(c.dtype, c.head_dim, c.page_size, c.kv_dtype, c.scale_block, persistent) is None):
        return "convert_once"
    many = rows_per_key >= (DEQUANT_MIN_ROWS_PER_KEY_TENSOR if c.scale_block == 0 else DEQUANT_MIN_ROWS_PER_KEY)
    return "dequantize_first" if many else "fused"


# ----------------------------------------------------------------------------------------------
# the persistent grid's item order

#: the last section holds at least this many items per SM, so its long items start while short ones remain to fill
#: the other SMs
TAIL_ITEMS_PER_SM = 4
#: heads of more items than this share of the SMs need no tail section: 128 items (4 x 16 x 4096 on 128-row tiles)
#: ran 0.98x with one, 86 items (1 x 16 x 16384 on 192-row tiles) 1.01-1.02x (H100, docs/tuning.md "MLA prefill")
TAIL_MAX_FILL = 0.75
#: K/V bytes the last section's heads may read: sections of 8 heads of 8 MB each ran 1.03x at 1 x 16 x 16384, of 16
#: heads 0.94x (H100, docs/tuning.md "MLA prefill")
TAIL_L2_BYTES = 64 << 20


def tail_heads(num_work: int, num_heads: int, kv_bytes_per_head: int, num_sms: int) -> int:
    """How many of the last heads the persistent grid runs as one section (templates/prefill_scheduler.cuh), their
    items heaviest first with the heads innermost. A head of ``num_work`` items (up to :data:`TAIL_MAX_FILL` of the
    SMs) would otherwise leave its longest items for the end of the grid; :data:`TAIL_ITEMS_PER_SM` items per SM, at most
    :data:`TAIL_L2_BYTES` of K/V (``kv_bytes_per_head`` each). 1: none.

    >>> from cukv.policy.prefill import tail_heads
    >>> tail_heads(43, 32, 8192 * 512, 132)          # 1 x 32 x 8192 on 192 x 96 tiles: 43 items a head
    13
    >>> tail_heads(11, 128, 18432 * 512, 132)        # 2048 queries over 18432 keys: 7 heads' K/V in 64 MB
    7
    >>> tail_heads(128, 16, 4 * 4096 * 512, 132)     # 4 x 16 x 4096 on 128-row tiles: a head fills the SMs
    1
    """
    if num_heads <= 1 or num_work <= 0 or num_work > TAIL_MAX_FILL * num_sms:
        return 1
    need = -(-TAIL_ITEMS_PER_SM * num_sms // num_work)
    return max(1, min(num_heads, need, TAIL_L2_BYTES // max(1, int(kv_bytes_per_head))))
