"""Prefill kernel configurations: the template parameters of templates/prefill.cu.j2 as frozen dataclasses
(``PrefillConfig`` and its staging ring, ``KVBufferConfig``), their validation and derived sizes. The default tile
per head dim is :mod:`cukv.policy.prefill`'s; :mod:`cukv.ops.prefill` plans and launches them.
"""
from __future__ import annotations

import dataclasses
import math
from functools import cached_property

from ..operand import ONCE_ARGS, PREFILL_ARGS
from ..tma import MAP_BYTES
from .base import KernelConfig
from .checks import CTYPES, SHORT, check_bool, check_in, check_kv_quant, check_range, check_rule

HEAD_DIMS = (64, 80, 96, 128, 192, 256, 512)
#: shared memory one block may use on an H100 (227 KB)
SMEM_LIMIT = 232448


@dataclasses.dataclass(frozen=True)
class KVBufferConfig:
    """MAX ``KVBuffer``'s parameters for cukv's Hopper staging ring (templates/kv_buffer.cuh).

    One ring element is ``BN`` cache rows x ``BK`` dims in 128-byte-swizzle atoms of 64 dims
    (``bk_smem``); ``full_kv`` when one element holds the whole head (``BK`` = head dim rounded up to 64),
    otherwise (head dim 512) a K tile is ``num_k_tiles`` elements of ``BK`` dims and V is read from
    ``head_dim_offset`` on. ``transpose`` is the K role (K-major wgmma operand); V uses the same element
    as an MN-major operand.

    Examples
    --------
    >>> from cukv import KVBufferConfig
    >>> ring = KVBufferConfig("bfloat16", BN=128, BK=128, depth=128, stages=4)
    >>> ring.full_kv, ring.num_k_tiles, ring.smem_stage_size
    (True, 1, 16384)
    >>> KVBufferConfig("bfloat16", BN=64, BK=256, depth=512, stages=4).num_k_tiles   # head dim 512 streams blocks
    2
    >>> KVBufferConfig("bfloat16", BN=128, BK=64, depth=80, stages=4)
    Traceback (most recent call last):
    ...
    ValueError: KVBufferConfig.BK=64 is not valid: must be the head dim rounded up to 64 (128, full_kv) or divide depth=80 (streamed blocks)
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
        check_rule(c, "stages", self.stages, self.stages >= self.one_tile_stages,
                   f"must be >= num_k_tiles + 1 = {self.one_tile_stages} (a tile's K elements and the previous V)")
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
    def one_tile_stages(self) -> int:
        """The shallowest ring: one tile's K elements and a V element (``PrefillConfig.pv_wait`` waits there)."""
        return self.num_k_tiles + 1

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
class PrefillConfig(KernelConfig):
    """Template parameters of one prefill specialization (templates/prefill.cu.j2).

    ``BM`` query rows per block (64 per consumer warpgroup), ``BN`` keys per tile, ``BK`` dims per ring
    element, ``stages`` ring elements, ``page_size`` 0 for contiguous ragged K/V. The default tile per head dim
    (and the switches that go with it) is :func:`cukv.policy.prefill.default_config`'s; pass a config to
    ``BatchPrefill(config=...)`` to override it.

    Examples
    --------
    >>> from cukv import PrefillConfig
    >>> from cukv.policy.prefill import default_config
    >>> cfg = default_config("bfloat16", head_dim=128, page_size=16)
    >>> cfg.BM, cfg.BN, cfg.BK, cfg.stages, cfg.num_threads, cfg.smem_bytes
    (128, 128, 128, 4, 384, 164992)
    >>> cfg.kv_buffer.num_k_tiles, cfg.name in cfg.render()
    (1, True)
    >>> PrefillConfig("bfloat16", head_dim=100)
    Traceback (most recent call last):
    ...
    ValueError: PrefillConfig.head_dim=100 is not valid; accepted: 64, 80, 96, 128, 192, 256, 512
    """

    template = "prefill.cu.j2"

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
    #: ``fp8_scores`` tiles at d128, and d256 with token scales; docs/tuning.md).
    pingpong: bool = False
    #: FP8 caches (``fp8_prefill='convert_once'``): the 16-bit kernel over a workspace the blocks fill as they go.
    #: Three producer warps convert quarter tiles from the FP8 cache (``page_size`` tokens a page) into the workspace
    #: and flag them; the fourth loads flagged tiles into the ring by tensor copies, so each tile is converted once per
    #: call (templates/prefill.cuh ``OnceArgs``). Needs ``tma`` (the workspace's copies), not ``fp8_scores``, head
    #: dims up to 256.
    convert_once: bool = False
    #: one block per SM walks the work items (heaviest first, head by head) from a counter, staging the next item's
    #: query and tiles while the consumers finish the last (templates/prefill.cuh ``PERSISTENT``). ``convert_once``:
    #: the converters take quarters from a queue in the order the items need them and never hold an SM whose
    #: consumers are done. 16-bit caches: needs ``tma``, the whole head in one ring element (``BK >= head_dim``) and
    #: a producer warpgroup (``BM >= 128``); the counter resets itself, so a launch needs no memset.
    persistent: bool = False
    #: each tile's P V completes before the next tile's S is issued (cuDNN's order) instead of overlapping it: S and P
    #: are never live together, so a 128-key tile at d256 fits the consumers' registers, and the V element is released
    #: a tile earlier, which a ring of one tile (``stages`` = K elements + 1) needs. Default there (``pv_wait_16bit``);
    #: elsewhere the overlap is faster (docs/tuning.md).
    pv_wait: bool = False

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
        if self.persistent and not self.convert_once:
            check_rule(c, "persistent", True, not self.quantized,
                       "runs FP8 caches only as convert_once's grid (convert_once=True)")
            check_rule(c, "persistent", True, persistent_grid_fits(self.head_dim, self.BM, self.BK, self.tma),
                       f"needs tensor copies (tma=True), BM >= 128 and the whole head in one ring element "
                       f"(BK >= head_dim); got tma={self.tma}, BM={self.BM}, BK={self.BK}, head_dim={self.head_dim}")
        check_bool(c, "pingpong", self.pingpong)
        check_bool(c, "pv_wait", self.pv_wait)
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
        # a ring of one tile (2) compiles without spills with pv_wait at d256 and on the persistent grids only
        # (ptxas; docs/tuning.md)
        check_rule(c, "stages", self.stages,
                   not (self.BM == 128 and self.BK >= 128 and self.BN >= 96) or self.stages == 4
                   or (self.stages == 2 and self.pv_wait
                       and (self.head_dim == 256 or self.persistent or self.convert_once)),
                   "must be 4 when BM=128, BK>=128 and BN>=96, or 2 with pv_wait=True at head_dim=256, on the "
                   "persistent grid or in convert_once (other depths spill there)")
        # the same, found by compiling every BM 128/192 shape at head_dim >= 192: whole elements of 48-80 rows copied
        # without tensor copies spill at depths 3 and 5-7 (ptxas; docs/tuning.md)
        kb = self.kv_buffer
        check_rule(c, "stages", self.stages,
                   not (self.BM == 128 and self.head_dim >= 192 and kb.full_kv and 48 <= self.BN <= 80
                        and not self.tma) or self.stages in (2, 4),
                   "must be 2 or 4 when BM=128 copies whole elements of head_dim>=192 in tiles of BN=48..80 rows "
                   "without tensor copies (tma=False; other depths spill there)")
        check_rule(c, "stages", self.stages,
                   not (self.BM == 64 and self.head_dim == 256 and self.BN == 128 and kb.full_kv)
                   or self.stages != 3,
                   "must not be 3 when BM=64 copies whole d256 elements in tiles of BN=128 rows (it spills 168-280 "
                   "bytes there)")
        check_rule(c, "BN", self.BN, not (self.head_dim == 192 and self.BK == 64 and self.BM >= 128)
                   or self.BN <= 112,
                   "must be <= 112 when head_dim=192 streams BK=64 blocks beside two or more consumer warpgroups "
                   "(BM>=128; BN=128 spills 20-40 bytes there)")
        limit = self.consumer_registers - 24
        check_rule(c, "BN", self.BN, self.register_estimate <= limit,
                   f"S ({self.BN // 2}) + O ({self.v_cols // 2})" + ("" if self.pv_wait else f" + P ({self.BN // 4})")
                   + f" accumulator registers per thread = {self.register_estimate} would spill (limit {limit} with "
                   f"BM={self.BM}); lower BN or BM" + ("" if self.pv_wait else ", or set pv_wait=True"))

    @cached_property
    def kv_buffer(self) -> KVBufferConfig:
        return KVBufferConfig(self.dtype, self.BN, self.BK, self.head_dim, self.stages)

    @property
    def lazy_rescale(self) -> bool:
        """The consumer's lazy O rescale (templates/prefill_kernel.cuh) where a thread's O holds 128 or more values
        (d256, d512): faster there, while at d64 the warp vote costs more than it saves (docs/tuning.md)."""
        return self.v_cols // 2 >= 128

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
        """Accumulator registers per consumer thread at the peak: S, O and the P V in flight while the next S forms
        (``pv_wait``: P V completes first, so S and O)."""
        return self.BN // 2 + self.v_cols // 2 + (0 if self.pv_wait else self.BN // 4)

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
        # persistent: q_empty and the staged item (10 ints; a 16-bit cache's grid also two next-item slots)
        barriers = (2 * self.stages + 1 + (2 if self.tma and self.quantized and not self.convert_once else 0)
                    + ((6 if self.convert_once else 7) if self.persistent else 0))
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
        if self.convert_once:  # a quarter of K's and V's rows per converter warp (the persistent warp 0 has none)
            return (4 - (1 if self.persistent else 0)) * 2 * per_elem // 4
        return 2 * ((0 if self.fp8_scores else kb.num_k_tiles) + 1) * per_elem

    @property
    def quantized(self) -> bool:
        return self.kv_dtype is not None

    @property
    def name(self) -> str:
        q = ((f"_e4m3s{self.scale_block}" + ("_qk8" if self.fp8_scores else "") if self.quantized else "")
             + ("_tma" if self.tma else "") + ("_once" if self.convert_once else "") + ("_pers" if self.persistent else ""))
        return (f"cukv_prefill_{SHORT[self.dtype]}{q}_d{self.head_dim}_p{self.page_size}_m{self.BM}_n{self.BN}"
                f"_k{self.BK}_s{self.stages}" + ("_pp" if self.pingpong else "") + ("_pvw" if self.pv_wait else ""))

    def render_params(self) -> dict:
        kb = self.kv_buffer
        return dict(
            name=self.name, ctype=CTYPES[self.dtype], head_dim=self.head_dim, BM=self.BM, BN=self.BN,
            BK=self.BK, stages=self.stages, page_size=0 if self.convert_once else self.page_size,
            num_repeats=kb.num_repeats,
            smem_stage_size=kb.smem_stage_size, num_k_tiles=kb.num_k_tiles, num_k_mmas2=kb.num_k_mmas2,
            full_kv=kb.full_kv, num_threads=self.num_threads, num_v_slices=self.num_v_slices,
            smem_bytes=self.smem_bytes, args_bytes=PREFILL_ARGS.itemsize,
            quantized=self.quantized and not self.convert_once,
            scale_block=self.scale_block, producer_registers=self.producer_registers,
            consumer_registers=self.consumer_registers, fp8_scores=self.fp8_scores, q_bytes=self.q_bytes,
            kscale_bytes=self.kscale_bytes, raw_bytes=self.raw_bytes, ks_mma=self.ks_mma, tma_rows=self.tma_rows, maps_bytes=2 * MAP_BYTES,
            pingpong=self.pingpong, once_page=self.page_size if self.convert_once else 0,
            once_args_bytes=ONCE_ARGS.itemsize, persistent=self.persistent, pv_wait=self.pv_wait,
            lazy_rescale=self.lazy_rescale)


def persistent_grid_fits(head_dim: int, BM: int, BK: int, tma: bool) -> bool:
    """What a 16-bit cache's persistent grid needs: tensor copies, a producer warpgroup beside the consumers
    (BM >= 128) and the whole head in one ring element (templates/prefill.cuh's static_assert on PERSISTENT)."""
    return tma and BM >= 128 and BK >= head_dim


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
