"""The non-absorbed MLA prefill's kernel configuration: the template parameters of templates/mla_prefill.cu.j2 as a
frozen dataclass, its validation and the seed's derived sizes (MAX's ``MLAKVProducerPipeline``). The kernel is the
ragged prefill's consumers (192-deep S, 128-wide P V) beside the MLA producer; :mod:`cukv.ops.mla_prefill` plans
and launches it.
"""
from __future__ import annotations

import dataclasses
import math
from functools import cached_property

from ..operand import MLA_PREFILL_ARGS, ONCE_ARGS, PREFILL_ARGS
from ..tma import MAP_BYTES
from .base import KernelConfig
from .checks import CTYPES, SHORT, check_bool, check_in, check_range, check_rule
from .prefill import SMEM_LIMIT, KVBufferConfig

#: per head: 128 "nope" + 64 rope query/key dims, 128 value dims (DeepSeek-V2/V3, Kimi K2)
K_NOPE_DIM, K_ROPE_DIM, V_DIM = 128, 64, 128
QK_DIM = K_NOPE_DIM + K_ROPE_DIM


@dataclasses.dataclass(frozen=True)
class MLAPrefillConfig(KernelConfig):
    """Template parameters of one MLA prefill specialization (templates/mla_prefill.cu.j2).

    ``BM`` query rows per block (64 per consumer warpgroup), ``BN`` keys per tile, ``stages`` ring elements (each
    one tile's K, 192 deep, or its V), ``page_size`` the rope source's: 0 reads a contiguous ``k_rope[Tk, 64]``,
    otherwise the MLA cache's pages through the page table (the bf16 rope part of FP8 rows reads the same way, by
    its strides). ``pingpong`` and ``pv_wait`` are the MHA prefill consumer's switches (:class:`PrefillConfig`).
``persistent``: one block per SM walks the work items (the MHA prefill's persistent grid; BM >= 128). ``tma``: the
tiles wholly inside a sequence come by tensor copies (k_nope / v boxes of BN / 4 tokens; the rope rows' boxes within
a page, or by cp.async where a page is smaller than 8 rows); BN a multiple of 32. ``tma_store``: each consumer warp
stores its 16 output rows through a staging tile in shared memory (``out_bytes``: 256 bytes per query row) by tensor
copies instead of 4-byte stores from every thread (a warp whose rows cross its sequence's end copies them from the
tile itself). The staging does not fit beside BM = 192's usual rings. ``lazy_rescale``: the consumers rescale O
only when a row's running max grows by more than 2^8 (FlashAttention 4's rule; the MHA prefill's at d256).

    Examples
    --------
    >>> from cukv.configs.mla_prefill import MLAPrefillConfig
    >>> cfg = MLAPrefillConfig("bfloat16", BM=128, BN=64, stages=4, page_size=64)
    >>> cfg.k_nope_bytes, cfg.k_rope_bytes, cfg.k_bytes, cfg.v_bytes, cfg.num_qk_stages
    (16384, 8192, 24576, 16384, 1)
    >>> cfg.num_threads, cfg.smem_bytes <= 232448
    (384, True)
    >>> MLAPrefillConfig("bfloat16", BN=20)
    Traceback (most recent call last):
    ...
    ValueError: MLAPrefillConfig.BN=20 is not valid; accepted: 16, 32, 48, 64, 80, 96, 112, 128
    """

    template = "mla_prefill.cu.j2"

    dtype: str = "bfloat16"
    BM: int = 128
    BN: int = 64
    stages: int = 4
    #: the rope source: 0 a contiguous [Tk, 64] array, else tokens per page of the MLA cache
    page_size: int = 64
    pingpong: bool = False
    pv_wait: bool = False
    #: one block per SM walking the work items (PrefillKernel's persistent scheduler)
    persistent: bool = False
    #: k_nope / v (and the rope rows where a page holds 8 or more) of tiles inside the sequence by TMA
    tma: bool = False
    #: the output through shared memory by TMA (per consumer warp; LSE stays a direct store)
    tma_store: bool = False
    #: the consumer's lazy O rescale: O and the row sums are rescaled only when a row's max grows by more than 2^8
    lazy_rescale: bool = False

    def __post_init__(self):
        c = "MLAPrefillConfig"
        check_in(c, "dtype", self.dtype, tuple(CTYPES))
        check_in(c, "BM", self.BM, (64, 128, 192))
        check_in(c, "BN", self.BN, tuple(range(16, 129, 16)))
        check_range(c, "stages", self.stages, 2, 8)
        check_range(c, "page_size", self.page_size, 0, 4096, "0 = a contiguous k_rope")
        check_bool(c, "pingpong", self.pingpong)
        check_bool(c, "pv_wait", self.pv_wait)
        check_bool(c, "persistent", self.persistent)
        check_bool(c, "tma", self.tma)
        check_bool(c, "tma_store", self.tma_store)
        check_bool(c, "lazy_rescale", self.lazy_rescale)
        if self.pingpong:
            check_rule(c, "pingpong", True, self.BM >= 128,
                       f"needs two or more consumer warpgroups (BM >= 128, not {self.BM})")
        if self.persistent:
            check_rule(c, "persistent", True, self.BM >= 128,
                       f"needs a producer warpgroup beside two or more consumer warpgroups (BM >= 128, not {self.BM})")
        if self.tma:
            check_rule(c, "tma", True, self.BN % 32 == 0,
                       f"boxes of BN / 4 rows in whole 8-row swizzle groups need BN a multiple of 32, not {self.BN}")
        # measured (ptxas, sm_90a), as for the MHA prefill's 192-deep elements: BM=128 with BN >= 96 spills at 3 stages
        # (20-40 bytes) beside one block per item, not on the persistent grid (docs/tuning.md, "MLA prefill")
        check_rule(c, "stages", self.stages,
                   not (self.BM == 128 and self.BN >= 96) or self.persistent or self.stages == 4
                   or (self.stages == 2 and self.pv_wait),
                   "must be 4, or 2 with pv_wait=True, when BM=128 and BN>=96 off the persistent grid (other depths "
                   "spill there)")
        if self.tma_store:
            check_rule(c, "tma_store", True, self.smem_bytes <= SMEM_LIMIT,
                       f"its {self.out_bytes}-byte output staging (256 bytes per query row) brings shared memory to "
                       f"{self.smem_bytes} bytes, over {SMEM_LIMIT}; lower BM, BN or stages (BM=192 fits only small rings)")
        check_rule(c, "smem", self.smem_bytes, self.smem_bytes <= SMEM_LIMIT,
                   f"{self.smem_bytes} bytes of shared memory exceed {SMEM_LIMIT}; lower stages, BN or BM")
        limit = self.consumer_registers - 24
        check_rule(c, "BN", self.BN, self.register_estimate <= limit,
                   f"S ({self.BN // 2}) + O ({V_DIM // 2})" + ("" if self.pv_wait else f" + P ({self.BN // 4})")
                   + f" accumulator registers per thread = {self.register_estimate} would spill (limit {limit} with "
                   f"BM={self.BM}); lower BN or BM" + ("" if self.pv_wait else ", or set pv_wait=True"))

    # ---- the seed's derived sizes (MLAKVProducerPipeline; the rendered source re-checks each)
    @property
    def k_nope_elements(self) -> int:
        return self.BN * K_NOPE_DIM

    @property
    def k_rope_elements(self) -> int:
        return self.BN * K_ROPE_DIM

    @property
    def k_elements(self) -> int:
        return self.k_nope_elements + self.k_rope_elements

    @property
    def v_elements(self) -> int:
        return self.BN * V_DIM

    @property
    def k_nope_bytes(self) -> int:
        return self.k_nope_elements * 2

    @property
    def k_rope_bytes(self) -> int:
        return self.k_rope_elements * 2

    @property
    def k_bytes(self) -> int:
        return self.k_nope_bytes + self.k_rope_bytes

    @property
    def v_bytes(self) -> int:
        return self.v_elements * 2

    @property
    def num_kv_stages(self) -> int:
        return self.stages

    @property
    def num_qk_stages(self) -> int:
        """One: a ring element holds the whole 192-deep K."""
        return 1

    # ---- the kernel's layout (PrefillKernel's, with Q/K 192 deep and V 128 wide)
    @cached_property
    def kv_buffer(self) -> KVBufferConfig:
        """The ring: elements of BN rows x 192 dims (K whole; V in the first 128)."""
        return KVBufferConfig(self.dtype, self.BN, QK_DIM, QK_DIM, self.stages)

    @property
    def num_threads(self) -> int:
        return (self.BM // 64 + 1) * 128  # a producer warpgroup + the consumer warpgroups

    @property
    def producer_registers(self) -> int:
        """The 16-bit MHA prefill's split (:attr:`PrefillConfig.producer_registers`): 56, none with one consumer
        warpgroup; 72 on the persistent grid (ptxas, sm_90a: its item walk spills 8-16 bytes in 56 and, with
        ``tma``, in 64)."""
        if self.BM == 64:
            return 0
        return 72 if self.persistent else 56

    @property
    def consumer_registers(self) -> int:
        """224 beside two consumer warpgroups, 152 beside three, 8 fewer where the producer takes 72."""
        if self.BM == 64:
            return 255
        return {2: 224, 3: 152}[self.BM // 64] - (8 if self.producer_registers > 56 else 0)

    @property
    def register_estimate(self) -> int:
        """Accumulator registers per consumer thread at the peak: S, O and (unless ``pv_wait``) the P in flight."""
        return self.BN // 2 + V_DIM // 2 + (0 if self.pv_wait else self.BN // 4)

    @property
    def tma_rows(self) -> int:
        """Tokens per k_nope / v box (a producer warp's rows of the tile); 0 without ``tma``."""
        return self.BN // 4 if self.tma else 0

    @property
    def rope_tma_rows(self) -> int:
        """Tokens per rope box: the largest whole swizzle groups dividing both :attr:`tma_rows` and the page (a
        contiguous k_rope: :attr:`tma_rows`); 0 (the rope rows by cp.async) without ``tma`` or where a page holds
        fewer than 8 rows in such groups."""
        if not self.tma:
            return 0
        g = self.tma_rows if self.page_size == 0 else math.gcd(self.tma_rows, self.page_size)
        return g if g % 8 == 0 else 0

    @property
    def q_bytes(self) -> int:
        return self.BM * QK_DIM * 2

    @property
    def out_bytes(self) -> int:
        """``tma_store``'s output staging: a 16-row tile of 128 values per consumer warp (BM x 128 x 2 bytes)."""
        return self.BM * V_DIM * 2 if self.tma_store else 0

    @property
    def smem_bytes(self) -> int:
        # full/empty per element, the query's; persistent: q_empty, the staged item (10 ints) and two next-item slots
        barriers = 2 * self.stages + 1 + (7 if self.persistent else 0)
        return 1024 + self.q_bytes + self.stages * self.kv_buffer.stage_bytes + self.out_bytes + barriers * 8

    @property
    def name(self) -> str:
        return (f"cukv_mla_prefill_{SHORT[self.dtype]}_p{self.page_size}_m{self.BM}_n{self.BN}_s{self.stages}"
                + ("_pp" if self.pingpong else "") + ("_pvw" if self.pv_wait else "")
                + ("_pers" if self.persistent else "") + ("_tma" if self.tma else "")
                + ("_st" if self.tma_store else "") + ("_lr" if self.lazy_rescale else ""))

    def render_params(self) -> dict:
        return dict(
            name=self.name, ctype=CTYPES[self.dtype], BM=self.BM, BN=self.BN, stages=self.stages,
            page_size=self.page_size, pingpong=self.pingpong, pv_wait=self.pv_wait, persistent=self.persistent,
            tma=self.tma, tma_rows=self.tma_rows, rope_tma_rows=self.rope_tma_rows, maps_bytes=3 * MAP_BYTES,
            tma_store=self.tma_store, out_bytes=self.out_bytes, lazy_rescale=self.lazy_rescale,
            once_args_bytes=ONCE_ARGS.itemsize,
            producer_registers=self.producer_registers, consumer_registers=self.consumer_registers,
            q_bytes=self.q_bytes, smem_bytes=self.smem_bytes, num_threads=self.num_threads,
            k_nope_bytes=self.k_nope_bytes, k_rope_bytes=self.k_rope_bytes, k_bytes=self.k_bytes,
            v_bytes=self.v_bytes, k_elements=self.k_elements, v_elements=self.v_elements,
            num_kv_stages=self.num_kv_stages, num_qk_stages=self.num_qk_stages,
            args_bytes=PREFILL_ARGS.itemsize, mla_args_bytes=MLA_PREFILL_ARGS.itemsize)
