"""Ragged prefill over a paged (or contiguous) KV cache: Hopper wgmma kernel, FlashInfer-style plan/run.

``plan`` takes the host-side query offsets and KV lengths once per batch, fixes the mask and builds the
work list (one item per 64..192 query rows, heaviest first); ``run`` reads only device buffers, so it can
be captured in a CUDA graph.
"""
from __future__ import annotations

import dataclasses
import math
from functools import cached_property, lru_cache

import numpy as np

from . import compiler
from .arrays import as_device, attention_outputs, check_aligned, check_contiguous, element_dtype
from .device import sm_count
from .config import CTYPES, SHORT, check_bool, check_in, check_kv_quant, check_range, check_rule
from .operand import KV_PARAMS, ONCE_ARGS, PREFILL_ARGS, as_kernel_arg, kv_params, ptr
from .tma import MAP_BYTES

HEAD_DIMS = (64, 80, 96, 128, 192, 256, 512)
#: shared memory one block may use on an H100 (227 KB)
SMEM_LIMIT = 232448
MASKS = ("none", "causal")


@dataclasses.dataclass(frozen=True)
class KVBufferConfig:
    """MAX ``KVBuffer``'s parameters for cukv's Hopper staging ring (templates/kv_buffer.cuh).

    One ring element is ``BN`` cache rows x ``BK`` dims in 128-byte-swizzle atoms of 64 dims
    (``bk_smem``); ``full_kv`` when one element holds the whole head (``BK`` = head dim rounded up to 64),
    otherwise (head dim 512) a K tile is ``num_k_tiles`` elements of ``BK`` dims and V is read from
    ``head_dim_offset`` on. ``transpose`` is the K role (K-major wgmma operand); V uses the same element
    as an MN-major operand.
    """

    dtype: str = "bfloat16"
    BN: int = 128
    BK: int = 128
    depth: int = 128
    stages: int = 4
    transpose: bool = True
    swizzle: int = 128
    cache_depth: int | None = None
    head_dim_offset: int = 0

    def __post_init__(self):
        c = "KVBufferConfig"
        check_in(c, "dtype", self.dtype, tuple(CTYPES))
        check_range(c, "depth", self.depth, 16, 512, "a multiple of 16")
        check_rule(c, "depth", self.depth, self.depth % 16 == 0, "must be a multiple of 16")
        check_in(c, "BN", self.BN, tuple(range(16, 129, 16)))  # one row per producer lane
        check_in(c, "BK", self.BK, (64, 128, 192, 256))
        check_rule(c, "BK", self.BK, self.BK == _round64(self.depth) or (self.BK < self.depth and self.depth % self.BK == 0),
                   f"must be the head dim rounded up to 64 ({_round64(self.depth)}, full_kv) or divide "
                   f"depth={self.depth} (streamed blocks)")
        check_range(c, "stages", self.stages, 2, 8)
        check_rule(c, "stages", self.stages, self.stages >= self.num_k_tiles + 1,
                   f"must be >= num_k_tiles + 1 = {self.num_k_tiles + 1} (a tile's K elements and the previous V)")
        check_in(c, "swizzle", self.swizzle, (128,))
        check_bool(c, "transpose", self.transpose)
        cd = self.cache_depth if self.cache_depth is not None else self.depth
        check_range(c, "cache_depth", cd, self.depth, 4096, "at least depth")
        check_range(c, "head_dim_offset", self.head_dim_offset, 0, cd - self.depth, "depth columns must fit the row")

    mma_shape = (64, 8, 16)  # wgmma m64nNk16; N is BN for S and the V width for O

    @property
    def bk_smem(self) -> int:
        return 64

    @property
    def full_kv(self) -> bool:
        return self.BK >= self.depth

    @property
    def num_repeats(self) -> int:
        return self.BK // self.bk_smem

    @property
    def smem_cols(self) -> int:
        return self.BK

    @property
    def smem_stage_size(self) -> int:
        return self.BN * self.smem_cols

    @property
    def stage_bytes(self) -> int:
        return self.smem_stage_size * 2

    @property
    def num_k_tiles(self) -> int:
        return -(-self.depth // self.BK)

    @property
    def num_k_mmas2(self) -> int:
        return self.BK // self.mma_shape[2]

    @property
    def zero_partial_tile_pad(self) -> bool:
        """True when the last atom is partly padding (zero-filled once in shared memory)."""
        return self.depth % self.bk_smem != 0


def _round64(n: int) -> int:
    return -(-n // 64) * 64


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Template parameters of one prefill specialization (templates/prefill.cu.j2).

    ``BM`` query rows per block (64 per consumer warpgroup), ``BN`` keys per tile, ``BK`` dims per ring
    element, ``stages`` ring elements, ``page_size`` 0 for contiguous ragged K/V.
    """

    dtype: str = "bfloat16"
    head_dim: int = 128
    page_size: int = 16
    BM: int = 128
    BN: int = 128
    BK: int = 128
    stages: int = 4
    #: cache element type: None (same as ``dtype``) or 'fp8_e4m3' (dequantized by the producer warps)
    kv_dtype: str | None = None
    #: FP8: dims per scale (the head dim for per-token scales), 0 for per-tensor scales
    scale_block: int = 0
    #: FP8: S = Q K^T on the e4m3 tensor cores (K stays as codes; the query is split into two e4m3 terms per
    #: row) and only V is dequantized. bf16 queries, per-token or per-tensor scales, head dim <= 256.
    fp8_scores: bool = False
    #: the producer brings K/V in by tensor copies (TMA), one box of ``tma_rows`` tokens of a page per leading
    #: lane, instead of a cp.async per 16 bytes per lane. Needs ``gcd(page_size, BN / 4)`` a multiple of 8. 16-bit
    #: caches: boxes go straight into the ring, and the tile holding a sequence's end keeps cp.async (its zero fill
    #: keeps unused slots out of P V); FP8: codes land in raw slots (and K, with ``fp8_scores``, in the ring).
    tma: bool = False
    #: the consumer warpgroups issue their S wgmmas in a fixed ring order (named barriers), so their softmax phases
    #: run staggered instead of in lock-step. Needs BM >= 128. Default where ``FP8_PINGPONG`` lists it (FP8
    #: ``fp8_scores`` tiles at d128, and d256 with token scales: 2-4% faster on H100; benchmarks/NOTES.md session 17).
    pingpong: bool = False
    #: FP8 caches (``fp8_prefill='convert_once'``): the 16-bit kernel over a workspace the blocks fill as they go.
    #: Three producer warps convert quarter tiles from the FP8 cache (``page_size`` tokens a page) into the workspace
    #: and flag them; the fourth loads flagged tiles into the ring by tensor copies, so each tile is converted once per
    #: call (templates/prefill.cuh ``OnceArgs``). Needs ``tma`` (the workspace's copies), not ``fp8_scores``, head
    #: dims up to 256.
    convert_once: bool = False
    #: ``convert_once`` only: one block per SM walks the work items in the grid's order, staging the next item's query
    #: and tiles while the consumers finish the last; the converters take quarters from a queue in the order the items
    #: need them and never hold an SM whose consumers are done (templates/prefill.cuh ``PERSISTENT``).
    persistent: bool = False

    def __post_init__(self):
        c = "PrefillConfig"
        check_in(c, "dtype", self.dtype, tuple(CTYPES))
        check_kv_quant(c, self.kv_dtype, self.scale_block, self.head_dim)
        if self.quantized:
            check_rule(c, "page_size", self.page_size, self.page_size > 0, "FP8 prefill reads a paged cache (not 0)")
        check_bool(c, "fp8_scores", self.fp8_scores)
        if self.fp8_scores:
            why = fp8_scores_unsupported(self.dtype, self.kv_dtype, self.scale_block, self.head_dim)
            check_rule(c, "fp8_scores", True, why is None, f"needs {why}")
        check_bool(c, "tma", self.tma)
        check_bool(c, "convert_once", self.convert_once)
        if self.convert_once:
            check_rule(c, "convert_once", True, self.quantized, "needs an FP8 cache (kv_dtype='fp8_e4m3')")
            check_rule(c, "convert_once", True, not self.fp8_scores, "runs 16-bit scores (fp8_scores=False)")
            check_rule(c, "convert_once", True, self.tma, "loads its workspace by tensor copies (tma=True)")
            check_rule(c, "convert_once", True, self.head_dim <= 256 and self.BK >= self.head_dim,
                       f"needs the whole head in one ring element (head_dim <= 256, BK >= head_dim; got "
                       f"{self.head_dim}, {self.BK})")
            check_rule(c, "convert_once", True, self.BM >= 128,
                       f"needs a producer warpgroup beside two or three consumer warpgroups (BM >= 128, not {self.BM})")
        elif self.tma:
            g = tma_box_rows(self.page_size, self.BN)
            check_rule(c, "tma", True, tma_applies(self.page_size, self.BN),
                       f"needs gcd(page_size={self.page_size}, BN/4={self.BN // 4}) = {g} to be a multiple of 8 "
                       "(a box is whole 8-row swizzle groups of one page)")
        check_bool(c, "persistent", self.persistent)
        if self.persistent:
            check_rule(c, "persistent", True, self.convert_once, "is convert_once's grid (convert_once=True)")
        check_bool(c, "pingpong", self.pingpong)
        if self.pingpong:
            check_rule(c, "pingpong", True, self.BM >= 128,
                       f"needs two or more consumer warpgroups (BM >= 128, not {self.BM})")
        check_in(c, "head_dim", self.head_dim, HEAD_DIMS)
        check_range(c, "page_size", self.page_size, 0, 4096, "0 = contiguous K/V")
        check_in(c, "BM", self.BM, (64, 128, 192))
        self.kv_buffer  # validates BN, BK, stages
        check_rule(c, "smem", self.smem_bytes, self.smem_bytes <= SMEM_LIMIT,
                   f"{self.smem_bytes} bytes of shared memory exceed {SMEM_LIMIT}; lower stages, BN or BM")
        # measured (ptxas, sm_90a): with two consumer warpgroups, wide tiles and 2-atom+ elements, any ring
        # depth but 4 spills a few bytes of the ring arithmetic
        check_rule(c, "stages", self.stages,
                   not (self.BM == 128 and self.BK >= 128 and self.BN >= 96) or self.stages == 4,
                   "must be 4 when BM=128, BK>=128 and BN>=96 (other depths spill there)")
        limit = self.consumer_registers - 24
        check_rule(c, "BN", self.BN, self.register_estimate <= limit,
                   f"S ({self.BN // 2}) + O ({self.v_cols // 2}) + P ({self.BN // 4}) accumulator registers per thread "
                   f"= {self.register_estimate} would spill (limit {limit} with BM={self.BM}); lower BN or BM")

    @cached_property
    def kv_buffer(self) -> KVBufferConfig:
        return KVBufferConfig(self.dtype, self.BN, self.BK, self.head_dim, self.stages)

    @property
    def v_cols(self) -> int:
        """V columns one block accumulates (a 512 head is split over two blocks of 256)."""
        return min(self.head_dim, self.BK)

    @property
    def num_v_slices(self) -> int:
        return -(-self.head_dim // self.v_cols)

    @property
    def num_threads(self) -> int:
        return (self.BM // 64 + 1) * 128  # a producer warpgroup + the consumer warpgroups

    @property
    def consumer_registers(self) -> int:
        """Registers per consumer thread after setmaxnreg (one consumer warpgroup keeps the launch's 255): 224 beside
        two consumer warpgroups, 152 beside three, less an equal share of what the producer takes above 56."""
        if self.BM == 64:
            return 255
        return {2: 224, 3: 152}[self.BM // 64] - (self.producer_registers - 56) // (self.BM // 64)

    @property
    def producer_registers(self) -> int:
        """Registers per producer thread after setmaxnreg (0: no setmaxnreg with one consumer warpgroup). 56 for
        16-bit caches and for a TMA producer beside three consumer warpgroups; an FP8 producer otherwise holds a
        batch of raw chunks: 80 beside three, 72 beside two, 88 when it also forms K code copies (``fp8_scores``)
        or issues tensor copies there, except a TMA producer with ``fp8_scores`` up to d128, which fits in 72."""
        if self.BM == 64:
            return 0
        if self.convert_once:  # warps 1-3 convert two 8-code pieces at a time (multiples of 8 for setmaxnreg)
            return 80 if self.BM == 192 else 72
        if not self.quantized or (self.tma and self.BM == 192):
            return 56
        if self.BM == 192:
            return 80
        if self.fp8_scores and self.tma and self.head_dim <= 128:
            return 72
        return 88 if self.fp8_scores or self.tma else 72

    @property
    def tma_rows(self) -> int:
        """Tokens per tensor copy (0: cp.async): the most rows that stay inside a page and a producer warp's rows;
        convert-once's contiguous workspace: the whole tile."""
        if self.convert_once:
            return self.BN  # the workspace is contiguous: one box per tile and 64-dim atom
        return tma_box_rows(self.page_size, self.BN) if self.tma else 0

    @property
    def tma_k_ring(self) -> bool:
        """K boxes go straight into the 128-byte swizzled ring (16-bit caches, and FP8 with ``fp8_scores``); else
        into a raw slot, row-major, for the producer's conversion."""
        return self.fp8_scores or not self.quantized or self.convert_once

    @property
    def tma_v_ring(self) -> bool:
        """V boxes go straight into the ring (16-bit caches; FP8 V is always converted from a raw slot)."""
        return not self.quantized or self.convert_once

    @property
    def tma_k_box_cols(self) -> int:
        """Bytes per K box row: one 128-byte swizzle atom into the ring, else a raw element row of BK codes."""
        return 128 if self.tma_k_ring else self.kv_buffer.BK

    @property
    def tma_v_box_cols(self) -> int:
        """Bytes per V box row, as for K (dims past the head read as zeros)."""
        return 128 if self.tma_v_ring else self.kv_buffer.BK

    @property
    def register_estimate(self) -> int:
        return self.BN // 2 + self.v_cols // 2 + self.BN // 4

    @property
    def q_bytes(self) -> int:
        """The staged query: BM rows of T, or with ``fp8_scores`` two e4m3 terms of BM rows x 128-code atoms."""
        if self.fp8_scores:
            return 2 * self.BM * -(-self.head_dim // 128) * 128
        return self.BM * _round64(self.head_dim) * 2

    @property
    def ks_mma(self) -> bool:
        """``fp8_scores`` with token scales, TMA, BN a multiple of 32 and heads up to 128: the K scales reach the
        score columns through one bf16 wgmma per tile (the producer splits each into three bf16 terms) instead of
        shared loads per thread (templates/prefill.cuh ``kKsMma``)."""
        return (self.fp8_scores and self.scale_block > 0 and self.tma and self.BN % 32 == 0
                and self.head_dim <= 128)

    @property
    def kscale_bytes(self) -> int:
        """``fp8_scores`` with token scales: each ring element's K row scales (``ks_mma``: the fixed 1 KB A operand
        and BN/2 rows of 16 bytes per element)."""
        if self.ks_mma:
            return 64 * 16 + self.stages * (self.BN // 2) * 16
        return self.stages * self.BN * 4 if self.fp8_scores and self.scale_block else 0

    @property
    def smem_bytes(self) -> int:
        ring = self.stages * self.kv_buffer.stage_bytes
        # full/empty per element, Q; FP8 TMA: one per raw slot
        # persistent: q_empty and the staged item (10 ints)
        barriers = (2 * self.stages + 1 + (2 if self.tma and self.quantized and not self.convert_once else 0)
                    + (6 if self.persistent else 0))
        return 1024 + self.q_bytes + ring + self.raw_bytes + self.kscale_bytes + barriers * 8

    @property
    def raw_bytes(self) -> int:
        """FP8: two raw tile slots that cp.async fills a tile ahead of the producer's conversion into the ring;
        each holds the K elements (none with ``fp8_scores``) and the V element as BN x BK codes plus the rows'
        scales (none per tensor)."""
        if not self.quantized:
            return 0
        kb = self.kv_buffer
        scales_per_row = -(-kb.BK // self.scale_block) if self.scale_block else 0
        per_elem = self.BN * kb.BK + self.BN * scales_per_row * 4
        if self.convert_once:
            return 2 * per_elem  # one raw tile, K and V, for the tiles a block converts
        return 2 * ((0 if self.fp8_scores else kb.num_k_tiles) + 1) * per_elem

    @property
    def quantized(self) -> bool:
        return self.kv_dtype is not None

    @property
    def name(self) -> str:
        q = ((f"_e4m3s{self.scale_block}" + ("_qk8" if self.fp8_scores else "") if self.quantized else "")
             + ("_tma" if self.tma else "") + ("_once" if self.convert_once else "") + ("_pers" if self.persistent else ""))
        return (f"cukv_prefill_{SHORT[self.dtype]}{q}_d{self.head_dim}_p{self.page_size}_m{self.BM}_n{self.BN}"
                f"_k{self.BK}_s{self.stages}" + ("_pp" if self.pingpong else ""))

    def render(self) -> str:
        kb = self.kv_buffer
        return compiler.render(
            "prefill.cu.j2", name=self.name, ctype=CTYPES[self.dtype], head_dim=self.head_dim, BM=self.BM, BN=self.BN,
            BK=self.BK, stages=self.stages, page_size=0 if self.convert_once else self.page_size,
            num_repeats=kb.num_repeats,
            smem_stage_size=kb.smem_stage_size, num_k_tiles=kb.num_k_tiles, num_k_mmas2=kb.num_k_mmas2,
            full_kv=kb.full_kv, num_threads=self.num_threads, num_v_slices=self.num_v_slices,
            smem_bytes=self.smem_bytes, args_bytes=PREFILL_ARGS.itemsize,
            quantized=self.quantized and not self.convert_once,
            scale_block=self.scale_block, producer_registers=self.producer_registers,
            consumer_registers=self.consumer_registers, fp8_scores=self.fp8_scores, q_bytes=self.q_bytes,
            kscale_bytes=self.kscale_bytes, ks_mma=self.ks_mma, tma_rows=self.tma_rows, maps_bytes=2 * MAP_BYTES,
            pingpong=self.pingpong, once_page=self.page_size if self.convert_once else 0,
            once_args_bytes=ONCE_ARGS.itemsize, persistent=self.persistent)

    @cached_property
    def compiled(self) -> compiler.CompiledModule:
        return compiler.compile_source(self.name, self.render())


#: documented defaults per head dim (BM, BN, BK, stages); see docs in README "Prefill configs"
DEFAULTS = {
    64: (192, 96, 64, 6),
    80: (128, 128, 128, 4),
    96: (128, 128, 128, 4),
    128: (128, 128, 128, 4),
    192: (128, 64, 192, 4),
    256: (128, 64, 256, 4),
    512: (64, 64, 256, 4),
}

#: FP8 caches whose producer also dequantizes K (block scales, float16 queries) start from these tiles instead of
#: DEFAULTS: d128 moved to 128 x 128 in session 19 (16-bit and ``fp8_scores`` measured faster there), but these kernels
#: were measured only at 192 x 64
DEQUANT_TILES = {128: (192, 64, 128, 4)}
#: ``fp8_scores`` tiles take DEFAULTS but for these BN limits: at BN=128 the 88-register producer beside two
#: consumer warpgroups spills (ptxas, d80/d96)
FP8_SCORES_BN = {80: 64, 96: 64}
#: head dims whose FP8 default keeps K dequantized although ``fp8_scores`` applies, unless the codes come by TMA: at
#: d64 the per-score K scale multiply lands on the consumers' softmax, which bounds the short d64 tiles (H100, cp.async
#: producer: 0.77x of bf16 against 0.89x; d80-d256 gain 4-37%, benchmarks/NOTES.md session 9). With the TMA producer
#: d64 measured 0.90x with e4m3 scores against 0.85x dequantized (session 11).
FP8_SCORES_OFF = (64,)
#: (head dim, scales) whose ``fp8_scores`` default issues S in ring order (``PrefillConfig.pingpong``): H100, four A/B
#: calls (session 17), token scales 2-4% faster at d128 and d256, per-tensor 1-7% at d128; d64 2% slower; others not
#: measured. Per-tensor d256 spills 12 bytes with it (ptxas, 168 registers), so it stays off.
FP8_PINGPONG = {(128, "token"), (128, "tensor"), (256, "token")}


def fp8_scores_unsupported(dtype: str, kv_dtype, scale_block: int, head_dim: int) -> str | None:
    """Why S = Q K^T cannot run on the e4m3 tensor cores for these parameters (None: it can)."""
    if kv_dtype is None:
        return "kv_dtype='fp8_e4m3'"
    if dtype != "bfloat16":
        # two e4m3 terms keep about 8 significant bits: bf16's, not float16's 11 (float16 queries keep the
        # dequantizing path, which stages K in float16)
        return "dtype='bfloat16'"
    if scale_block not in (0, head_dim):
        return "one scale per K row (scale_granularity 'token' or 'tensor'), not blocks of dims"
    if head_dim > 256:
        return "head_dim <= 256"
    return None


def tma_box_rows(page_size: int, BN: int) -> int:
    """Tokens per tensor copy: the most rows that stay inside one page (if paged: ``page_size`` > 0) and inside a
    producer warp's BN / 4 rows."""
    return math.gcd(page_size, BN // 4)


def tma_applies(page_size: int, BN: int) -> bool:
    """Whether a tile of BN keys can come by tensor copies from pages of ``page_size`` (0: contiguous K/V): the
    boxes must be whole 8-row swizzle groups."""
    return tma_box_rows(page_size, BN) % 8 == 0


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


def once_config(dtype: str, head_dim: int, page_size: int, kv_dtype: str, scale_block: int,
                persistent: bool | None = None) -> PrefillConfig:
    """The convert-once kernel (``PrefillConfig.convert_once``) of an FP8 cache: the 16-bit default tile of the
    head dim (its consumers are the 16-bit kernel's), on a persistent grid up to ``ONCE_PERSISTENT_MAX_HEAD_DIM``
    unless ``persistent`` (or ``ONCE_PERSISTENT``) says otherwise."""
    if head_dim not in DEFAULTS or head_dim > 256:
        raise ValueError(f"fp8_prefill='convert_once' supports head_dim up to 256, not {head_dim}")
    bm, bn, bk, st = DEFAULTS[head_dim]
    return PrefillConfig(dtype, head_dim, page_size, bm, bn, bk, st, kv_dtype=kv_dtype, scale_block=scale_block,
                         tma=True, convert_once=True,
                         persistent=_once_persistent(head_dim) if persistent is None else persistent)


def _once_persistent(head_dim: int) -> bool:
    return head_dim <= ONCE_PERSISTENT_MAX_HEAD_DIM if ONCE_PERSISTENT is None else ONCE_PERSISTENT


def tile_config(dtype: str, head_dim: int, page_size: int, BM: int, BN: int, BK: int, stages: int) -> PrefillConfig:
    """The 16-bit config of this tile with the producer the defaults use: tensor copies (``tma``) wherever the
    pages allow them (3-19% faster than cp.async on H100 at the bench shapes, benchmarks/NOTES.md session 18)."""
    return PrefillConfig(dtype, head_dim, page_size, BM, BN, BK, stages, tma=tma_applies(page_size, BN))


def default_config(dtype: str, head_dim: int, page_size: int, kv_dtype: str | None = None,
                   scale_block: int = 0) -> PrefillConfig:
    """The documented default (or this GPU's autotuned winner). FP8 caches where S can run on the e4m3 tensor
    cores (``fp8_scores``: bf16 queries, token or tensor scales, head dim 80-256; not 64, measured slower)
    take the 16-bit default tile, with ``pingpong`` (S issued in warpgroup ring order) where FP8_PINGPONG says.
    Other FP8 caches take it with BN halved until BN * BK <= 8192 (4096 with 32-dim scale blocks):
    wider tiles measured no faster there (the producer's conversion bounds them either way,
    benchmarks/NOTES.md) and need more shared memory."""
    if head_dim not in DEFAULTS:
        raise ValueError(f"head_dim={head_dim!r} is not supported by prefill; accepted: {', '.join(map(str, HEAD_DIMS))}")
    bm, bn, bk, st = DEFAULTS[head_dim]
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
    from .autotune import lookup

    tuned = lookup(dtype, head_dim, page_size)
    if tuned is not None:
        return tuned
    return tile_config(dtype, head_dim, page_size, bm, bn, bk, st)


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
#: 'auto' converts once (token scales, these head dims) from ONCE_MIN_ROWS_PER_KEY query rows per key up to, not
#: including, ONCE_MAX_ROWS_PER_KEY, where dequantizing first is as fast. Session 28 (persistent grid up to d128), one
#: call, convert_once / dequantize_first: GQA 4 d128 b4 L4096 (8448) 1.07 / 0.97, b1 L16384 (33024) 0.98 / 1.02, MHA
#: d128 b8 L2048 (1088) 1.03 / 0.82, MHA d256 b4 L4096 (2112) 0.89 / 0.88, d64 GQA 4 b8 L2048 (4096) 1.07 / 0.97.
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
ONCE_MAX_ROWS_PER_KEY = 16384
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
#: d256 (launch per item) token scales keep ONCE_MIN_ROWS_PER_KEY (b16 L1024 (576): 0.86 / 0.74 / 0.84), and 32- and
#: 64-dim blocks do not fit convert-once's shared memory (128-dim blocks are unmeasured there).
ONCE_MIN_ROWS_PER_KEY_PERSISTENT = 256
ONCE_MIN_ROWS_PER_KEY_BLOCK = 192
ONCE_MIN_ROWS_PER_KEY_TENSOR = 512
#: On the persistent grid at d256 (session 30, one call, bf16/FP8 for fused / dequantize_first / convert_once on the
#: persistent grid, rows per key in brackets): token MHA b64 L256 (192) 0.90 / 0.65 / 0.73, b32 L512 (320) 0.91 / 0.69
#: / 0.81, b16 L1024 (576) 0.86 / 0.74 / 0.87, b4 L4096 (2112) - / - / 1.02, b2 L8192 (4160) 0.81 / 0.95 / 1.00, GQA 4
#: b4 L4096 (8448) 0.86 / 0.92 / 1.07: token scales keep ONCE_MIN_ROWS_PER_KEY there. 128-dim blocks 0.74 / 0.68 /
#: 0.78 (320), 0.59 / 0.74 / 0.85 (576), 0.51 / 0.91 / 1.00 (2112), 0.51 / 1.02 / 1.03 (8448):
#: ONCE_MIN_ROWS_PER_KEY_BLOCK.
#: Per-tensor 0.97 / - / 0.83 (320), 0.97 / - / 0.89 (576), 1.00 / - / 0.97 (2112), 1.01 / - / 1.02 (8448): fused
#: stays, so per-tensor and the low token threshold apply up to ONCE_LOW_MAX_HEAD_DIM.
ONCE_LOW_MAX_HEAD_DIM = 128


def _once_min_rows(head_dim: int, scale_block: int) -> int | None:
    """The rows per key from which 'auto' converts once, or None. On the persistent grid up to ONCE_LOW_MAX_HEAD_DIM:
    every granularity (token / block / per-tensor thresholds); at d256 token scales from ONCE_MIN_ROWS_PER_KEY and
    block scales (where they fit) from ONCE_MIN_ROWS_PER_KEY_BLOCK (per-tensor: the fused kernel is as fast); on a
    launch-per-item grid token scales only."""
    if head_dim not in ONCE_HEAD_DIMS:
        return None
    if not _once_persistent(head_dim):
        return ONCE_MIN_ROWS_PER_KEY if scale_block == head_dim else None
    if scale_block == 0:  # at d256 the fused per-tensor kernel is as fast or faster
        return ONCE_MIN_ROWS_PER_KEY_TENSOR if head_dim <= ONCE_LOW_MAX_HEAD_DIM else None
    if scale_block == head_dim:
        return ONCE_MIN_ROWS_PER_KEY_PERSISTENT if head_dim <= ONCE_LOW_MAX_HEAD_DIM else ONCE_MIN_ROWS_PER_KEY
    return ONCE_MIN_ROWS_PER_KEY_BLOCK


def once_tile_order(tiles_per_seq) -> np.ndarray:
    """The workspace tiles (sequences' tiles back to back) in the order a persistent converter takes them within a
    KV head under ``CUKV_ONCE_ORDER`` (templates/prefill.cuh): by distance below their sequence's top tile, longer
    sequences first among equals. Every work item walks its keys from its last tile down, and the heaviest-first
    order starts the items with the highest last tiles first, so those tiles are demanded first (a schedule model,
    benchmarks/model_once_schedule.py: 1-2% at MHA d256 against sequence by sequence, bottom up)."""
    t = np.asarray(tiles_per_seq)
    if t.ndim != 1 or (t.size and (t.dtype.kind not in "iu" or t.min() < 0)):
        raise ValueError(f"once_tile_order: tiles_per_seq must be a 1-D array of non-negative integers, got "
                         f"{np.asarray(tiles_per_seq).tolist()!r}")
    t = t.astype(np.int64)
    start = np.concatenate([[0], np.cumsum(t)[:-1]]).astype(np.int64)
    seq = np.repeat(np.arange(t.size), t)
    n = np.arange(int(t.sum())) - start[seq]
    return np.lexsort((seq, -t[seq], t[seq] - 1 - n)).astype(np.int32)


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
        takes ``'convert_once'`` below ``ONCE_MAX_ROWS_PER_KEY`` query rows per key (query heads of a KV head
        included): up to ``ONCE_LOW_MAX_HEAD_DIM`` from ``ONCE_MIN_ROWS_PER_KEY_PERSISTENT`` for token scales,
        ``ONCE_MIN_ROWS_PER_KEY_BLOCK`` for block scales and ``ONCE_MIN_ROWS_PER_KEY_TENSOR`` for per-tensor
        scales; at d256 for token scales from ``ONCE_MIN_ROWS_PER_KEY`` and block scales from
        ``ONCE_MIN_ROWS_PER_KEY_BLOCK``; else
        ``'dequantize_first'`` from ``DEQUANT_MIN_ROWS_PER_KEY`` rows per key (``DEQUANT_MIN_ROWS_PER_KEY_TENSOR``
        for per-tensor scales, whose fused kernel runs near bf16 speed), else ``'fused'``; the workspaces must
        fit ``DEQUANT_WORKSPACE_LIMIT`` bytes. ``strategy`` says which one ``plan`` chose. All read the plan's
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
        self._dequant = None
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
        self._planned = True
        return self

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
        if (once_lo is not None and once_lo <= rows_per_key < ONCE_MAX_ROWS_PER_KEY
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
        # then the persistent converters' tile order under CUKV_ONCE_ORDER (templates/prefill.cuh), and a last 0 so
        # that the array is never empty (a real pointer)
        tile_seq = np.concatenate([tile_seq, once_tile_order(padded // cfg.BN), [0]]).astype(np.int32)
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
        from . import tma

        d = self._once
        once = np.zeros((), ONCE_ARGS)
        once["fp8"], once["flags"], once["num_kv_heads"] = rec["kv"], ptr(d["flags"]) + 128, self.num_kv_heads
        once["tile_seq"], once["num_work"], once["ws_tiles"] = ptr(d["tile_seq"]), d["num_work"], d["ws_tiles"]
        rec["kv"], rec["work"] = d["kv"], ptr(d["work"])
        args = (as_kernel_arg(rec), d["maps"], as_kernel_arg(once))
        if d["cfg"].persistent:
            args += (tma.as_maps_arg(tma.encode_pages("q", tma.OnePage(q.view(np.uint8)), 128, d["cfg"].BM,
                                                      tma.SWIZZLE_128B)),)
        return args, d["cfg"], d["num_work"]

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
