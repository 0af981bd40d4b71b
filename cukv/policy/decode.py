"""Decode policy: the default staging of a ``DecodeConfig`` and the per-batch choices ``BatchDecode.plan`` makes
(register kernel or ring, split count, cluster merge). Measurements: docs/tuning.md.

Examples
--------
>>> from cukv.policy.decode import choose_cluster, choose_splits, decode_config
>>> decode_config("bfloat16", head_dim=128, group=4, page_size=16).stages      # 16-bit pages of 16: a ring
3
>>> decode_config("float16", head_dim=64, group=8, page_size=1).stages         # page size 1: registers
0
>>> choose_splits(batch_size=1, num_kv_heads=8, max_kv_len=32768, slots=132 * 3)   # one long sequence: split
47
>>> choose_splits(batch_size=64, num_kv_heads=8, max_kv_len=4096, slots=132 * 3)   # fill the last wave
3
>>> choose_splits(batch_size=128, num_kv_heads=8, max_kv_len=512, slots=132 * 3)    # short: no split past a wave
1
>>> choose_cluster(batch_size=1, num_kv_heads=8, max_kv_len=1024, num_sms=132)     # a small step: a cluster
8
>>> choose_cluster(batch_size=64, num_kv_heads=8, max_kv_len=4096, num_sms=132)    # more blocks than SMs: none
0
"""
from __future__ import annotations

import dataclasses
import math

from ..configs.decode import CLUSTERS, SMEM_LIMIT, DecodeConfig, DecodeShape

#: ring slots per warp to try, first that fits shared memory wins: 16-bit caches by cp.async, by tensor copies (one strip
#: in flight beside the one computed read faster than two: docs/tuning.md), then FP8
DEFAULT_STAGES = (3, 2)
DEFAULT_TMA_STAGES = (2,)
DEFAULT_FP8_STAGES = (2, 3)  # two slots as fast as three at 3 blocks per SM (docs/tuning.md)
#: the 16-bit ring's whole strips by TMA tensor copies (DecodeConfig.tma) where it applies: 1.04-1.09x the cp.async
#: ring with bitwise the same output (H200, docs/tuning.md "decode `tma`")
DEFAULT_TMA = True
#: plan() stages strips in registers below this much K/V (latency-bound), the ring above it (docs/tuning.md) ...
RING_MIN_BYTES = 192 << 20
#: ... except on these GPU models (a substring of the device name): the H200's ring is ahead at every size from 1 x 512
#: (bf16 and FP8; docs/tuning.md "RING_MIN_BYTES")
RING_MIN_BYTES_BY_GPU = (("H200", 0),)
#: a split count that makes the grid more than one wave needs splits of at least this many tokens (docs/tuning.md)
WAVE_SPLIT_MIN_TOKENS = 1024
#: a cluster merge's splits stay at most this many tokens: longer ones stream too long (docs/tuning.md)
CLUSTER_MAX_TOKENS = 256
#: the FP8 ring's whole strips by TMA tensor copies (DecodeConfig.tma) where it applies: 1.01-1.02x the cp.async FP8
#: ring on an H100, too little to switch (docs/tuning.md "decode `tma`, FP8"), so off
DEFAULT_FP8_TMA = False
#: the FP8 ring's __launch_bounds__ min blocks per SM by GPU model (a substring of the device name), where the kernel
#: fits the register cap (else 1): 3 blocks (168 registers) read 1.13-1.15x faster on an H200 at 16 x 32768 and
#: 128 x 8192 and 0.83-0.96x on an H100 (docs/tuning.md "FP8 ring: min_blocks")
FP8_RING_MIN_BLOCKS = (("H200", 3),)


def staging(dtype, head_dim, group, page_size, num_warps, min_blocks, BN, BK, kv_dtype, scale_block, sub, stages,
            cluster, tma=False) -> tuple:
    """``(stages, sub)`` with None resolved: the first default ring that fits in shared memory where a ring applies
    (and ``sub`` is None or 1), else registers; ``sub`` 2 for the FP8 register kernel up to d128 (two FP8 strips in
    flight match a 16-bit strip's bytes; 32-dim scale blocks need the registers), else 1. Arguments the config
    would reject come back unresolved-safe (0, 1) so that ``DecodeConfig`` names the bad field."""
    shape = DecodeShape()
    vars(shape).update(dtype=dtype, head_dim=head_dim, group=group, page_size=page_size, num_warps=num_warps,
                       min_blocks=min_blocks, BN=BN, BK=BK, kv_dtype=kv_dtype, scale_block=scale_block, sub=sub,
                       stages=stages, cluster=cluster, tma=tma)
    try:
        quantized = kv_dtype is not None
        if stages is None:
            stages = 0
            # the 16-bit ring (decode_ring.cuh) needs whole 16-token strips per page and 64-dim swizzle groups;
            # the FP8 ring (decode.cuh, STAGES > 0) stages whole code rows for the register kernel's fragments
            ring_ok = quantized or (page_size % 16 == 0 and head_dim % 64 == 0)
            depths = DEFAULT_FP8_STAGES if quantized else DEFAULT_TMA_STAGES if tma else DEFAULT_STAGES
            for st in depths if ring_ok and sub in (None, 1) else ():
                shape.stages = st
                if shape.total_smem_bytes <= SMEM_LIMIT:
                    stages = st
                    break
        if sub is None:
            fp8_regs = quantized and stages == 0 and head_dim <= 128 and scale_block != 32
            sub = 2 if fp8_regs else 1
    except (TypeError, ValueError, KeyError, ZeroDivisionError):
        stages = 0 if stages is None else stages
        sub = 1 if sub is None else sub
    return stages, sub


def decode_config(dtype: str = "bfloat16", head_dim: int = 128, group: int = 4, page_size: int = 16,
                  num_warps: int = 4, min_blocks: int = 1, BN: int = 16, BK: int = 32, kv_dtype: str | None = None,
                  scale_block: int = 0, sub: int | None = None, stages: int | None = None,
                  cluster: int = 0, tma: bool | None = False) -> DecodeConfig:
    """A :class:`DecodeConfig` with ``stages``/``sub`` left None set to the default staging (:func:`staging`), and
    ``tma`` None set to :data:`DEFAULT_TMA` (16-bit caches) or :data:`DEFAULT_FP8_TMA` where tensor copies apply
    (off elsewhere)."""
    default_tma = DEFAULT_TMA if kv_dtype is None else DEFAULT_FP8_TMA
    stages, sub = staging(dtype, head_dim, group, page_size, num_warps, min_blocks, BN, BK, kv_dtype, scale_block, sub,
                          stages, cluster, (default_tma if tma is None else tma) is True)
    if tma is None:
        atom = 64 if kv_dtype is None else 128  # dims per 128-byte row atom
        # FP8: token or tensor scales only (DecodeConfig's rule for tensor copies)
        tma = (default_tma and bool(stages) and page_size % 16 == 0 and head_dim % atom == 0
               and (kv_dtype is None or scale_block in (0, head_dim)))
    return DecodeConfig(dtype, head_dim, group, page_size, num_warps, min_blocks, BN, BK, kv_dtype, scale_block, sub,
                        stages, cluster, tma)


def blocks_per_sm(registers: int, threads: int, smem_bytes: int) -> int:
    """Resident blocks per Hopper SM from the compiler's register report (warp registers are allocated in
    units of 256) and static shared memory."""
    warps = threads // 32
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = 65536 // (regs_per_warp * warps)
    by_smem = (227 * 1024) // max(smem_bytes + 1024, 1)
    return max(1, min(by_regs, by_smem, 64 // warps, 32))


def kv_bytes(batch_size: int, max_kv_len: int, num_kv_heads: int, head_dim: int) -> int:
    """K and V bytes of a 16-bit cache that one decode step reads at most."""
    return 2 * 2 * batch_size * max_kv_len * num_kv_heads * head_dim


def choose_splits(batch_size: int, num_kv_heads: int, max_kv_len: int, slots: int) -> int:
    """The split count with the fewest block waves per unit of work: ``ceil(blocks * s / slots) / s`` over
    ``slots`` = SMs x blocks per SM; the smallest count within 5% of the best (each split pays its prologue
    and a merge). A single wave comes out as ``slots // blocks`` splits; past one wave, splits of at least
    :data:`WAVE_SPLIT_MIN_TOKENS` fill the last wave
    (H100, a kernel at 3 blocks per SM: 64 x 4096 is 512 blocks on 396 slots, and 3 splits turn 2 waves, the
    second a third full, into 4 nearly full ones). No split gets under 64 tokens (one 16-token strip per warp
    of a 4-warp block), and the count is trimmed so that no split is left empty (the kernel gives each split
    ``ceil(strips / num_splits)`` strips). Measurements: docs/tuning.md."""
    blocks = max(1, batch_size * num_kv_heads)
    strips = max(1, math.ceil(max_kv_len / 16))
    most = int(max(1, min(math.ceil(strips / 4), 128)))
    # past one wave a split only evens out the waves: it must hold WAVE_SPLIT_MIN_TOKENS, or its prologue and merge cost
    # more than the wave it saves
    counts = [s for s in range(1, most + 1) if s == 1 or blocks * s <= slots or max_kv_len / s >= WAVE_SPLIT_MIN_TOKENS]

    def cost(s):
        return math.ceil(blocks * s / slots) / s

    least = min(cost(s) for s in counts)
    n = min(s for s in counts if cost(s) <= least / 0.95)
    return math.ceil(strips / math.ceil(strips / n))


def choose_cluster(batch_size: int, num_kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """Splits for a cluster merge, or 0 for none: a small step whose (sequence, KV head) pairs times the
    cluster size fit one block per SM, with splits of at most ``CLUSTER_MAX_TOKENS``; with more blocks than SMs
    clusters lose to the global merge (docs/tuning.md)."""
    strips = max(1, math.ceil(max_kv_len / 16))
    c = min(CLUSTERS[-1], num_sms // max(1, batch_size * num_kv_heads), math.ceil(strips / 4))  # >= 64 tokens
    return c if c >= 2 and math.ceil(max_kv_len / c) <= CLUSTER_MAX_TOKENS else 0


def _for_gpu(table, device_name: str | None, default):
    """The value of the first ``(substring, value)`` of ``table`` found in ``device_name``, else ``default``."""
    return next((v for key, v in table if device_name and key in device_name), default)


def ring_min_bytes(device_name: str | None) -> int:
    """The K/V bytes per step from which ``BatchDecode.plan`` stages strips in the ring, on the GPU named
    ``device_name`` (:data:`RING_MIN_BYTES_BY_GPU`, else :data:`RING_MIN_BYTES`).

    >>> from cukv.policy.decode import ring_min_bytes
    >>> [ring_min_bytes(n) >> 20 for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", None)]
    [0, 192, 192]
    """
    return _for_gpu(RING_MIN_BYTES_BY_GPU, device_name, RING_MIN_BYTES)


def at_gpu_occupancy(config: DecodeConfig, device_name: str | None) -> DecodeConfig:
    """``config`` with the FP8 ring's min blocks per SM for the GPU named ``device_name`` (:data:`FP8_RING_MIN_BLOCKS`),
    where its registers allow; any other config (16-bit, the register kernel, no GPU, a ring the cap would spill) as
    it is.

    >>> from cukv.policy.decode import at_gpu_occupancy, decode_config
    >>> ring = decode_config("bfloat16", 128, 4, 16, kv_dtype="fp8_e4m3", scale_block=128)
    >>> [at_gpu_occupancy(ring, n).min_blocks for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", None)]
    [3, 1, 1]
    """
    mb = _for_gpu(FP8_RING_MIN_BLOCKS, device_name, 1)
    if not (config.quantized and config.stages) or mb == config.min_blocks:
        return config
    try:
        return dataclasses.replace(config, min_blocks=mb)
    except ValueError:  # (the register cap: 32-dim scale blocks, d256)
        return config
