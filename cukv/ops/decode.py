"""Paged GQA decode: one query token per sequence, split over the context when the batch is small.

``plan`` runs on the host once per batch shape (split count, partial buffers); ``run`` reads only
fixed-capacity device buffers, so it can be captured in a CUDA graph and replayed after the page table's
lengths change (within the planned capacity).
"""
from __future__ import annotations

import dataclasses
import math
from functools import cached_property

import numpy as np

from . import compiler
from .arrays import as_device, attention_outputs, check_aligned, check_contiguous, element_dtype
from .cache import check_paged_kv
from .config import CTYPES, SHORT, check_in, check_kv_quant, check_range, check_rule
from .device import sm_count
from .operand import DECODE_ARGS, as_kernel_arg, kv_params, ptr

HEAD_DIMS = (64, 96, 128, 256)
RING_STAGES = (2, 3, 4, 5, 6, 8)
DEFAULT_STAGES = (3, 2)  # preferred first
CLUSTERS = (0, 2, 3, 4, 5, 6, 7, 8)  # 8: the portable cluster size
DEFAULT_FP8_STAGES = (2, 3)  # FP8 ring (H100, session 6 at 3 blocks per SM either way: 2 slots 232/432 us, 3 slots 236/439 at 64x4096/16x32768)
SMEM_LIMIT = 227 * 1024
# plan() stages strips in registers below this much K/V: short work is bound by each strip's latency, which
# the register kernel has less of; above it the ring's deeper pipeline wins (H100 sweep, 32q/8kv d128 page 16:
# registers ahead up to 134 MB, even at 268 MB, the ring ahead from there and by 10-25% at 64 x 4096).
RING_MIN_BYTES = 192 << 20


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Template parameters of the decode kernel (one compiled specialization).

    The derived sizes are MAX ``DecodeStreamingKVBuffer``'s comptime members for cukv's register-staged
    strip (mma shape 16x8x16, BN=16 tokens, BK=32 dims), rendered into the source and re-checked there by
    ``static_assert``.
    """

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
    #: ``decode.cuh`` for FP8 caches); 0 stages strips in registers. None picks the ring wherever it applies.
    stages: int | None = None
    #: splits merged inside one thread-block cluster of this many blocks through distributed shared memory
    #: (2..8; the launch then needs num_splits == cluster); 0 merges through global memory (any split count)
    cluster: int = 0

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
        if self.stages is None:  # the first default ring that fits in shared memory, else registers
            for st in (DEFAULT_FP8_STAGES if self.quantized else DEFAULT_STAGES) if ring_ok and self.sub in (None, 1) else ():
                object.__setattr__(self, "stages", st)
                if self.total_smem_bytes <= SMEM_LIMIT:
                    break
            else:
                object.__setattr__(self, "stages", 0)
        check_in(c, "stages", self.stages, (0,) + RING_STAGES)
        if self.sub is None:
            # two FP8 strips in flight match a 16-bit strip's bytes; 32-dim scale blocks need the registers
            fp8_regs = self.quantized and self.stages == 0 and self.head_dim <= 128 and self.scale_block != 32
            object.__setattr__(self, "sub", 2 if fp8_regs else 1)
        check_in(c, "sub", self.sub, (1, 2, 3, 4))
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
    def quantized(self) -> bool:
        return self.kv_dtype is not None

    @property
    def register_cap(self) -> int:
        """Registers per thread ``__launch_bounds__(num_threads, min_blocks)`` leaves ptxas (at most 255)."""
        return min(255, 65536 // (self.num_threads * self.min_blocks) // 8 * 8)

    @property
    def min_registers(self) -> int:
        """The smallest ``register_cap`` under which this kernel compiles without spilling, from a sweep (ptxas for
        sm_90a, NVRTC 13.5, session 32: head dims 64-256, groups 1-16, every cache kind, register kernel and ring,
        at caps 255, 168 and 128). Up to d64 everything fits 128 but the FP8 register kernel (168); the FP8 ring at
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
        """Dynamic shared memory of the ring: per warp, ``stages`` slots."""
        return self.num_warps * self.stages * self.ring_slot_bytes

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

    @property
    def name(self) -> str:
        q = f"_e4m3s{self.scale_block}" if self.quantized else ""
        sub = f"_s{self.sub}" if self.sub != 1 else ""
        ring = f"_r{self.stages}" if self.stages else ""
        cl = f"_c{self.cluster}" if self.cluster else ""
        return (f"cukv_decode_{SHORT[self.dtype]}{q}_d{self.head_dim}_g{self.group}_p{self.page_size}_w{self.num_warps}"
                f"_b{self.min_blocks}{sub}{ring}{cl}")

    def render(self) -> str:
        return compiler.render(
            "decode.cu.j2", name=self.name, ctype=CTYPES[self.dtype], page_size=self.page_size,
            head_dim=self.head_dim, group=self.group, num_warps=self.num_warps, min_blocks=self.min_blocks,
            num_k_strips=self.num_k_strips, num_k_mmas2=self.num_k_mmas2, num_mmas=self.num_mmas,
            input_frag_size=self.input_frag_size, smem_bytes=self.smem_bytes, args_bytes=DECODE_ARGS.itemsize,
            quantized=self.quantized, scale_block=self.scale_block, sub=self.sub, stages=self.stages, cluster=self.cluster,
            ring_smem_bytes=self.ring_smem_bytes, ring_slot_bytes=self.ring_slot_bytes, q_in_smem=self.q_in_smem, warp_slots=self.warp_slots,
            merge_slot_floats=self.merge_slot_floats)

    @cached_property
    def compiled(self) -> compiler.CompiledModule:
        return compiler.compile_source(self.name, self.render())


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


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
    and a merge). A single wave comes out as ``slots // blocks`` splits; past one wave, splits fill the last wave
    (H100, a kernel at 3 blocks per SM: 64 x 4096 is 512 blocks on 396 slots, and 3 splits turn 2 waves, the
    second a third full, into 4 nearly full ones). No split gets under 64 tokens (one 16-token strip per warp
    of a 4-warp block), and the count is trimmed so that no split is left empty (the kernel gives each split
    ``ceil(strips / num_splits)`` strips). H100, session 5: 1 x 512 takes 11.3 us with 8 splits against
    12.5 us with 4; 1 x 8192 24.5 us with 32 against 26.0 with 33."""
    blocks = max(1, batch_size * num_kv_heads)
    strips = max(1, math.ceil(max_kv_len / 16))
    most = int(max(1, min(math.ceil(strips / 4), 128)))

    def cost(s):
        return math.ceil(blocks * s / slots) / s

    least = min(cost(s) for s in range(1, most + 1))
    n = min(s for s in range(1, most + 1) if cost(s) <= least / 0.95)
    return math.ceil(strips / math.ceil(strips / n))


CLUSTER_MAX_TOKENS = 256  # per split: past this a cluster's few blocks stream too long (H100: 8 x 2048)


def choose_cluster(batch_size: int, num_kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """Splits for a cluster merge, or 0 for none: a small step whose (sequence, KV head) pairs times the
    cluster size fit one block per SM, with splits of at most ``CLUSTER_MAX_TOKENS``. H100 (cukv us, cuDNN us):
    1 x 512 with an 8-block cluster 9.5 against 11.2 with global merging (cuDNN 11.2); 1 x 2048: 14.6 against
    16.1 (14.0). With more blocks than SMs clusters lost: 8 x 512 as 4-block clusters 20.2 against 17.5,
    8 x 2048 47.6 against 35.6."""
    strips = max(1, math.ceil(max_kv_len / 16))
    c = min(CLUSTERS[-1], num_sms // max(1, batch_size * num_kv_heads), math.ceil(strips / 4))  # >= 64 tokens
    return c if c >= 2 and math.ceil(max_kv_len / c) <= CLUSTER_MAX_TOKENS else 0


class BatchDecode:
    """Batch decode over a paged KV cache (FlashInfer-style plan/run).

    Parameters
    ----------
    num_qo_heads, num_kv_heads : int
        Query heads and KV heads; ``num_qo_heads / num_kv_heads`` (the group) must be 1..16.
    head_dim : int
        64, 96, 128 or 256.
    page_size : int
        Tokens per page, 1..4096 (each page size is its own specialization).
    dtype : {'bfloat16', 'float16'}
        Query and output type (and the cache's, unless ``kv_dtype`` says otherwise).
    kv_dtype : {None, 'fp8_e4m3'}
        An FP8 cache: codes and scales are dequantized to ``dtype`` in registers right before the mma.
    scale_granularity : {'token', 'tensor', 32, 64, 128}
        The FP8 cache's granularity (default 'token'); it must match the cache passed to :meth:`run`.
    stages : int, optional
        Shared-memory ring slots per warp (2..8): for 16-bit caches with a page size that is a multiple of 16
        and head_dim 64, 128 or 256, and for FP8 caches; 0 stages strips in registers instead. None lets
        :meth:`plan` choose: the ring where it applies and the step reads at least ``RING_MIN_BYTES`` of K/V
        (or clusters its splits), registers otherwise.
    cluster_merge : bool
        Let the splits of one (sequence, KV head) form a thread-block cluster that merges through distributed
        shared memory (default); False always merges through global memory. :meth:`plan` uses a cluster for
        an explicit ``num_splits`` of 2..8, and on its own only for small steps (:func:`choose_cluster`).

    Examples
    --------
    >>> import cupy as cp, numpy as np, cukv                                        # doctest: +SKIP
    >>> cache = cukv.PagedKVCache(num_pages=32, page_size=16, num_kv_heads=2, head_dim=64, dtype="float16")
    >>> seqs = cukv.SequenceTable(cache, max_batch=2, max_pages_per_seq=16)
    >>> slots = cp.asarray(seqs.extend([40, 7]))                  # prompts of 40 and 7 tokens
    >>> kv = cp.random.randn(47, 2, 64).astype(cp.float16)
    >>> cukv.append_kv(cache, kv, kv, slots)
    >>> dec = cukv.BatchDecode(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype="float16")
    >>> dec.plan(batch_size=2, max_kv_len=256)
    >>> q = cp.random.randn(2, 8, 64).astype(cp.float16)
    >>> out, lse = dec.run(q, cache, seqs.page_table(), return_lse=True)   # out [2, 8, 64], lse [2, 8]
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype="bfloat16", num_warps: int = 4, kv_dtype=None, scale_granularity=None, stages=None,
                 cluster_merge: bool = True):
        from .arrays import canonical_dtype
        from .fp8 import resolve_kv

        for n, v in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads)):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{n}={v!r} must be a positive integer")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.num_qo_heads, self.num_kv_heads = int(num_qo_heads), int(num_kv_heads)
        kvd, sb = resolve_kv(canonical_dtype(dtype), kv_dtype, scale_granularity, int(head_dim))
        self.config = DecodeConfig(canonical_dtype(dtype), int(head_dim), self.num_qo_heads // self.num_kv_heads,
                                   int(page_size), int(num_warps), kv_dtype=kvd, scale_block=sb, stages=stages)
        self.head_dim, self.page_size, self.dtype = self.config.head_dim, self.config.page_size, self.config.dtype
        # stages=None: plan() chooses per problem between the default and the register kernel (where that one is
        # valid: it spills with 64-dim FP8 scale blocks past d128 and group 8, so those always take the ring)
        self._configs = (self.config,)
        if stages is None and self.config.stages:
            try:
                self._configs += (dataclasses.replace(self.config, stages=0, sub=None),)
            except ValueError:
                pass
        if not isinstance(cluster_merge, (bool, np.bool_)):
            raise TypeError(f"cluster_merge={cluster_merge!r} must be True or False")
        self._cluster_merge = bool(cluster_merge)
        self._clustered = {}  # (config, splits) -> the same config merging its splits in a cluster
        self._planned = None

    def plan(self, batch_size: int, max_kv_len: int, num_splits: int | None = None) -> "BatchDecode":
        """Fix the split count and allocate the partial buffers for up to ``batch_size`` sequences of up to
        ``max_kv_len`` tokens. Compiles the kernel (or loads it from the disk cache)."""
        import cupy as cp

        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
        if not isinstance(max_kv_len, (int, np.integer)) or max_kv_len < 1:
            raise ValueError(f"max_kv_len={max_kv_len!r} must be a positive integer")
        small = kv_bytes(batch_size, max_kv_len, self.num_kv_heads, self._configs[0].head_dim) < RING_MIN_BYTES
        cfg = self._configs[-1] if small else self._configs[0]
        if num_splits is None:
            c = choose_cluster(batch_size, self.num_kv_heads, max_kv_len, sm_count()) if self._cluster_merge else 0
            if c:
                # a cluster's few long splits stream better through the ring, where it applies (H100,
                # 1 x 2048 in 8-block clusters: 12.8 us against 14.5 with registers)
                num_splits, cfg = c, self._configs[0]
            else:  # more blocks than SMs: the global merge (clusters lose there), splits by occupancy
                rep = cfg.compiled.functions[cfg.name]
                slots = sm_count() * blocks_per_sm(rep.registers, cfg.num_threads, rep.static_smem + cfg.ring_smem_bytes)
                num_splits = choose_splits(batch_size, self.num_kv_heads, max_kv_len, slots)
            clustered = c > 0
        elif not isinstance(num_splits, (int, np.integer)) or not (1 <= num_splits <= 1024):
            raise ValueError(f"num_splits={num_splits!r} must be an integer in 1..1024")
        else:
            clustered = self._cluster_merge and num_splits <= CLUSTERS[-1]
        if clustered and num_splits >= 2:
            key = (cfg, int(num_splits))
            if key not in self._clustered:
                self._clustered[key] = dataclasses.replace(cfg, cluster=int(num_splits))
            cfg = self._clustered[key]
        self.config = cfg
        mod = cfg.compiled
        self.batch_size, self.max_kv_len, self.num_splits = int(batch_size), int(max_kv_len), int(num_splits)
        strips = -(-self.max_kv_len // cfg.BN)
        self._split_strips = -(-strips // self.num_splits)  # strips per split (the kernel's split_range)
        if self.num_splits > 1 and not cfg.cluster:
            self._part_o = cp.empty((self.num_splits, self.batch_size, self.num_qo_heads, cfg.head_dim), cp.float32)
            self._part_lse = cp.empty((self.num_splits, self.batch_size, self.num_qo_heads), cp.float32)
            self._counters = cp.zeros((self.batch_size, self.num_kv_heads), cp.int32)
        else:
            self._part_o = self._part_lse = self._counters = None
        self._fn = mod.function(cfg.name, cfg.ring_smem_bytes)
        self._planned = True
        return self

    def run(self, q, cache, table, out=None, lse=None, *, return_lse: bool = False, sink=None,
            window: int | None = None, softcap: float | None = None, sm_scale: float | None = None, stream=None):
        """Attend ``q[B, num_qo_heads, head_dim]`` to the cache through ``table`` (a :class:`PageTable`).

        Returns ``out`` (and ``lse[B, num_qo_heads]`` float32, natural log, without the sink, when
        ``return_lse``). ``sink[num_qo_heads]`` float32 logits join the softmax denominator; ``window``
        keeps keys in ``(p - window, p]`` for the query at position ``p = length - 1``; ``softcap`` applies
        ``cap * tanh(s / cap)`` to the scaled scores. Pass ``out``/``lse`` to run inside CUDA graph capture.
        """
        import cupy as cp

        if not self._planned:
            raise RuntimeError("call plan(batch_size, max_kv_len) before run()")
        cfg = self.config
        qd, qdt = as_device(q, "q")
        dt = element_dtype(qd, qdt or (cfg.dtype if qd.dtype == cp.uint16 else None), "q")
        if dt != cfg.dtype:
            raise TypeError(f"q is {dt}; this BatchDecode was built for {cfg.dtype}")
        if qd.ndim != 3 or qd.shape[1:] != (self.num_qo_heads, cfg.head_dim):
            raise ValueError(f"q has shape {tuple(qd.shape)}; expected [batch, {self.num_qo_heads}, {cfg.head_dim}]")
        check_contiguous(qd, "q")
        check_aligned(qd, "q", 16)  # 16-byte loads of query rows
        b = qd.shape[0]
        if not (1 <= b <= self.batch_size):
            raise ValueError(f"q has batch {b}; plan() allowed 1..{self.batch_size}")
        check_paged_kv("BatchDecode", cfg, self.num_kv_heads, cache, table)
        if table.batch_size < b:
            raise ValueError(f"table covers {table.batch_size} sequences; q has {b}")
        out, lse, sink = attention_outputs(qd, out, lse, b, self.num_qo_heads, return_lse, sink, softcap)
        if window is not None and (not isinstance(window, (int, np.integer)) or window < 1):
            raise ValueError(f"window={window!r} must be a positive integer (or None for no window)")
        scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(cfg.head_dim)

        rec = np.zeros((), DECODE_ARGS)
        rec["kv"] = kv_params(cache, table)
        rec["kv"]["batch_size"] = b
        rec["q"], rec["out"], rec["lse"] = ptr(qd), ptr(out), ptr(lse)
        rec["part_o"], rec["part_lse"], rec["sink"] = ptr(self._part_o), ptr(self._part_lse), ptr(sink)
        rec["counters"] = ptr(self._counters)
        rec["sm_scale"], rec["softcap"] = scale, float(softcap or 0.0)
        rec["window"], rec["num_splits"], rec["num_qo_heads"] = int(window or 0), self.num_splits, self.num_qo_heads
        rec["split_strips"] = self._split_strips
        arg = as_kernel_arg(rec)
        with (stream or cp.cuda.get_current_stream()):
            self._fn((self.num_splits, self.num_kv_heads, b), (cfg.num_threads,), (arg,), shared_mem=cfg.ring_smem_bytes)
        return (out, lse) if return_lse else out


def decode(q, cache, table, **kwargs):
    """One-shot convenience: plan for this batch and run (use :class:`BatchDecode` in a loop)."""
    qd, _ = as_device(q, "q")
    if qd.ndim != 3:
        raise ValueError(f"q has shape {tuple(qd.shape)}; expected [batch, num_qo_heads, head_dim]")
    lens = table.lengths.get()
    qdt = element_dtype(qd, _ or ("bfloat16" if qd.dtype.kind == "u" else None), "q")
    quant = getattr(cache, "quantized", False)
    dec = BatchDecode(qd.shape[1], cache.num_kv_heads, cache.head_dim, cache.page_size, qdt if quant else cache.dtype,
                      kv_dtype=cache.dtype if quant else None,
                      scale_granularity=cache.scale_granularity if quant else None)
    dec.plan(qd.shape[0], max(1, int(lens.max(initial=1))))
    return dec.run(q, cache, table, **kwargs)
