"""Paged GQA decode: one query token per sequence, split over the context when the batch is small.

``plan`` runs on the host once per batch shape (split count, partial buffers); ``run`` reads only
fixed-capacity device buffers, so it can be captured in a CUDA graph and replayed after the page table's
lengths change (within the planned capacity).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..arrays import as_device, check_aligned, check_contiguous, element_dtype
from ..configs.decode import CLUSTERS, DecodeConfig  # noqa: F401 - DecodeConfig: the kernel this op launches
from ..device import check_same_device, current_device, device_name, sm_count
from ..kvcache import check_cache_and_table, check_paged_kv
from ..operand import DECODE_ARGS, as_kernel_arg, kv_params, ptr
from ..policy.decode import (at_gpu_occupancy, blocks_per_sm, choose_cluster, choose_splits, decode_config, kv_bytes,
                             ring_min_bytes)
from ..validate import attention_outputs, check_bool, check_float, check_int, check_page_table, check_planned, checked

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
        :meth:`plan` choose: the ring where it applies and the step reads at least
        :func:`cukv.policy.decode.ring_min_bytes` of K/V on this GPU (or clusters its splits), registers otherwise.
    tma : bool, optional
        The ring's whole strips by TMA tensor copies instead of ``cp.async`` (``DecodeConfig.tma``): the ring
        (``stages`` 2..8 or None), page_size a multiple of 16, and head_dim 64, 128 or 256 (16-bit caches) or 128 or
        256 (FP8 caches, whose scales still go by ``cp.async``). None takes :data:`cukv.policy.decode.DEFAULT_TMA`
        (16-bit: on) or :data:`cukv.policy.decode.DEFAULT_FP8_TMA` (FP8: off; token or tensor scales only) where it applies; the
        cache then needs a 16-byte aligned base and token/page strides that are multiples of 16 bytes (else pass
        ``tma=False``). :meth:`plan` still stages small steps in registers (no tensor copies) when ``stages`` is None.
    cluster_merge : bool
        Let the splits of one (sequence, KV head) form a thread-block cluster that merges through distributed
        shared memory (default); False always merges through global memory. :meth:`plan` uses a cluster for
        an explicit ``num_splits`` of 2..8, and on its own only for small steps (:func:`choose_cluster`).

    Examples
    --------
    >>> import cupy as cp, numpy as np, cukv
    >>> from cukv import reference
    >>> from cukv.testing import assert_close, cache_pages_host
    >>> rng = np.random.default_rng(0)
    >>> cache = cukv.PagedKVCache(num_pages=32, page_size=16, num_kv_heads=2, head_dim=64, dtype="float16")
    >>> seqs = cukv.SequenceTable(cache, max_batch=2, max_pages_per_seq=16)
    >>> slots = cp.asarray(seqs.extend([40, 7]))                  # contexts of 40 and 7 tokens
    >>> k, v = (cp.asarray(rng.standard_normal((47, 2, 64)), cp.float16) for _ in range(2))
    >>> cukv.append_kv(cache, k, v, slots)
    >>> dec = cukv.BatchDecode(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype="float16")
    >>> dec = dec.plan(batch_size=2, max_kv_len=256)              # once per batch shape; run() many times
    >>> q = rng.standard_normal((2, 8, 64)).astype(np.float16)
    >>> out, lse = dec.run(cp.asarray(q), cache, seqs.page_table(), return_lse=True)
    >>> out.shape, lse.shape
    ((2, 8, 64), (2, 8))
    >>> k_pages, v_pages = cache_pages_host(cache)                # float64 on the host
    >>> want, want_lse = reference.decode(q, k_pages, v_pages, seqs.block_table(), seqs.lengths)
    >>> assert_close(out.get(), want, "float16") < 0.01
    True
    >>> assert_close(lse.get(), want_lse, "float32", atol=1e-3, rtol=1e-3) < 0.01
    True
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype="bfloat16", num_warps: int = 4, kv_dtype=None, scale_granularity=None, stages=None,
                 cluster_merge: bool = True, tma: bool | None = None):
        from ..arrays import canonical_dtype
        from ..fp8 import resolve_kv

        num_qo_heads, num_kv_heads = check_int("num_qo_heads", num_qo_heads, 1), check_int("num_kv_heads", num_kv_heads, 1)
        head_dim, page_size = check_int("head_dim", head_dim, 1), check_int("page_size", page_size, 1, 4096)
        num_warps, stages = check_int("num_warps", num_warps, 1), check_int("stages", stages, 0, none_ok=True)
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.num_qo_heads, self.num_kv_heads = int(num_qo_heads), int(num_kv_heads)
        if tma is not None:
            tma = check_bool("tma", tma)
        kvd, sb = resolve_kv(canonical_dtype(dtype), kv_dtype, scale_granularity, int(head_dim))
        self.config = decode_config(canonical_dtype(dtype), int(head_dim), self.num_qo_heads // self.num_kv_heads,
                                    int(page_size), int(num_warps), kv_dtype=kvd, scale_block=sb, stages=stages,
                                    tma=tma)
        self.head_dim, self.page_size, self.dtype = self.config.head_dim, self.config.page_size, self.config.dtype
        # stages=None: plan() chooses per problem between the default and the register kernel (where that one is
        # valid: it spills with 64-dim FP8 scale blocks past d128 and group 8, so those always take the ring)
        self._configs = (self.config,)
        if stages is None and self.config.stages:
            try:
                self._configs += (decode_config(**{**dataclasses.asdict(self.config), "stages": 0, "sub": None,
                                                   "tma": False}),)
            except ValueError:
                pass
        # the ring at this GPU's occupancy (the FP8 ring's min blocks per GPU model: cukv.policy.decode)
        self.config = at_gpu_occupancy(self.config, device_name())
        self._configs = (self.config,) + self._configs[1:]
        self._cluster_merge = check_bool("cluster_merge", cluster_merge)
        self._clustered = {}  # (config, splits) -> the same config merging its splits in a cluster
        self._planned = None

    def plan(self, batch_size: int, max_kv_len: int, num_splits: int | None = None) -> "BatchDecode":
        """Fix the split count and allocate the partial buffers for up to ``batch_size`` sequences of up to
        ``max_kv_len`` tokens. Compiles the kernel (or loads it from the disk cache)."""
        import cupy as cp

        batch_size, max_kv_len = check_int("batch_size", batch_size, 1), check_int("max_kv_len", max_kv_len, 1)
        num_splits = check_int("num_splits", num_splits, 1, 1024, none_ok=True)
        small = (kv_bytes(batch_size, max_kv_len, self.num_kv_heads, self._configs[0].head_dim)
                 < ring_min_bytes(device_name()))
        cfg = self._configs[-1] if small else self._configs[0]
        if num_splits is None:
            c = choose_cluster(batch_size, self.num_kv_heads, max_kv_len, sm_count()) if self._cluster_merge else 0
            if c:
                # a cluster's few long splits stream better through the ring, where it applies (docs/tuning.md)
                num_splits, cfg = c, self._configs[0]
            else:  # more blocks than SMs: the global merge (clusters lose there), splits by occupancy
                rep = cfg.compiled.functions[cfg.name]
                slots = sm_count() * blocks_per_sm(rep.registers, cfg.num_threads, rep.static_smem + cfg.ring_smem_bytes)
                num_splits = choose_splits(batch_size, self.num_kv_heads, max_kv_len, slots)
            clustered = c > 0
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
        self._device = current_device()  # the plan's buffers (and descriptors) live there
        return self

    def run(self, q, cache, table, out=None, lse=None, *, return_lse: bool = False, sink=None,
            window: int | None = None, softcap: float | None = None, sm_scale: float | None = None, stream=None,
            check: bool | None = None):
        """Attend ``q[B, num_qo_heads, head_dim]`` to the cache through ``table`` (a :class:`PageTable`).

        Returns ``out`` (and ``lse[B, num_qo_heads]`` float32, natural log, without the sink, when
        ``return_lse``). ``sink[num_qo_heads]`` float32 logits join the softmax denominator; ``window``
        keeps keys in ``(p - window, p]`` for the query at position ``p = length - 1``; ``softcap`` applies
        ``cap * tanh(s / cap)`` to the scaled scores. Pass ``out``/``lse`` to run inside CUDA graph capture.

        ``check=True`` (or ``CUKV_CHECK=1``) copies the table to the host and validates it before the launch (page
        ids, lengths within each row's pages); off by default, as it syncs and cannot be graph-captured. See
        docs/errors.md for what the unchecked kernel does with bad table data.
        """
        import cupy as cp

        window = check_int("window", window, 1, none_ok=True, note="no window")
        check_float("sm_scale", sm_scale, positive=True, none_ok=True, note="1/sqrt(head_dim)")
        check_float("softcap", softcap, positive=True, none_ok=True, note="no soft-cap")
        return_lse, check = check_bool("return_lse", return_lse), checked(check)
        check_planned(self, "plan(batch_size, max_kv_len)")
        check_same_device("BatchDecode", self._device)
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
        if check:
            check_page_table(table, cache.num_pages, b)
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
        args = (as_kernel_arg(rec),) + ((_tma_maps(cache),) if cfg.tma else ())
        with (stream or cp.cuda.get_current_stream()):
            self._fn((self.num_splits, self.num_kv_heads, b), (cfg.num_threads,), args, shared_mem=cfg.ring_smem_bytes)
        return (out, lse) if return_lse else out


def _page_bytes(a) -> tuple:
    """A cache's K (or V) ``[pages][page_size][heads][head_dim]`` as the byte tensor ``[..][head_dim * itemsize]``
    (16-bit values, or FP8 codes as they are) :func:`cukv.tma.encode_bytes` reads: ``(shape, strides)`` in bytes;
    any strides but a unit dim stride."""
    if a.strides[3] != a.itemsize:
        raise ValueError(f"cache rows must have a unit dim stride for tensor copies; strides (bytes) {a.strides}")
    shape = tuple(int(n) for n in a.shape[:3]) + (int(a.shape[3]) * a.itemsize,)
    return shape, tuple(int(s) for s in a.strides[:3]) + (1,)


def _tma_maps(cache):
    """The ``DecodeMaps`` kernel argument of a ``tma`` config (templates/decode_common.cuh): the K and V tensor maps
    over the cache's bytes ``[pages][page_size][heads][row bytes]``, boxes of one 128-byte atom (64 16-bit dims or 128
    FP8 codes) x 16 tokens of one head and page, with the ring's 128-byte swizzle (encodings are memoized by
    cukv/tma.py). The FP8 scales are not mapped: they go by cp.async."""
    from .. import tma

    return tma.as_maps_arg(*(tma.encode_bytes(f"cache.{n}", int(a.data.ptr), *_page_bytes(a), 128, 16, tma.SWIZZLE_128B)
                             for n, a in (("k", cache.k), ("v", cache.v))))


def decode(q, cache, table, **kwargs):
    """One-shot convenience: plan for this batch and run (use :class:`BatchDecode` in a loop). The kernel is the
    cache's dtype (or, for an FP8 cache, the query's); keyword arguments go to :meth:`BatchDecode.run`.

    Examples
    --------
    >>> import cupy as cp, numpy as np, cukv
    >>> from cukv import reference
    >>> from cukv.testing import assert_close, cache_pages_host
    >>> rng = np.random.default_rng(0)
    >>> cache = cukv.PagedKVCache(num_pages=4, page_size=16, num_kv_heads=1, head_dim=128, dtype="float16")
    >>> seqs = cukv.SequenceTable(cache, max_batch=1, max_pages_per_seq=4)
    >>> k, v = (cp.asarray(rng.standard_normal((30, 1, 128)), cp.float16) for _ in range(2))
    >>> cukv.append_kv(cache, k, v, cp.asarray(seqs.extend([30])))
    >>> q = rng.standard_normal((1, 4, 128)).astype(np.float16)      # MQA: 4 query heads read 1 KV head
    >>> out = cukv.decode(cp.asarray(q), cache, seqs.page_table(), window=16)
    >>> k_pages, v_pages = cache_pages_host(cache)
    >>> want, _ = reference.decode(q, k_pages, v_pages, seqs.block_table(), seqs.lengths, window=16)
    >>> assert_close(out.get(), want, "float16") < 0.01
    True
    """
    qd, _ = as_device(q, "q")
    if qd.ndim != 3:
        raise ValueError(f"q has shape {tuple(qd.shape)}; expected [batch, num_qo_heads, head_dim]")
    check_cache_and_table("decode", cache, table)
    lens = table.lengths.get()
    qdt = element_dtype(qd, _ or ("bfloat16" if qd.dtype.kind == "u" else None), "q")
    quant = getattr(cache, "quantized", False)
    dec = BatchDecode(qd.shape[1], cache.num_kv_heads, cache.head_dim, cache.page_size, qdt if quant else cache.dtype,
                      kv_dtype=cache.dtype if quant else None,
                      scale_granularity=cache.scale_granularity if quant else None)
    dec.plan(qd.shape[0], max(1, int(lens.max(initial=1))))
    return dec.run(q, cache, table, **kwargs)
