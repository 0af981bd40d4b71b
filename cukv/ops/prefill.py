"""Ragged prefill over a paged (or contiguous) KV cache: Hopper wgmma kernel, FlashInfer-style plan/run.

``plan`` takes the host-side query offsets and KV lengths once per batch, fixes the mask and builds the
work list (one item per 64..192 query rows, heaviest first); ``run`` reads only device buffers, so it can
be captured in a CUDA graph.
"""
from __future__ import annotations

import math

import numpy as np

from ..arrays import as_device, check_aligned, check_contiguous, element_dtype
from ..configs.prefill import PrefillConfig
from ..device import check_same_device, current_device, sm_count
from ..kvcache import check_cache_and_table
from ..operand import KV_PARAMS, ONCE_ARGS, PREFILL_ARGS, as_kernel_arg, kv_params, ptr
from ..policy.prefill import FP8_PREFILL, default_config, fp8_strategy, once_config, once_unsupported
from .. import tuned
from ..validate import (attention_outputs, check_bool, check_choice, check_float, check_int, check_offsets, check_page_table, check_planned,
                        checked, host_ints)

MASKS = ("none", "causal")


def causal_flops(batch: int, seq_len: int, num_qo_heads: int, head_dim: int) -> float:
    """Floating-point operations of a causal prefill of ``batch`` sequences of ``seq_len`` new tokens: the causal half
    of Q K^T and P V, ``4 * B * Hq * D * L * L / 2``."""
    return 4.0 * batch * num_qo_heads * head_dim * seq_len * seq_len / 2


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
        Tile shape; by default this GPU's stored autotune winner (:mod:`cukv.tuned`, 16-bit caches) or the
        documented default (:func:`cukv.policy.prefill.default_config`).
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
        takes one by query rows per key (query heads of a KV head included) and scale granularity, from the
        thresholds of :mod:`cukv.policy.prefill` (``ONCE_MIN_ROWS``, ``DEQUANT_MIN_ROWS_PER_KEY``), where the
        workspace fits ``DEQUANT_WORKSPACE_LIMIT`` bytes (:func:`cukv.policy.prefill.fp8_strategy`). ``strategy``
        says which one ``plan`` chose, ``kernel_config`` the kernel it runs. All read the plan's
        ``kv_lengths`` keys per sequence; the table's lengths must agree.
    once_persistent : bool, optional
        Convert-once's grid: True persistent, False one block per work item; None (default) persistent up to
        ``ONCE_PERSISTENT_MAX_HEAD_DIM``.
    max_blocks : int, optional
        Caps the blocks of a persistent grid (default: one per SM); tests use a small grid to walk many items per
        block.

    Examples
    --------
    >>> import cupy as cp, numpy as np, cukv
    >>> from cukv import reference
    >>> from cukv.dtypes import from_storage, to_storage
    >>> from cukv.testing import assert_close, cache_pages_host
    >>> rng = np.random.default_rng(0)
    >>> cache = cukv.PagedKVCache(num_pages=16, page_size=16, num_kv_heads=2, head_dim=128)    # bf16
    >>> seqs = cukv.SequenceTable(cache, max_batch=2, max_pages_per_seq=8)
    >>> q_lens = [40, 7]                                            # two prompts, no cached prefix
    >>> slots = cp.asarray(seqs.extend(q_lens))
    >>> k, v = (cp.asarray(to_storage(rng.standard_normal((47, 2, 128)), "bfloat16")) for _ in range(2))
    >>> cukv.append_kv(cache, k, v, slots)                          # append first, then attend
    >>> q_offsets = np.array([0, 40, 47])
    >>> pf = cukv.BatchPrefill(8, 2, 128, page_size=16).plan(q_offsets, q_lens, mask="causal")
    >>> q = to_storage(rng.standard_normal((47, 8, 128)), "bfloat16")   # bf16 bits (uint16)
    >>> out, lse = pf.run(cp.asarray(q), (cache, seqs.page_table()), return_lse=True)
    >>> out.shape, lse.shape
    ((47, 8, 128), (47, 8))
    >>> k_pages, v_pages = cache_pages_host(cache)
    >>> want, want_lse = reference.prefill_paged(from_storage(q, "bfloat16"), q_offsets, k_pages, v_pages,
    ...                                          seqs.block_table(), q_lens, mask="causal")
    >>> assert_close(from_storage(out.get(), "bfloat16"), want, "bfloat16") < 0.02
    True
    >>> assert_close(lse.get(), want_lse, "float32", atol=2e-3, rtol=2e-3) < 0.01
    True
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int | None = 16,
                 dtype="bfloat16", config: PrefillConfig | None = None, kv_dtype=None, scale_granularity=None,
                 fp8_prefill: str = "auto", once_persistent: bool | None = None, max_blocks: int | None = None):
        from ..arrays import canonical_dtype
        from ..fp8 import resolve_kv

        num_qo_heads, num_kv_heads = check_int("num_qo_heads", num_qo_heads, 1), check_int("num_kv_heads", num_kv_heads, 1)
        head_dim = check_int("head_dim", head_dim, 1)
        page_size = check_int("page_size", page_size, 1, 4096, none_ok=True, note="contiguous K/V")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if num_qo_heads > 65535:  # the grid's y dimension (work items run along x)
            raise ValueError(f"num_qo_heads={num_qo_heads} exceeds 65535, the most one prefill launch takes")
        dt = canonical_dtype(dtype)
        ps = 0 if page_size is None else int(page_size)
        kvd, sb = resolve_kv(dt, kv_dtype, scale_granularity, int(head_dim))
        if kvd is not None and ps == 0:
            raise ValueError("kv_dtype='fp8_e4m3' needs a paged cache: page_size=None (contiguous K/V) is 16-bit only")
        if config is None:  # this GPU's stored autotune winner (16-bit caches), else the policy's default
            config = (tuned.lookup(dt, int(head_dim), ps) if kvd is None else None) or default_config(dt, int(head_dim),
                                                                                                    ps, kvd, sb)
        elif not isinstance(config, PrefillConfig):
            raise TypeError(f"config must be a PrefillConfig, got {type(config).__name__}")
        if (config.dtype, config.head_dim, config.page_size, config.kv_dtype, config.scale_block) != (dt, head_dim, ps, kvd, sb):
            raise ValueError(f"config {config.name} does not match dtype={dt}, head_dim={head_dim}, page_size={ps}, "
                             f"kv_dtype={kvd}, scale block {sb}")
        check_choice("fp8_prefill", fp8_prefill, FP8_PREFILL)
        if fp8_prefill != "auto" and kvd is None:
            raise ValueError(f"fp8_prefill={fp8_prefill!r} applies to FP8 caches (kv_dtype='fp8_e4m3'); leave it 'auto'")
        if once_persistent is not None and not isinstance(once_persistent, (bool, np.bool_)):
            raise TypeError(f"once_persistent={once_persistent!r} must be True, False or None")
        if max_blocks is not None and (not isinstance(max_blocks, (int, np.integer)) or isinstance(max_blocks, bool)
                                       or max_blocks < 1):
            raise ValueError(f"max_blocks={max_blocks!r} must be a positive integer (or None: one block per SM)")
        self._once_persistent = None if once_persistent is None else bool(once_persistent)
        self._max_blocks = None if max_blocks is None else int(max_blocks)
        if fp8_prefill == "convert_once" and (why := once_unsupported(dt, int(head_dim), ps, kvd, sb,
                                                                      self._once_persistent)):
            raise ValueError(f"fp8_prefill='convert_once' cannot run head_dim={head_dim} with scale_granularity "
                             f"{scale_granularity or 'token'!r} ({why}); use 'auto', 'fused' or 'dequantize_first'")
        self.num_qo_heads, self.num_kv_heads = int(num_qo_heads), int(num_kv_heads)
        self.head_dim, self.page_size, self.dtype, self.config = int(head_dim), page_size, dt, config
        self.fp8_prefill = fp8_prefill
        self.strategy = "fused" if kvd is not None else None
        self._plan = None
        self._planned = False

    def plan(self, q_offsets, kv_lengths, *, mask: str = "causal", window: int | None = None,
             chunk: int | None = None) -> "BatchPrefill":
        """Fix the batch: ``q_offsets[B + 1]`` and ``kv_lengths[B]`` (host int arrays; ``kv_lengths`` counts
        every key a sequence sees, cached prefix plus the new tokens already appended). ``mask`` is
        ``'causal'`` (bottom-right aligned) or ``'none'``; ``window`` keeps keys in ``(p - window, p]``;
        ``chunk`` keeps keys in the query's chunk of ``chunk`` positions. Compiles (or loads) the kernel."""
        import cupy as cp

        qo = host_ints("q_offsets", q_offsets)
        kl = host_ints("kv_lengths", kv_lengths)
        if qo.ndim != 1 or qo.size < 2:
            raise ValueError(f"q_offsets has shape {qo.shape}; expected [batch + 1] with batch >= 1")
        if qo[0] != 0 or np.any(np.diff(qo) < 0):
            raise ValueError(f"q_offsets={qo.tolist()[:8]}... must start at 0 and never decrease")
        b = qo.size - 1
        if kl.shape != (b,) or np.any(kl < 0):
            raise ValueError(f"kv_lengths has shape {kl.shape} / min {kl.min(initial=0)}; expected [{b}] non-negative")
        check_choice("mask", mask, MASKS)
        window, chunk = check_int("window", window, 1, none_ok=True), check_int("chunk", chunk, 1, none_ok=True)
        cfg = self.config
        work = _work_list(np.diff(qo), kl, cfg, mask, window, chunk)
        self.batch_size, self.total_q = b, int(qo[-1])
        self._work, self._num_work = _work_array(work)
        self._q_offsets = cp.asarray(qo.astype(np.int32))
        self._mask, self._window, self._chunk = mask, int(window or 0), int(chunk or 0)
        self._kv_lengths = kl  # what checked runs hold the table's lengths to
        if cfg.quantized:
            self.strategy = self._choose_strategy(work, kl, np.diff(qo))
        self._plan = PLANS[self.strategy or "fused"](self, qo, kl, mask, window, chunk)
        self._planned = True
        self._device = current_device()  # the plan's buffers (and descriptors) live there
        return self

    @property
    def kernel_config(self) -> PrefillConfig:
        """The config of the attention kernel ``run`` launches, once planned: ``config`` for the fused kernel (and
        16-bit caches), the convert-once kernel's (``once_config``: its own tile at d256), or the 16-bit kernel that
        'dequantize_first' runs over its workspace."""
        return self._plan.config if self._plan is not None else self.config

    def _choose_strategy(self, work, kv_lengths, q_lengths) -> str:
        """'fused', 'dequantize_first' or 'convert_once' for an FP8 cache (see the class docstring): query rows per
        key from the work list's tile costs and each tile's real rows (a decode step's one row is one, not BM), the
        workspace from the planned key count."""
        cfg = self.config
        keys = int(kv_lengths.sum())
        pairs = sum(c * min(cfg.BM, int(q_lengths[b]) - t * cfg.BM) for c, b, t in work) * cfg.BN
        rows_per_key = pairs * (self.num_qo_heads // self.num_kv_heads) / keys if keys else 0.0
        workspace = 2 * keys * self.num_kv_heads * self.head_dim * 2
        return fp8_strategy(self.fp8_prefill, cfg, keys, rows_per_key, workspace, self._once_persistent)

    def run(self, q, kv, out=None, lse=None, *, return_lse: bool = False, sink=None, softcap: float | None = None,
            sm_scale: float | None = None, stream=None, check: bool | None = None):
        """Attend ``q[total_q, num_qo_heads, head_dim]`` to ``kv``.

        ``kv`` is ``(cache, table)`` for a paged cache (``table.lengths`` = keys per sequence, prefix plus new
        tokens) or ``(k, v, kv_offsets)`` for contiguous ``k[total_kv, num_kv_heads, head_dim]`` with int32
        device ``kv_offsets[B + 1]``. Returns ``out`` (and ``lse[total_q, num_qo_heads]`` float32, natural
        log, without the sink, when ``return_lse``).

        On the persistent grids (16-bit defaults, convert-once) the plan owns the work counter (and convert-once's
        workspace), so runs of one planned ``BatchPrefill`` must not overlap on different streams; use one plan per
        stream.

        ``check=True`` (or ``CUKV_CHECK=1``) copies the table (or ``kv_offsets``) to the host and validates it
        before the launch: page ids, lengths within each row's pages and equal to the plan's ``kv_lengths``; off by
        default, as it syncs and cannot be graph-captured. See docs/errors.md for what unchecked kernels do.
        """
        import cupy as cp

        check_float("sm_scale", sm_scale, positive=True, none_ok=True, note="1/sqrt(head_dim)")
        check_float("softcap", softcap, positive=True, none_ok=True, note="no soft-cap")
        return_lse, check = check_bool("return_lse", return_lse), checked(check)
        check_planned(self, "plan(q_offsets, kv_lengths)")
        check_same_device("BatchPrefill", self._device)
        cfg = self.config
        if isinstance(self._plan, DequantFirstPlan):
            return self._plan.run(self, q, kv, out, lse, return_lse=return_lse, sink=sink, softcap=softcap,
                                  sm_scale=sm_scale, stream=stream, check=check)
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
        rec["kv"], kv_arrays = self._kv_params(kv, check)
        out, lse, sink = attention_outputs(qd, out, lse, self.total_q, self.num_qo_heads, return_lse, sink, softcap)
        check_aligned(out, "out", 4)  # stores of value pairs
        rec["q"], rec["out"], rec["lse"], rec["sink"] = ptr(qd), ptr(out), ptr(lse), ptr(sink)
        rec["q_offsets"], rec["work"] = ptr(self._q_offsets), ptr(self._work)
        rec["q_stride"] = (qd.strides[0] // 2, qd.strides[1] // 2)
        rec["o_stride"] = (out.strides[0] // 2, out.strides[1] // 2)
        rec["sm_scale"] = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(self.head_dim)
        rec["softcap"] = float(softcap or 0.0)
        rec["window"], rec["chunk"], rec["causal"] = self._window, self._chunk, int(self._mask == "causal")
        rec["num_qo_heads"], rec["group"] = self.num_qo_heads, self.num_qo_heads // self.num_kv_heads
        self._plan.launch(self, rec, qd, kv_arrays, stream)
        return (out, lse) if return_lse else out

    def _tma_maps(self, k, v):
        """The K and V tensor maps of a ``tma`` config (cukv/tma.py) over the arrays the kernel reads: boxes of
        ``tma_rows`` tokens of one head, of bytes (16-bit values as byte pairs); contiguous K/V as one page."""
        import cupy as cp

        from .. import tma

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

    def _kv_params(self, kv, check: bool = False):
        """The kernel's KV_PARAMS record for ``kv``, validated (``check``: its device tables too, on the host), and
        the (k, v) device arrays it reads."""
        import cupy as cp

        from ..kvcache import check_paged_kv

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
            if check:
                check_page_table(table, cache.num_pages, self.batch_size, self._kv_lengths)
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
        if check:
            check_offsets(od, kd.shape[0])
        rec = np.zeros((), KV_PARAMS)
        rec["k"], rec["v"], rec["block_table"] = ptr(kd), ptr(vd), ptr(od)
        rec["k_stride"] = (0, kd.strides[0] // 2, kd.strides[1] // 2, 1)
        rec["v_stride"] = (0, vd.strides[0] // 2, vd.strides[1] // 2, 1)
        rec["num_pages"] = kd.shape[0]
        rec["batch_size"] = self.batch_size
        self._keep = od  # kernels read it during run
        return rec, (kd, vd)



# ----------------------------------------------------------------------------------------------
# the plans: what ``BatchPrefill.plan`` fixes per strategy, and how ``run`` launches it


class FusedPlan:
    """The attention kernel over the cache itself (16-bit caches, and the fused FP8 kernel): its function and, on the
    persistent grid, the work counter (the item counter and finished-block count of ``OnceArgs.flags``, zero between
    launches: the kernel's last block resets them)."""

    strategy = "fused"

    def __init__(self, op: BatchPrefill, qo, kl, mask, window, chunk):
        import cupy as cp

        self.config = cfg = op.config
        self.work, self.num_work = op._work, op._num_work
        self.fn = cfg.compiled.function(cfg.name, cfg.smem_bytes)
        self.counters = cp.zeros(32, cp.int32) if cfg.persistent else None

    def kernel_args(self, op: BatchPrefill, rec, q, kv_arrays) -> tuple:
        """The launch's arguments: the checked record, the K/V tensor maps (``tma``) and, on the persistent grid, the
        OnceArgs record with only its work count and counters set and ``q``'s tensor map (boxes of BM rows of one
        head), as convert-once's persistent grid takes them."""
        cfg = self.config
        args = (as_kernel_arg(rec),) + ((op._tma_maps(*kv_arrays),) if cfg.tma else ())
        if cfg.persistent:
            once = np.zeros((), ONCE_ARGS)
            once["flags"], once["num_work"] = ptr(self.counters) + 128, self.num_work
            args += (as_kernel_arg(once), _query_map(q, cfg.BM))
        return args

    def before_launch(self, stream) -> None:
        pass

    def launch(self, op: BatchPrefill, rec, q, kv_arrays, stream) -> None:
        """Launch over ``rec`` (checked by ``run``): work items along x (templates/prefill.cuh run()), or on the
        persistent grid one block per SM (at most ``max_blocks``) walking the items."""
        import cupy as cp

        cfg, args = self.config, self.kernel_args(op, rec, q, kv_arrays)
        if not self.num_work:
            return
        with (stream or cp.cuda.get_current_stream()) as st:
            self.before_launch(st)
            grid = (self.num_work, op.num_qo_heads, cfg.num_v_slices)
            if cfg.persistent:
                grid = (min(op._max_blocks or sm_count(), self.num_work * op.num_qo_heads), 1, 1)
            self.fn(grid, (cfg.num_threads,), args, shared_mem=cfg.smem_bytes)


class ConvertOncePlan(FusedPlan):
    """'convert_once': the convert-once kernel (``PrefillConfig.convert_once``), its work list, workspace and flags:
    each sequence's rows start at a multiple of BN, so a tile's rows past the sequence (stored as zeros) stay its
    own."""

    strategy = "convert_once"

    def __init__(self, op: BatchPrefill, qo, kl, mask, window, chunk):
        import cupy as cp

        from .. import tma
        from ..dtypes import storage_dtype

        oc = op.config
        cfg = oc if oc.convert_once else once_config(op.dtype, op.head_dim, oc.page_size, oc.kv_dtype, oc.scale_block,
                                                     op._once_persistent)
        self.config = cfg
        self.work, self.num_work = _work_array(_work_list(np.diff(qo), kl, cfg, mask, window, chunk))
        padded = -(-kl // cfg.BN) * cfg.BN
        offs = np.zeros(kl.size + 1, np.int64)
        np.cumsum(padded, out=offs[1:])
        if offs[-1] >= 2**31:
            raise ValueError(f"kv_lengths sum to {offs[-1]} workspace rows; at most 2**31 - 1")
        rows = max(int(offs[-1]), cfg.BN)
        st = storage_dtype(op.dtype)
        shape = (rows, op.num_kv_heads, op.head_dim)
        self.k, self.v, self.offsets = cp.empty(shape, st), cp.empty(shape, st), cp.asarray(offs.astype(np.int32))
        # the kernel's view of the workspace (rows from offsets, one page of every row) and its tensor maps, fixed
        # for the plan: run() only fills in the cache it converts from
        ws = np.zeros((), KV_PARAMS)
        ws["k"], ws["v"], ws["block_table"] = ptr(self.k), ptr(self.v), ptr(self.offsets)
        ws["k_stride"] = ws["v_stride"] = (0, op.num_kv_heads * op.head_dim, op.head_dim, 1)
        ws["num_pages"], ws["batch_size"] = rows, op.batch_size
        self.kv = ws
        self.maps = tma.as_maps_arg(*[tma.encode_pages("workspace." + n, tma.OnePage(a.view(np.uint8)), 128,
                                                       cfg.tma_rows, tma.SWIZZLE_128B)
                                      for n, a in (("k", self.k), ("v", self.v))])
        self.ws_tiles = int(offs[-1]) // cfg.BN
        tile_seq = np.repeat(np.arange(kl.size, dtype=np.int32), padded // cfg.BN)  # the sequence of each tile
        tile_seq = np.concatenate([tile_seq, [0]]).astype(np.int32)  # a last 0: never empty (a real pointer)
        self.tile_seq = cp.asarray(tile_seq)
        # 32 ints first: ONCE_STATS, and the persistent grid's two counters
        self.flags = cp.zeros(32 + rows // cfg.BN * op.num_kv_heads * 4, cp.int32)
        self.fn = cfg.compiled.function(cfg.name, cfg.smem_bytes)

    def kernel_args(self, op: BatchPrefill, rec, q, kv_arrays) -> tuple:
        """``rec`` (checked, with the FP8 cache's params) rewired to the planned workspace, its tensor maps and the
        OnceArgs record (the persistent grid: and ``q``'s tensor map, boxes of BM rows of one head)."""
        once = np.zeros((), ONCE_ARGS)
        once["fp8"], once["flags"], once["num_kv_heads"] = rec["kv"], ptr(self.flags) + 128, op.num_kv_heads
        once["tile_seq"], once["num_work"], once["ws_tiles"] = ptr(self.tile_seq), self.num_work, self.ws_tiles
        rec["kv"], rec["work"] = self.kv, ptr(self.work)
        args = (as_kernel_arg(rec), self.maps, as_kernel_arg(once))
        if self.config.persistent:
            args += (_query_map(q, self.config.BM),)
        return args

    def before_launch(self, stream) -> None:
        import cupy as cp

        cp.cuda.runtime.memsetAsync(self.flags.data.ptr, 0, self.flags.nbytes, stream.ptr)


class DequantFirstPlan:
    """'dequantize_first': :func:`cukv.dequantize_kv`'s kernel into a planned 16-bit workspace, then the 16-bit
    contiguous prefill over it."""

    strategy = "dequantize_first"

    def __init__(self, op: BatchPrefill, qo, kl, mask, window, chunk):
        import cupy as cp

        from ..dtypes import storage_dtype
        from .dequant import DequantConfig, ragged_layout

        cfg = op.config
        self.inner = BatchPrefill(op.num_qo_heads, op.num_kv_heads, op.head_dim, None, op.dtype,
                                  max_blocks=op._max_blocks)
        self.inner.plan(qo, kl, mask=mask, window=window, chunk=chunk)
        self.config = self.inner.config
        offs, shape = ragged_layout(kl, op.num_kv_heads, op.head_dim)
        st = storage_dtype(op.dtype)
        self.dequant = DequantConfig(op.dtype, op.head_dim, cfg.page_size, cfg.scale_block)
        self.k, self.v = cp.empty(shape, st), cp.empty(shape, st)
        self.offsets, self.max_len = cp.asarray(offs.astype(np.int32)), int(kl.max(initial=0))
        self.dequant.compiled.function(self.dequant.name)

    def run(self, op: BatchPrefill, q, kv, out, lse, *, stream=None, check=False, **kwargs):
        from . import dequant

        kv_rec, _ = op._kv_params(kv, check)  # checks the cache and table against the FP8 config
        dequant.launch(self.dequant, kv_rec, self.k, self.v, self.offsets, self.max_len, op.batch_size, stream)
        return self.inner.run(q, (self.k, self.v, self.offsets), out, lse, stream=stream, **kwargs)


#: the plan object of each strategy (``BatchPrefill.strategy``; 16-bit caches run ``FusedPlan``)
PLANS = {"fused": FusedPlan, "convert_once": ConvertOncePlan, "dequantize_first": DequantFirstPlan}


def _query_map(q, bm: int):
    """The persistent grids' query tensor map (kernel argument): boxes of ``bm`` rows of one head, one 128-byte
    swizzle atom wide, which warp 0 stages per work item (templates/prefill.cuh ``stage_item``)."""
    from .. import tma

    return tma.as_maps_arg(tma.encode_pages("q", tma.OnePage(q.view(np.uint8)), 128, bm, tma.SWIZZLE_128B))


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


def prefill(q, q_offsets, kv, *, mask: str = "causal", window=None, chunk=None, **kwargs):
    """One-shot convenience: plan from ``q_offsets`` (host or device) and the KV lengths (the table's, or
    ``diff(kv_offsets)``), then run; ``kv`` is ``(cache, table)`` or ``(k, v, kv_offsets)`` as in
    :meth:`BatchPrefill.run`, keyword arguments other than the mask's go to it.

    Examples
    --------
    >>> import cupy as cp, numpy as np, cukv
    >>> from cukv import reference
    >>> from cukv.testing import assert_close
    >>> rng = np.random.default_rng(0)
    >>> q_offsets = kv_offsets = np.array([0, 30, 50])             # contiguous K/V: two prompts of 30 and 20
    >>> q = rng.standard_normal((50, 4, 128)).astype(np.float16)
    >>> k, v = (rng.standard_normal((50, 1, 128)).astype(np.float16) for _ in range(2))
    >>> kv = (cp.asarray(k), cp.asarray(v), cp.asarray(kv_offsets.astype(np.int32)))
    >>> out = cukv.prefill(cp.asarray(q), q_offsets, kv, mask="causal")
    >>> want, _ = reference.prefill_contiguous(q, q_offsets, k, v, kv_offsets, mask="causal")
    >>> assert_close(out.get(), want, "float16") < 0.01
    True
    """
    qd, _ = as_device(q, "q")
    if qd.ndim != 3:
        raise ValueError(f"q has shape {tuple(qd.shape)}; expected [total_q, num_qo_heads, head_dim]")
    qo = host_ints("q_offsets", q_offsets)
    if isinstance(kv, tuple) and len(kv) == 2:
        cache, table = kv
        check_cache_and_table("prefill", cache, table)
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
        ko = host_ints("kv_offsets", offs)
        kl = np.diff(ko)
        dt = element_dtype(kd, kdt or ("bfloat16" if kd.dtype.kind == "u" else None), "k")
        pf = BatchPrefill(qd.shape[1], kd.shape[1], kd.shape[2], None, dt)
    else:
        raise TypeError("kv must be (cache, table) or (k, v, kv_offsets)")
    pf.plan(qo, kl, mask=mask, window=window, chunk=chunk)
    return pf.run(q, kv, **kwargs)
