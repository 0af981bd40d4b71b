"""MLA prefill policy: the default tile of an :class:`~cukv.configs.mla_prefill.MLAPrefillConfig` and the
specializations shipped. Measurements: docs/tuning.md ("MLA prefill").

Examples
--------
>>> from cukv.policy.mla_prefill import default_config
>>> default_config("bfloat16", page_size=64).name
'cukv_mla_prefill_bf16_p64_m128_n128_s3_pp_pvw_pers_tma'
>>> default_config("bfloat16", page_size=64, num_heads=128).name     # many heads: three consumer warpgroups
'cukv_mla_prefill_bf16_p64_m192_n96_s3_pp_pvw_pers_tma'
"""
from __future__ import annotations

from ..configs.mla_prefill import MLAPrefillConfig

#: (BM, BN, stages, pingpong, pv_wait): 128 keys per tile, S issued in warpgroup order, S and P never live together;
#: 128 x 128 x 2 beat the 64-key ring by 9-18% on every bench shape, 3 stages (on the persistent grid only: off it
#: they spill) another 1.7% (docs/tuning.md "MLA prefill")
TILE = (128, 128, 3, True, True)
#: the tile from WIDE_MIN_HEADS query heads on: 192 query rows (three consumer warpgroups) x 96 keys, 1.03-1.05x
#: TILE at h32 and h128, 0.96-1.00x at h16 (H200, docs/tuning.md "MLA prefill")
WIDE_TILE, WIDE_MIN_HEADS = (192, 96, 3, True, True), 32
#: one block per SM walking the work items, and full tiles by TMA tensor copies: together 1.15-1.16x over one block
#: per item with cp.async (TMA alone 1.13x, the persistent grid alone 1.01x; docs/tuning.md "MLA prefill")
PERSISTENT, TMA = True, True
#: rope sources the shipped kernels read: a contiguous k_rope (0), and the cache page sizes vLLM (16), FlashMLA (64)
#: and a one-token page use
SHIPPED_PAGE_SIZES = (0, 1, 16, 64)


def default_config(dtype: str, page_size: int, num_heads: int | None = None) -> MLAPrefillConfig:
    """The default tile (:data:`TILE`, or :data:`WIDE_TILE` from :data:`WIDE_MIN_HEADS` heads on; :data:`PERSISTENT`,
    :data:`TMA`) for ``dtype``, a rope source of ``page_size`` (0: contiguous) and ``num_heads`` query heads (None:
    :data:`TILE`)."""
    wide = num_heads is not None and num_heads >= WIDE_MIN_HEADS
    bm, bn, stages, pingpong, pv_wait = WIDE_TILE if wide else TILE
    return MLAPrefillConfig(dtype, BM=bm, BN=bn, stages=stages, page_size=page_size, pingpong=pingpong,
                            pv_wait=pv_wait, persistent=PERSISTENT, tma=TMA)


def shipped() -> list:
    """The MLA prefill specializations cukv compiles ahead of time (cukv/specs.py): the default tile per dtype and
    rope source, for few and for many heads."""
    return [default_config(dt, ps, h) for dt in ("bfloat16", "float16") for ps in SHIPPED_PAGE_SIZES
            for h in (None, WIDE_MIN_HEADS)]
