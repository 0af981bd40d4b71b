"""MLADecodeConfig: the template parameters of the absorbed MLA decode kernel (templates/mla_decode.cu.j2).

The derived sizes follow the seed's ``MLAKVProducerPipeline`` vocabulary (``k_nope_bytes``, ``k_rope_bytes``,
``k_bytes``, ``v_bytes``, ``num_kv_stages``) and are re-checked by ``static_assert`` in the rendered source.
"""
from __future__ import annotations

import dataclasses
import typing

import numpy as np

from .base import KernelConfig
from .checks import CTYPES, SHORT, check_bool, check_in, check_range, check_rule

NOPE, ROPE, DIM = 512, 64, 576
BLOCK_M = 64              # query rows per block (one wgmma M); heads x s_q fold into them
SMEM_LIMIT = 227 * 1024   # Hopper's opt-in dynamic shared memory per block
BLOCK_NS = (32, 64)
#: consumer schedules: "split" (each warpgroup scores half of every tile, templates/mla_decode_consumer.cuh) or
#: "alternate" (warpgroup g scores tiles 2k + g whole, the softmaxes overlap the other's wgmmas;
#: templates/mla_decode_consumer_alt.cuh)
#: or "narrow" (blocks of 16 or 32 query rows, ``block_rows``: the tile's 64 tokens are the wgmma M and the rows its N,
#: so few heads waste no tensor work on padding rows; templates/mla_decode_consumer_narrow.cuh)
SCHEDULES = ("split", "alternate", "narrow")
CONSUMERS = {"split": "MLADecodeConsumer", "alternate": "MLADecodeAltConsumer", "narrow": "MLADecodeNarrowConsumer"}
#: query rows per block of the "narrow" schedule (the wgmma N); the others take BLOCK_M
NARROW_ROWS = (16, 32)
#: the alternating consumers over per-slice barriers (``slice_release``; templates/mla_decode_consumer_slices.cuh)
SLICE_CONSUMER = "MLADecodeSliceConsumer"
#: 64-column slices of a K tile with barriers of their own under ``slice_release`` (0-7 are also V, 8 is the rope part)
SLICES = DIM // 64
# register split: the producer only forms addresses (56 like prefill's); the consumers get the rest of
# 3 x 168 (the 384-thread launch allocation) for O's 128 accumulators beside S and P. An FP8 producer holds
# 8 rows of codes and scales (96); the consumers then get 200 (they use 168 in the 16-bit kernel).
PRODUCER_REGS, CONSUMER_REGS = 56, 224
FP8_PRODUCER_REGS, FP8_CONSUMER_REGS = 96, 200
#: persistent blocks (``MLADecodeConfig.persistent``): the producer's item loop spills 16 bytes in 56 or 64 registers
PERSISTENT_REGS = (72, 216)
#: FP8 rows each producer lane holds in flight (``fp8_rows``) -> (producer, consumer) registers: 16 rows of codes
#: need 152 producer registers (0 spills; 128 spilled), leaving 176 per consumer (the split consumers use 168;
#: docs/tuning.md "MLA decode")
FP8_ROWS_REGS = {8: (FP8_PRODUCER_REGS, FP8_CONSUMER_REGS), 16: (152, 176)}
#: the L2 prefetch distances (``prefetch_tiles``) offered, in tiles; 0: none
PREFETCH_TILES = (0, 1, 2, 3, 4)

#: threads of a combine block (kMlaCombineThreads in templates/mla_decode_combine.cuh): four warps share a row
COMBINE_THREADS = 128

# the kernel's by-value argument: templates/mla_decode.cuh MLADecodeParams
PARAMS = np.dtype([
    ("q_nope", "<u8"), ("q_pe", "<u8"), ("out", "<u8"), ("lse", "<u8"), ("part_o", "<u8"), ("part_lse", "<u8"),
    ("sink", "<u8"), ("cache", "<u8"), ("block_table", "<u8"), ("seq_lens", "<u8"), ("items", "<u8"),
    ("num_items", "<u8"), ("rb_indptr", "<u8"), ("rb_slots", "<u8"), ("comb_rbs", "<u8"),
    ("q_nope_stride", "<i8", (3,)), ("q_pe_stride", "<i8", (3,)),
    ("page_stride", "<i8"), ("row_stride", "<i8"), ("table_stride", "<i8"),
    ("num_pages", "<i4"), ("page_size", "<i4"), ("table_width", "<i4"), ("batch", "<i4"),
    ("s_q", "<i4"), ("heads", "<i4"), ("rows", "<i4"), ("row_blocks", "<i4"),
    ("scale_log2", "<f4"), ("pad", "<f4"),
    # sparse MLA only (cukv/configs/sparse_mla.py); the dense kernels never read them
    ("indices", "<u8"), ("topk_lengths", "<u8"), ("max_logits", "<u8"), ("part_max", "<u8"),
    ("indices_stride", "<i8"), ("num_rows", "<i4"), ("topk", "<i4"), ("lengths_div", "<i4"), ("pad2", "<i4")])


@dataclasses.dataclass(frozen=True)
class MLADecodeConfig(KernelConfig):
    """One compiled specialization of absorbed MLA decode (576/512, 64 query rows per block). The defaults
    ``BatchMLADecode`` picks are :mod:`cukv.policy.mla_decode`'s (``DEFAULT_BLOCK_N``, ``DEFAULT_STAGES``).

    Examples
    --------
    >>> from cukv import MLADecodeConfig
    >>> cfg = MLADecodeConfig("bfloat16", block_n=64, num_kv_stages=2)
    >>> cfg.name, cfg.k_bytes, cfg.smem_bytes          # one K tile: 64 rows x 576 bf16; Q + 2 tiles + P + stats
    ('cukv_mla_decode_bf16_n64_s2', 73728, 231488)
    >>> MLADecodeConfig("bfloat16", block_n=64, num_kv_stages=3)
    Traceback (most recent call last):
    ...
    ValueError: MLADecodeConfig.num_kv_stages=3 is not valid: the ring needs 305216 bytes of shared memory ...
    """

    template = "mla_decode.cu.j2"
    #: the cache rows are gathered per key (sparse MLA): cp.async feeds the per-slice ring without tensor copies
    gathers: typing.ClassVar[bool] = False

    #: query, output and 16-bit cache element type
    dtype: str = "bfloat16"
    #: tokens per K tile (each consumer warpgroup scores half of them)
    block_n: int = 64
    #: K tiles in flight in the shared-memory ring
    num_kv_stages: int = 2
    #: cache rows: None (16-bit, ``dtype``) or 'fp8_e4m3' (656-byte rows dequantized into bf16 tiles)
    kv_dtype: str | None = None
    #: the consumer warpgroups' schedule (``SCHEDULES``): "split" halves every tile between them, "alternate" gives
    #: each every other tile (docs/mla.md, "Schedules")
    schedule: str = "split"
    #: full tiles of a 16-bit cache by TMA tensor copies (9 boxes of 64 columns per page run) instead of cp.async;
    #: the page size then decides at run time (``tma_box_rows``): pages of 1-4 tokens, and a tile that ends past
    #: its chunk, still go by cp.async
    tma: bool = False
    #: tiles ahead whose rows the producer brings into L2 (``cp.async.bulk.prefetch``) before it loads a tile; 0: none
    prefetch_tiles: int = 0
    #: FP8 cache rows each producer lane loads before it dequantizes them (8 or 16; ``FP8_ROWS_REGS``)
    fp8_rows: int = 8
    #: a full and an empty barrier per 64-column slice of each stage (``SLICES`` = 9), so a slice is refilled as soon as
    #: its last reader is done (Q K^T for the rope slice, the P V of the warpgroup owning its columns for the others),
    #: with the alternating consumers in FlashMLA's order; needs ``schedule="alternate"`` and ``tma`` (docs/mla.md,
    #: "Schedules")
    slice_release: bool = False
    #: the consumers rescale O and l only when a row's running max grows by more than 2^8 (FlashAttention 4's rule; the
    #: MLA prefill's ``lazy_rescale``): a thread's O holds 128 values against 16-32 scores a tile
    lazy_rescale: bool = False
    #: query rows per block: ``BLOCK_M`` (64), or 16 / 32 with ``schedule="narrow"`` (``NARROW_ROWS``), which serves
    #: a batch whose ``s_q * num_heads`` rows fit one such block
    block_rows: int = BLOCK_M
    #: FP8 rows: the producer issues a tile's rope copies before its code loads (their latencies overlap) instead of
    #: each row's behind its codes
    fp8_rope_first: bool = False
    #: with ``slice_release``: the two row blocks of each chunk run as a cluster pair, and each full tile's slices are
    #: copied once from L2 and multicast into both blocks' rings (the pair releases a slice together); ``plan`` keeps
    #: a chunk's row blocks side by side in pairs, so it needs an even count of row blocks (``s_q * num_heads / 64``)
    multicast: bool = False
    #: with ``slice_release``: a grid of one block per SM (pairs: a cluster per two SMs), each block taking the work
    #: items ``blockIdx.x``, ``blockIdx.x + gridDim.x``, ...: the ring's phases run on across items, the next item's
    #: query block loads once both warpgroups have issued their last Q K^T of the current one, and its first tiles as
    #: the current one's stages free, so neither waits behind a block's start or exit
    persistent: bool = False

    def __post_init__(self):
        c = "MLADecodeConfig"
        check_in(c, "dtype", self.dtype, tuple(CTYPES))
        check_in(c, "block_n", self.block_n, BLOCK_NS)
        check_range(c, "num_kv_stages", self.num_kv_stages, 2, 8)
        check_in(c, "kv_dtype", self.kv_dtype, (None, "fp8_e4m3"))
        check_in(c, "schedule", self.schedule, SCHEDULES)
        check_in(c, "prefetch_tiles", self.prefetch_tiles, PREFETCH_TILES)
        check_in(c, "fp8_rows", self.fp8_rows, tuple(FP8_ROWS_REGS))
        check_rule(c, "fp8_rows", self.fp8_rows, self.fp8_rows == 8 or (self.kv_dtype is not None and
                                                                       self.fp8_rows <= self.block_n // 4),
                   "16 rows in flight need an FP8 cache (kv_dtype='fp8_e4m3') and block_n=64 (16 rows per warp)")
        check_in(c, "block_rows", self.block_rows, NARROW_ROWS + (BLOCK_M,))
        check_rule(c, "block_rows", self.block_rows, (self.block_rows != BLOCK_M) == (self.schedule == "narrow"),
                   f"schedule='narrow' takes block_rows in {NARROW_ROWS}; the other schedules {BLOCK_M}")
        check_rule(c, "block_n", self.block_n, self.schedule != "narrow" or self.block_n == 64,
                   "the narrow consumers score a whole 64-token tile as the wgmma M: use block_n=64")
        check_rule(c, "schedule", self.schedule, self.schedule != "alternate" or self.kv_dtype is None,
                   "the alternating consumers need more than the 176-200 registers an FP8 producer leaves them "
                   "(they spill): use schedule='split' with kv_dtype='fp8_e4m3'")
        check_rule(c, "tma", self.tma, not (self.tma and self.kv_dtype), "tensor copies feed 16-bit tiles only: "
                   "an FP8 cache's rows are dequantized by the producer; use tma=False with kv_dtype='fp8_e4m3'")
        check_rule(c, "prefetch_tiles", self.prefetch_tiles, not (self.tma and self.prefetch_tiles),
                   "tensor copies take no L2 prefetch: use prefetch_tiles=0 with tma=True")
        check_rule(c, "kv_dtype", self.kv_dtype, self.kv_dtype is None or self.dtype == "bfloat16",
                   "an FP8 cache's rows dequantize to bf16 tiles beside its bf16 rope: dtype must be 'bfloat16'")
        check_bool(c, "fp8_rope_first", self.fp8_rope_first)
        check_bool(c, "slice_release", self.slice_release)
        check_bool(c, "lazy_rescale", self.lazy_rescale)
        check_bool(c, "multicast", self.multicast)
        check_rule(c, "multicast", self.multicast, not self.multicast or self.slice_release or (
            self.kv_dtype is not None and self.schedule == "split" and self.block_n == 64),
            "the cluster pair shares the per-slice ring's copies (slice_release=True) or an FP8 cache's dequantized "
            "rows (kv_dtype='fp8_e4m3', schedule='split', block_n=64): use one of those, or multicast=False")
        check_bool(c, "persistent", self.persistent)
        check_rule(c, "persistent", self.persistent, not self.persistent or self.slice_release,
                   "persistent blocks carry the per-slice ring across work items: use slice_release=True, or "
                   "persistent=False")
        check_rule(c, "slice_release", self.slice_release, not self.slice_release or (
            self.schedule == "alternate" and (self.tma or self.gathers) and self.kv_dtype is None),
            "per-slice barriers are built for the alternating consumers fed by tensor copies: use "
            "schedule='alternate' and tma=True with a 16-bit cache (kv_dtype=None), or slice_release=False")
        check_rule(c, "num_kv_stages", self.num_kv_stages, self.smem_bytes <= SMEM_LIMIT,
                   f"the ring needs {self.smem_bytes} bytes of shared memory with block_n={self.block_n}; "
                   f"at most {SMEM_LIMIT} (227 KB) fit")

    # --- derived sizes (MLAKVProducerPipeline's comptime members) -----------------------------------
    @property
    def itemsize(self) -> int:
        return 2

    @property
    def k_nope_bytes(self) -> int:
        return self.block_n * NOPE * self.itemsize

    @property
    def k_rope_bytes(self) -> int:
        return self.block_n * ROPE * self.itemsize

    @property
    def k_bytes(self) -> int:
        return self.k_nope_bytes + self.k_rope_bytes

    @property
    def v_bytes(self) -> int:
        """V is the first 512 columns of the K rows already staged: no bytes of its own."""
        return self.k_nope_bytes

    @property
    def q_bytes(self) -> int:
        return self.block_rows * DIM * self.itemsize

    @property
    def p_bytes(self) -> int:
        """Each consumer thread's P words (block_n / 8 per thread), both warpgroups."""
        return 2 * 128 * (self.block_n // 8) * 4

    @property
    def smem_bytes(self) -> int:
        slices = SLICES if self.slice_release else 1
        rings = 3 if self.gathers and self.slice_release and self.multicast else 2  # (a sparse pair: `landed` too)
        barriers = (8 * (2 + rings * self.num_kv_stages * slices) + 63) // 64 * 64  # (q_full, q_empty, the ring's)
        return self.q_bytes + self.num_kv_stages * self.k_bytes + self.p_bytes + 2 * 128 * 8 + barriers

    @property
    def row_bytes(self) -> int:
        """One cache row in global memory."""
        return 656 if self.kv_dtype else DIM * self.itemsize

    @property
    def num_threads(self) -> int:
        return 384

    @property
    def name(self) -> str:
        kv = "_e4m3" if self.kv_dtype else ""
        alt = {"split": "", "alternate": "_alt", "narrow": f"_nr{self.block_rows}"}[self.schedule]
        tma = "_tma" if self.tma else ""
        pf = f"_pf{self.prefetch_tiles}" if self.prefetch_tiles else ""
        rows = f"_r{self.fp8_rows}" if self.fp8_rows != 8 else ""
        sl = ("_slices" if self.slice_release else "") + ("_mc" if self.multicast else "")
        sl += "_ps" if self.persistent else ""
        lr = "_lr" if self.lazy_rescale else ""
        lr += "_rf" if self.kv_dtype and self.fp8_rope_first else ""
        return (f"cukv_mla_decode_{SHORT[self.dtype]}{kv}_n{self.block_n}_s{self.num_kv_stages}{alt}{pf}{rows}{tma}"
                f"{sl}{lr}")

    def render_params(self) -> dict:
        return dict(
            name=self.name, ctype=CTYPES[self.dtype], block_n=self.block_n,
            num_kv_stages=self.num_kv_stages, k_nope_bytes=self.k_nope_bytes, k_rope_bytes=self.k_rope_bytes,
            k_bytes=self.k_bytes, v_bytes=self.v_bytes, q_bytes=self.q_bytes, smem_bytes=self.smem_bytes,
            args_bytes=PARAMS.itemsize, combine_threads=COMBINE_THREADS, fp8=self.kv_dtype is not None,
            row_bytes=self.row_bytes,
            schedule=self.schedule, consumer=SLICE_CONSUMER if self.slice_release else CONSUMERS[self.schedule],
            tma=self.tma, slice_release=self.slice_release, lazy_rescale=self.lazy_rescale,
            prefetch_tiles=self.prefetch_tiles, fp8_rows=self.fp8_rows,
            producer_regs=self.regs[0], consumer_regs=self.regs[1], block_rows=self.block_rows,
            fp8_rope_first=self.fp8_rope_first, multicast=self.multicast, persistent=self.persistent)

    @property
    def regs(self) -> tuple:
        """The setmaxnreg split (producer, consumer registers per thread)."""
        if self.persistent:
            return PERSISTENT_REGS
        return FP8_ROWS_REGS[self.fp8_rows] if self.kv_dtype else (PRODUCER_REGS, CONSUMER_REGS)


def check_row_block_pairs(config: "MLADecodeConfig", row_blocks: int, what: str) -> None:
    """A ``multicast`` config runs a chunk's (sparse: a token's) row blocks in cluster pairs: ``row_blocks`` must be
    even; ``what`` names the arguments that made it (``"num_heads=64 makes"``)."""
    if config.multicast and row_blocks % 2:
        raise ValueError(f"{config.name} runs a chunk's row blocks in cluster pairs (multicast): {what} {row_blocks} "
                         f"row blocks of {BLOCK_M}; it needs an even count")


def tma_box_rows(page_size: int, block_n: int) -> int:
    """Rows per tensor copy of a ``tma`` kernel for this page size: a box never crosses a page or a tile, and boxes
    of fewer than 8 rows are not worth their issue cost (0: every tile by cp.async).

    >>> from cukv.configs.mla_decode import tma_box_rows
    >>> tma_box_rows(64, 64), tma_box_rows(128, 64), tma_box_rows(16, 64), tma_box_rows(48, 64), tma_box_rows(1, 64)
    (64, 64, 16, 0, 0)
    """
    if page_size % block_n == 0:
        return block_n
    return page_size if block_n % page_size == 0 and page_size >= 8 else 0
