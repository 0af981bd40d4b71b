"""The decode kernel's config (templates/decode.cu.j2) and its derived sizes (``DecodeShape``)."""
from __future__ import annotations

import dataclasses
import math

from ..operand import DECODE_ARGS
from .base import KernelConfig
from ..tma import MAP_BYTES
from .checks import CTYPES, SHORT, check_bool, check_in, check_kv_quant, check_range, check_rule

HEAD_DIMS = (64, 96, 128, 256)
RING_STAGES = (2, 3, 4, 5, 6, 8)
CLUSTERS = (0, 2, 3, 4, 5, 6, 7, 8)  # 8: the portable cluster size
SMEM_LIMIT = 227 * 1024


class DecodeShape:
    """The decode kernel's derived sizes from its fields (``DecodeConfig``'s; the policy evaluates them for a
    candidate staging before it builds the config)."""

    @property
    def quantized(self) -> bool:
        return self.kv_dtype is not None

    @property
    def register_cap(self) -> int:
        """Registers per thread ``__launch_bounds__(num_threads, min_blocks)`` leaves ptxas (at most 255)."""
        return min(255, 65536 // (self.num_threads * self.min_blocks) // 8 * 8)

    @property
    def min_registers(self) -> int:
        """The smallest ``register_cap`` under which this kernel compiles without spilling, from a ptxas sweep of every
        head dim, group and cache kind at caps 255, 168 and 128 (docs/tuning.md). Up to d64 everything fits 128 but the FP8 register kernel (168); the FP8 ring at
        d128 (token, per-tensor and 64-dim scales) fits 168; the rest needs 255, i.e. num_warps * min_blocks <= 8."""
        if self.head_dim <= 64:
            return 168 if self.quantized and not self.stages else 128
        if self.head_dim == 128 and self.quantized and self.stages and self.scale_block != 32:
            return 168
        return 255

    # --- the seed's comptime members
    mma_shape = (16, 8, 16)

    @property
    def MMA_N(self) -> int:
        return self.mma_shape[1]

    @property
    def MMA_K(self) -> int:
        return self.mma_shape[2]

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def num_k_strips(self) -> int:
        return self.head_dim // self.BK

    @property
    def num_k_mmas2(self) -> int:
        return math.ceil(self.BK / self.MMA_K)

    @property
    def num_v_groups(self) -> int:
        return math.ceil(self.head_dim / 64)

    @property
    def num_mmas(self) -> int:
        """Output n-tiles of P.V (8 per 64-dim V group)."""
        return self.num_v_groups * (64 // self.MMA_N)

    @property
    def input_frag_size(self) -> int:
        return self.MMA_K * self.MMA_N // 32

    @property
    def ring_slot_bytes(self) -> int:
        """One ring slot: a 16-token K and V strip (16-bit), or for FP8 the strip's K and V code rows (pitch 128
        bytes, 256 past head_dim 128) and their float32 scales (one per token and scale block)."""
        if not self.quantized:
            return 2 * self.BN * self.head_dim * 2
        sb = self.scale_block or self.head_dim
        pitch = 256 if self.head_dim > 128 else 128
        return 2 * self.BN * pitch + 4 * self.BN * (self.head_dim // sb + -(-self.head_dim // sb))

    @property
    def ring_smem_bytes(self) -> int:
        """Dynamic shared memory of the ring: per warp, ``stages`` slots; with ``tma`` also one 8-byte mbarrier per
        slot and 1024 bytes of slack to align the slots to the 128-byte swizzle's 1024-byte pattern (FP8: the code
        rows of every slot, then the slots' scales, the same bytes)."""
        slots = self.num_warps * self.stages * self.ring_slot_bytes
        return slots + 1024 + 8 * self.num_warps * self.stages if self.tma else slots

    @property
    def total_smem_bytes(self) -> int:
        return self.smem_bytes + self.ring_smem_bytes

    @property
    def merge_slot_floats(self) -> int:
        """Floats of one warp's merge slot: its [group, head_dim] output, rows padded by 8 (bank spread)."""
        return self.group * (self.head_dim + 8)

    @property
    def warp_slots(self) -> bool:
        """The register kernel merges its warps through per-warp slots (one barrier) when they fit in static
        shared memory beside Q; otherwise warps take turns on one [group, head_dim] sum. The 16-bit ring
        kernel always has them: each warp's slot lies in its own ring slots once its strips are done."""
        register_kernel = self.stages == 0 or self.quantized
        return register_kernel and 4 * self.num_warps * self.merge_slot_floats <= 36 * 1024

    @property
    def q_in_smem(self) -> bool:
        """Q lives in shared memory past head_dim 128 (its registers go to the output accumulator) and in the
        FP8 ring kernel (its registers buy a third block per SM)."""
        return self.head_dim > 128 or (self.quantized and self.stages > 0)

    @property
    def smem_bytes(self) -> int:
        """Static shared memory: per-warp (m, l), block (M, L), the merge (a [group, head_dim] sum or the warp
        slots), and Q when head_dim > 128 (its registers go to the output accumulator; the ring kernel pads
        its rows by 8)."""
        pitch = self.head_dim + (8 if self.stages and not self.quantized else 0)
        q_smem = 2 * 16 * pitch if self.q_in_smem else 16
        o_sum = 1 if self.warp_slots else self.group * self.head_dim
        slots = 4 * self.num_warps * self.merge_slot_floats if self.warp_slots else 4
        head = _round16(4 * (2 * 16 * self.num_warps + 2 * 16 + o_sum)) + slots + 8  # slots 16-byte aligned; `last`, `q_amax`
        return _round16(_round16(head) + q_smem)  # q is 16-byte aligned, and so is the struct


@dataclasses.dataclass(frozen=True)
class DecodeConfig(DecodeShape, KernelConfig):
    """Template parameters of the decode kernel (one compiled specialization).

    The derived sizes are MAX ``DecodeStreamingKVBuffer``'s comptime members for cukv's register-staged
    strip (mma shape 16x8x16, BN=16 tokens, BK=32 dims), rendered into the source and re-checked there by
    ``static_assert``. Every field is explicit: :func:`cukv.policy.decode.decode_config` fills ``stages`` and
    ``sub`` left None with the default staging.

    Examples
    --------
    >>> from cukv import DecodeConfig
    >>> from cukv.policy.decode import decode_config
    >>> cfg = decode_config("bfloat16", head_dim=128, group=4, page_size=16)   # the policy picks the staging
    >>> cfg.name, cfg.stages, cfg.sub, cfg.num_threads
    ('cukv_decode_bf16_d128_g4_p16_w4_b1_r3', 3, 1, 128)
    >>> DecodeConfig("bfloat16", 128, 4, 16, stages=0, sub=1).name          # the register kernel, spelled out
    'cukv_decode_bf16_d128_g4_p16_w4_b1'
    >>> cfg.name in cfg.render()                                            # the CUDA source (no GPU needed)
    True
    >>> DecodeConfig("bfloat16", 100, 4, 16, stages=0, sub=1)
    Traceback (most recent call last):
    ...
    ValueError: DecodeConfig.head_dim=100 is not valid: must be a multiple of 32 (64, 96, 128, 256 ship)
    """

    template = "decode.cu.j2"

    dtype: str = "bfloat16"
    head_dim: int = 128
    group: int = 4
    page_size: int = 16
    num_warps: int = 4
    min_blocks: int = 1
    BN: int = 16
    BK: int = 32
    #: cache element type: None (the query's dtype) or 'fp8_e4m3' (dequantized to ``dtype`` in registers)
    kv_dtype: str | None = None
    #: FP8: dims per scale (the head dim for per-token scales), 0 for per-tensor scales
    scale_block: int = 0
    #: 16-token strips each warp keeps in flight (FP8 defaults to 2 so the bytes in flight match bf16)
    sub: int | None = None
    #: shared-memory ring slots per warp (cp.async staging: ``decode_ring.cuh`` for 16-bit caches, which needs
    #: a page size that is a multiple of 16 and a head dim that is a multiple of 64; the FP8 ring in
    #: ``decode.cuh`` for FP8 caches); 0 stages strips in registers (``decode_config``: None, the ring where it applies).
    stages: int | None = None
    #: splits merged inside one thread-block cluster of this many blocks through distributed shared memory
    #: (2..8; the launch then needs num_splits == cluster); 0 merges through global memory (any split count)
    cluster: int = 0
    #: the ring's whole strips by TMA tensor copies (128-byte atom columns, 128-byte swizzle, one mbarrier per slot)
    #: instead of cp.async; strips cut by the context's ends or on unmapped pages still go by cp.async, and so do FP8
    #: scales. Needs the ring (stages > 0), page_size a multiple of 16 and rows of whole 128-byte atoms: head_dim a
    #: multiple of 64 (16-bit cache) or of 128 (FP8). Defaults: docs/tuning.md.
    tma: bool = False

    def __post_init__(self):
        c = "DecodeConfig"
        check_in(c, "cluster", self.cluster, CLUSTERS)
        check_in(c, "dtype", self.dtype, tuple(CTYPES))
        check_range(c, "head_dim", self.head_dim, 32, 256, "a multiple of 32")
        check_rule(c, "head_dim", self.head_dim, self.head_dim % 32 == 0, "must be a multiple of 32 (64, 96, 128, 256 ship)")
        check_range(c, "group", self.group, 1, 16, "query heads per KV head")
        check_range(c, "page_size", self.page_size, 1, 4096)
        check_in(c, "num_warps", self.num_warps, (1, 2, 4, 8))
        check_in(c, "min_blocks", self.min_blocks, (1, 2, 3, 4))
        check_in(c, "BN", self.BN, (16,))
        check_in(c, "BK", self.BK, (32,))
        check_kv_quant(c, self.kv_dtype, self.scale_block, self.head_dim)
        if self.quantized:
            check_rule(c, "scale_block", self.scale_block, not (self.scale_block == 32 and self.head_dim > 128),
                       "32-dim scale blocks need more registers than head_dim > 128 leaves (use 64, 128 or per token)")
        # the 16-bit ring (decode_ring.cuh) needs whole 16-token strips per page and 64-dim swizzle groups;
        # the FP8 ring (decode.cuh, STAGES > 0) stages whole code rows for the register kernel's fragments
        ring_ok = self.quantized or (self.page_size % 16 == 0 and self.head_dim % 64 == 0)
        for f in ("stages", "sub"):
            check_rule(c, f, getattr(self, f), getattr(self, f) is not None,
                       "None is resolved by cukv.policy.decode.decode_config(...), which picks the default staging")
        check_in(c, "stages", self.stages, (0,) + RING_STAGES)
        check_in(c, "sub", self.sub, (1, 2, 3, 4))
        check_bool(c, "tma", self.tma)
        if self.tma:
            check_rule(c, "tma", self.tma, self.page_size % 16 == 0,
                       f"a tensor copy takes 16 tokens of one page: page_size={self.page_size} must be a multiple of 16")
            atom = 128 if self.quantized else 64  # dims per 128-byte atom
            kind = "FP8" if self.quantized else "16-bit"
            check_rule(c, "tma", self.tma, self.head_dim % atom == 0,
                       f"tensor copies move 128-byte atoms ({atom} {kind} dims): head_dim={self.head_dim} must be a "
                       f"multiple of {atom}")
            check_rule(c, "tma", self.tma, self.stages > 0, "tensor copies fill the shared-memory ring: stages must be 2..8")
            # measured: with 32- or 64-dim scale blocks the FP8 tensor-copy ring's output differed from the cp.async
            # ring's on an H100 (docs/tuning.md "decode `tma`"); one scale per token or per tensor matched bit for bit
            check_rule(c, "tma", self.tma, not self.quantized or self.scale_block in (0, self.head_dim),
                       f"an FP8 cache by tensor copies takes token or tensor scales (scale_block {self.head_dim} or "
                       f"0), not scale_block={self.scale_block}")
        if self.stages:
            check_rule(c, "stages", self.stages, ring_ok,
                       "the shared-memory ring needs a 16-bit cache, page_size a multiple of 16 and head_dim a "
                       "multiple of 64, or an FP8 cache (use stages=0)")
            check_rule(c, "stages", self.stages, self.sub == 1, f"a ring (stages={self.stages}) replaces sub={self.sub}: use sub=1")
            check_rule(c, "stages", self.stages, self.total_smem_bytes <= SMEM_LIMIT,
                       f"{self.total_smem_bytes} bytes of shared memory exceed {SMEM_LIMIT}; lower stages or num_warps")
        if self.quantized and self.scale_block == 64 and self.head_dim > 128:
            check_rule(c, "stages", self.stages, self.stages > 0 or self.group <= 8,
                       f"0 (the register kernel) spills with 64-dim scale blocks at head_dim={self.head_dim} and "
                       f"group={self.group} > 8; use the ring (stages=None or 2..8)")
        check_rule(c, "min_blocks", self.min_blocks, self.register_cap >= self.min_registers,
                   f"with num_warps={self.num_warps} caps registers at {self.register_cap} per thread (__launch_bounds__), "
                   f"below the {self.min_registers} this kernel needs without spilling; lower min_blocks or num_warps")

    @property
    def name(self) -> str:
        q = f"_e4m3s{self.scale_block}" if self.quantized else ""
        sub = f"_s{self.sub}" if self.sub != 1 else ""
        ring = f"_r{self.stages}" if self.stages else ""
        tma = "_tma" if self.tma else ""
        cl = f"_c{self.cluster}" if self.cluster else ""
        return (f"cukv_decode_{SHORT[self.dtype]}{q}_d{self.head_dim}_g{self.group}_p{self.page_size}_w{self.num_warps}"
                f"_b{self.min_blocks}{sub}{ring}{tma}{cl}")

    def render_params(self) -> dict:
        return dict(
            name=self.name, ctype=CTYPES[self.dtype], page_size=self.page_size,
            head_dim=self.head_dim, group=self.group, num_warps=self.num_warps, min_blocks=self.min_blocks,
            num_k_strips=self.num_k_strips, num_k_mmas2=self.num_k_mmas2, num_mmas=self.num_mmas,
            input_frag_size=self.input_frag_size, smem_bytes=self.smem_bytes, args_bytes=DECODE_ARGS.itemsize,
            quantized=self.quantized, scale_block=self.scale_block, sub=self.sub, stages=self.stages, cluster=self.cluster,
            ring_smem_bytes=self.ring_smem_bytes, ring_slot_bytes=self.ring_slot_bytes, q_in_smem=self.q_in_smem, warp_slots=self.warp_slots,
            merge_slot_floats=self.merge_slot_floats, tma=self.tma, maps_bytes=2 * MAP_BYTES)


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16
