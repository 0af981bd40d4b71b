"""MLA prefill policy: the default tile of an :class:`~cukv.configs.mla_prefill.MLAPrefillConfig` and the
specializations shipped. Measurements: docs/tuning.md ("MLA prefill").

Examples
--------
>>> from cukv.policy.mla_prefill import default_config, wide_tile
>>> default_config("bfloat16", page_size=64).name
'cukv_mla_prefill_bf16_p64_m128_n128_s3_pp_pers_tma_st_lr'
>>> default_config("bfloat16", page_size=64, wide=True).name     # three consumer warpgroups
'cukv_mla_prefill_bf16_p64_m192_n96_s3_pp_pvw_pers_tma_lr'
>>> wide_tile([8192], [8192], "causal"), wide_tile([2048] * 4, [2048] * 4, "causal")   # 4096 vs 1024 keys a query
(True, False)
"""
from __future__ import annotations

from ..configs.mla_prefill import MLAPrefillConfig

#: (BM, BN, stages, pingpong, pv_wait): 128 keys per tile, S issued in warpgroup order; 128 x 128 beat the 64-key
#: ring by 9-18% on every bench shape, 3 stages (persistent grid only: off it they spill) another 1.7%; on three
#: stages P V(t) overlaps S(t + 1) (no pv_wait): 1.01-1.05x on short prompts and h16 (docs/tuning.md "MLA prefill")
TILE = (128, 128, 3, True, False)
#: TILE stores O through shared memory by TMA (MLAPrefillConfig.tma_store): the batches it serves (short prompts) have
#: short items, whose direct stores held the consumers before the next item: 1.01-1.05x there (docs/tuning.md)
TILE_TMA_STORE = True
#: the tile where queries see WIDE_MIN_KEYS keys or more on average: 192 query rows (three consumer warpgroups) x 96
#: keys, 1.03-1.06x TILE on long prompts and over long prefixes, 0.93-0.99x on short causal prompts (2048-4096 tokens,
#: where the 192-row tiles split sequences unevenly) (H200, docs/tuning.md "MLA prefill")
WIDE_TILE, WIDE_MIN_KEYS = (192, 96, 3, True, True), 3072
#: one block per SM walking the work items, and full tiles by TMA tensor copies: together 1.15-1.16x over one block
#: per item with cp.async (TMA alone 1.13x, the persistent grid alone 1.01x; docs/tuning.md "MLA prefill")
PERSISTENT, TMA = True, True
#: the consumers' lazy O rescale (MLAPrefillConfig.lazy_rescale): at BN 96-128 the per-tile O multiply (64 per thread)
#: costs as much as the exponentials of the tile's scores; skipping it until a max grows by 2^8: 1.036x (192 x 96)
#: and 1.030x (128 x 128) geomean (H100, docs/tuning.md "MLA prefill")
LAZY_RESCALE = True
#: rope sources the shipped kernels read: a contiguous k_rope (0), and the cache page sizes vLLM (16), FlashMLA (64)
#: and a one-token page use
SHIPPED_PAGE_SIZES = (0, 1, 16, 64)


def wide_tile(q_lengths, kv_lengths, mask: str) -> bool:
    """Whether a batch takes :data:`WIDE_TILE`: its queries see :data:`WIDE_MIN_KEYS` keys or more on average
    (``mask`` 'causal': query i of a sequence sees ``kv_len - q_len + i + 1`` keys; 'none': all)."""
    import numpy as np

    q = np.asarray(q_lengths, np.float64)
    kv = np.asarray(kv_lengths, np.float64)
    pairs = q * kv if mask == "none" else q * (kv - q) + q * (q + 1) / 2
    return bool(q.sum() > 0 and pairs.sum() >= WIDE_MIN_KEYS * q.sum())


def default_config(dtype: str, page_size: int, wide: bool = False) -> MLAPrefillConfig:
    """The default tile (:data:`TILE` with :data:`TILE_TMA_STORE`, or :data:`WIDE_TILE` when ``wide``;
    :data:`PERSISTENT`, :data:`TMA`, :data:`LAZY_RESCALE`) for ``dtype`` and a rope source of ``page_size`` (0: contiguous)."""
    bm, bn, stages, pingpong, pv_wait = WIDE_TILE if wide else TILE
    return MLAPrefillConfig(dtype, BM=bm, BN=bn, stages=stages, page_size=page_size, pingpong=pingpong,
                            pv_wait=pv_wait, persistent=PERSISTENT, tma=TMA, tma_store=TILE_TMA_STORE and not wide,
                            lazy_rescale=LAZY_RESCALE)


def shipped() -> list:
    """The MLA prefill specializations cukv compiles ahead of time (cukv/specs.py): the default tile per dtype and
    rope source, both tiles."""
    return [default_config(dt, ps, w) for dt in ("bfloat16", "float16") for ps in SHIPPED_PAGE_SIZES
            for w in (False, True)]
