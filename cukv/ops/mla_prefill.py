"""Non-absorbed MLA prefill (DeepSeek-V2/V3, Kimi K2): 192-wide query/key heads (128 "nope" + 64 rope), 128-wide
values, the rope part of K read once per tile from the MLA latent cache and shared by every head. FlashInfer-style
plan/run as :class:`cukv.ops.prefill.BatchPrefill`: ``plan`` fixes the batch and the work list on the host, ``run``
reads only device buffers (graph-capturable).

The kernel, its tile and its measurements: docs/mla.md ("MLA prefill"), docs/tuning.md ("MLA prefill").
"""
from __future__ import annotations

import math

import numpy as np

from ..configs.mla_prefill import QK_DIM, V_DIM, MLAPrefillConfig
from ..policy.mla_prefill import default_config, wide_tile
from ..policy.prefill import tail_heads as policy_tail_heads
from ..device import check_same_device, current_device, sm_count
from ..mla_cache import NOPE, MLAKVCache
from ..operand import KV_PARAMS, MLA_PREFILL_ARGS, ONCE_ARGS, PREFILL_ARGS, as_kernel_arg, ptr
from ..validate import (attention_outputs, check_bool, check_choice, check_device_array, check_float, check_int,
                        check_mla_prefill_shapes, check_planned, check_table, checked, mla_prefill_batch)
from .prefill import _query_map, _work_array, _work_list

MASKS = ("none", "causal")
#: K/V bytes one head reads per key: its 16-bit k_nope and v rows (the shared rope row is not per head)
KV_BYTES_PER_KEY = 2 * (QK_DIM - 64 + V_DIM)
#: byte offset of the bf16 rope values in a 656-byte FP8 MLA row (512 codes, 4 float32 scales)
FP8_ROPE_BYTE = 528


def mla_prefill_flops(batch: int, q_len: int, kv_len: int, num_heads: int, causal: bool = True) -> float:
    """Floating-point operations of an MLA prefill: ``2 * B * H * Sq * Sk * (192 + 128)``, halved for the causal
    half of a square (``q_len == kv_len``) problem; a causal chunk over a cached prefix counts the keys each query
    sees."""
    if not causal:
        return 2.0 * batch * num_heads * q_len * kv_len * (QK_DIM + V_DIM)
    pairs = q_len * (kv_len - q_len) + q_len * (q_len + 1) / 2 if kv_len >= q_len else q_len * kv_len / 2
    return 2.0 * batch * num_heads * pairs * (QK_DIM + V_DIM)


class BatchMLAPrefill:
    """Non-absorbed MLA prefill over a ragged batch.

    Parameters
    ----------
    num_heads : int
        Query heads (1..65535); ``k_nope`` and ``v`` have as many (no grouping: the up-projection is per head).
    page_size : int or None
        Tokens per page of the :class:`~cukv.MLAKVCache` the rope part comes from; ``None`` for a contiguous
        ``k_rope[total_kv, 64]``.
    dtype : {'bfloat16', 'float16'}
        Query, ``k_nope``, ``v``, rope and output type (the bf16 rope of an FP8 cache needs 'bfloat16').
    config : MLAPrefillConfig, optional
        Tile shape (default: :func:`cukv.policy.mla_prefill.default_config` for the dtype and page size; :meth:`plan`
        then takes the wider tile where :func:`~cukv.policy.mla_prefill.wide_tile` says so).
    max_blocks : int, optional
        Caps the blocks of a persistent grid (``config.persistent``; default one per SM).

    ``run(q[T, H, 192], k_nope[Tk, H, 128], v[Tk, H, 128], cache=..., block_table=...)`` (or ``k_rope=[Tk, 64]``)
    returns ``out[T, H, 128]`` and, with ``return_lse``, the natural-log ``lse[T, H]``; query i of sequence b sits
    at position ``kv_len - q_len + i`` (a cached prefix counts in ``kv_lengths``), as
    :func:`cukv.reference.mla_prefill` defines.

    Examples
    --------
    Two sequences of 40 and 7 keys (a cached prefix and 5 and 7 new tokens), the rope part from a page-16 cache:

    >>> import cupy as cp, numpy as np, cukv
    >>> from cukv import reference
    >>> from cukv.testing import assert_close
    >>> rng = np.random.default_rng(0)
    >>> cache = cukv.MLAKVCache(num_pages=4, page_size=16, dtype="float16", fill="nan")
    >>> rows = rng.standard_normal((64, 576)).astype(np.float16)
    >>> cukv.append_mla(cache, cp.asarray(rows[:, :512]), cp.asarray(rows[:, 512:]), cp.arange(64))
    >>> table = np.array([[0, 1, 2], [3, 0, 0]], np.int32)               # sequence 1 starts at page 3
    >>> q = rng.standard_normal((12, 4, 192)).astype(np.float16)         # 5 + 7 new tokens, 4 heads
    >>> k_nope, v = (rng.standard_normal((47, 4, 128)).astype(np.float16) for _ in range(2))
    >>> pf = cukv.BatchMLAPrefill(num_heads=4, page_size=16, dtype="float16").plan([0, 5, 12], [40, 7])
    >>> out = pf.run(cp.asarray(q), cp.asarray(k_nope), cp.asarray(v), cache=cache, block_table=cp.asarray(table))
    >>> k_rope = reference.mla_rope_rows(cache.data.get(), table, [40, 7])
    >>> want, _ = reference.mla_prefill(q, [0, 5, 12], k_nope, v, k_rope, [0, 40, 47])
    >>> assert_close(out.get(), want, "float16") < 0.01
    True
    """

    def __init__(self, num_heads: int, page_size: int | None = 64, dtype="bfloat16",
                 config: MLAPrefillConfig | None = None, max_blocks: int | None = None):
        from ..arrays import canonical_dtype

        self.num_heads = check_int("num_heads", num_heads, 1, 65535)  # the grid's y dimension
        page_size = check_int("page_size", page_size, 1, 4096, none_ok=True, note="a contiguous k_rope")
        self.dtype = canonical_dtype(dtype)
        ps = 0 if page_size is None else int(page_size)
        # config None: plan() picks between the two default tiles (cukv.policy.mla_prefill.wide_tile), made once here
        # so that each keeps its loaded module
        self._tiles = None if config is not None else (default_config(self.dtype, ps),
                                                       default_config(self.dtype, ps, wide=True))
        if config is None:
            config = self._tiles[0]
        elif not isinstance(config, MLAPrefillConfig):
            raise TypeError(f"config must be an MLAPrefillConfig, got {type(config).__name__}")
        if (config.dtype, config.page_size) != (self.dtype, ps):
            raise ValueError(f"config {config.name} does not match dtype={self.dtype}, page_size={ps}")
        self.page_size, self.config = page_size, config
        self._max_blocks = check_int("max_blocks", max_blocks, 1, 1 << 20, none_ok=True, note="one block per SM")
        self._planned = False

    def plan(self, q_offsets, kv_lengths, *, kv_offsets=None, mask: str = "causal",
             tail_heads: int | None = None) -> "BatchMLAPrefill":
        """Fix the batch: host ``q_offsets[B + 1]`` and ``kv_lengths[B]`` (keys per sequence, cached prefix plus new
        tokens). ``k_nope`` / ``v`` rows of sequence b start at ``kv_offsets[b]`` (host ints, default the running
        sum of ``kv_lengths``; ``kv_offsets[b + 1] - kv_offsets[b]`` must equal ``kv_lengths[b]``). ``mask``:
        'causal' (bottom-right) or 'none'. ``tail_heads``: how many of the last heads the persistent grid runs as one
        section (default :func:`cukv.policy.prefill.tail_heads`; 1: none). Compiles (or loads) the kernel."""
        import cupy as cp

        qo, kl, ko = mla_prefill_batch(q_offsets, kv_lengths, kv_offsets)
        b = qo.size - 1
        check_choice("mask", mask, MASKS)
        tail = check_int("tail_heads", tail_heads, 1, self.num_heads, none_ok=True, note="the policy's choice")
        if self._tiles is not None:
            self.config = self._tiles[wide_tile(np.diff(qo), kl, mask)]
        cfg = self.config
        self._work, self._num_work = _work_array(_work_list(np.diff(qo), kl, cfg, mask, None, None))
        if tail is None:
            tail = policy_tail_heads(self._num_work, self.num_heads, int(kl.sum()) * KV_BYTES_PER_KEY,
                                     self._max_blocks or sm_count())
        self._tail_heads = tail
        self.batch_size, self.total_q, self.kv_rows = b, int(qo[-1]), int(ko[-1])
        self._host_lengths, self._mask = kl, mask
        self._q_offsets = cp.asarray(qo.astype(np.int32))
        self._kv_offsets = cp.asarray(ko.astype(np.int32))
        self._kv_lengths = cp.asarray(kl.astype(np.int32))
        self._fn = cfg.compiled.function(cfg.name, cfg.smem_bytes)
        # the persistent grid's item counter and finished-block count (OnceArgs.flags[-2], [-3]): zero between
        # launches, the kernel's last block resets them
        self._counters = cp.zeros(32, cp.int32) if cfg.persistent else None
        self._device = current_device()
        self._planned = True
        return self

    def run(self, q, k_nope, v, *, cache: MLAKVCache | None = None, block_table=None, k_rope=None, out=None,
            lse=None, return_lse: bool = False, sink=None, softmax_scale: float | None = None, stream=None,
            check: bool | None = None):
        """Attend ``q[total_q, H, 192]`` to ``[k_nope | k_rope]`` with values ``v``: ``k_nope`` and ``v``
        ``[>= kv_rows, H, 128]`` (rows from the plan's ``kv_offsets``); the rope part from ``cache`` through
        ``block_table[B, max_pages]`` (int32 device; columns 512..575 of a 16-bit cache, the bf16 rope of FP8 rows)
        or, with ``page_size=None``, from ``k_rope[>= kv_rows, 64]``. ``sink[H]`` float32 joins the softmax
        denominator; ``softmax_scale`` defaults to ``1/sqrt(192)``. ``check=True`` (or ``CUKV_CHECK=1``) copies
        the table to the host and checks every page a length reaches (a sync; not graph-capturable)."""
        import cupy as cp

        check_float("softmax_scale", softmax_scale, positive=True, none_ok=True, note="1/sqrt(192)")
        return_lse, check = check_bool("return_lse", return_lse), checked(check)
        check_planned(self, "plan(q_offsets, kv_lengths)")
        check_same_device("BatchMLAPrefill", self._device)
        h, dt = self.num_heads, self.dtype
        qd, _ = check_device_array("q", q, dtypes=(dt,), declared=dt, ndim=3, align=16)
        kn, _ = check_device_array("k_nope", k_nope, dtypes=(dt,), declared=dt, ndim=3, align=16)
        vv, _ = check_device_array("v", v, dtypes=(dt,), declared=dt, ndim=3, align=16)
        check_mla_prefill_shapes(h, self.total_q, self.kv_rows, qd.shape, kn.shape, vv.shape)
        for name, a in (("k_nope", kn), ("v", vv)):
            _check_rows(name, a)
        _check_rows("q", qd)
        kv = self._rope_params(cache, block_table, k_rope, check)
        out, lse, sink = attention_outputs(qd[:, :, :V_DIM], out, lse, self.total_q, h, return_lse, sink, None)
        rec = np.zeros((), PREFILL_ARGS)
        rec["kv"] = kv
        rec["q"], rec["out"], rec["lse"], rec["sink"] = ptr(qd), ptr(out), ptr(lse), ptr(sink)
        rec["q_offsets"], rec["work"] = ptr(self._q_offsets), ptr(self._work)
        rec["q_stride"] = (qd.strides[0] // 2, qd.strides[1] // 2)
        rec["o_stride"] = (out.strides[0] // 2, out.strides[1] // 2)
        rec["sm_scale"] = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(QK_DIM)
        rec["num_qo_heads"], rec["group"], rec["causal"] = h, 1, int(self._mask == "causal")
        rec["tail_heads"] = self._tail_heads
        m = np.zeros((), MLA_PREFILL_ARGS)
        m["k_nope"], m["v"], m["kv_offsets"] = ptr(kn), ptr(vv), ptr(self._kv_offsets)
        m["kn_stride"] = (kn.strides[0] // 2, kn.strides[1] // 2)
        m["v_stride"] = (vv.strides[0] // 2, vv.strides[1] // 2)
        cfg = self.config
        args = (as_kernel_arg(rec), as_kernel_arg(m))
        if cfg.tma:
            args += (self._tma_maps(kn, vv, cache),)
        grid = (self._num_work, h, 1)
        if cfg.persistent:
            once = np.zeros((), ONCE_ARGS)
            once["flags"], once["num_work"] = ptr(self._counters) + 128, self._num_work
            args += (as_kernel_arg(once), _query_map(qd, cfg.BM))
            grid = (min(self._max_blocks or sm_count(), self._num_work * h), 1, 1)
        if cfg.tma_store and self._num_work:
            args += (_output_map(out),)
        if self._num_work:
            with (stream or cp.cuda.get_current_stream()):
                self._fn(grid, (cfg.num_threads,), args, shared_mem=cfg.smem_bytes)
        return (out, lse) if return_lse else out

    def _tma_maps(self, kn, vv, cache):
        """The MLAPrefillMaps argument (cukv/tma.py): k_nope and v as bytes [1, Tk, H, 256] in boxes of
        ``tma_rows`` tokens of one head, the rope rows as [pages, page_size, 1, 128] (a contiguous k_rope: one page)
        in boxes of ``rope_tma_rows`` tokens (none when 0: those rows come by cp.async), 128-byte swizzle."""
        import cupy as cp

        from .. import tma

        cfg = self.config
        maps = [tma.encode_pages(n, tma.OnePage(a.view(cp.uint8)), 128, cfg.tma_rows, tma.SWIZZLE_128B)
                for n, a in (("k_nope", kn), ("v", vv))]
        if not cfg.rope_tma_rows:
            maps.append(bytes(tma.MAP_BYTES))
        elif cfg.page_size == 0:
            k_rope = self._keep  # the k_rope _rope_params checked
            s = int(k_rope.strides[0])
            maps.append(tma.encode_bytes("k_rope", int(k_rope.data.ptr), (1, k_rope.shape[0], 1, 128),
                                         (k_rope.shape[0] * s, s, s, 1), 128, cfg.rope_tma_rows, tma.SWIZZLE_128B))
        else:
            base = cache.ptr + (FP8_ROPE_BYTE if cache.quantized else 2 * NOPE)
            maps.append(tma.encode_bytes("cache", base, (cache.num_pages, cache.page_size, 1, 128),
                                         (cache.page_stride, cache.row_stride, cache.row_stride, 1), 128,
                                         cfg.rope_tma_rows, tma.SWIZZLE_128B))
        return tma.as_maps_arg(*maps)

    def _rope_params(self, cache, block_table, k_rope, check: bool) -> np.ndarray:
        """The KVCacheParams record of the rope source (PrefillArgs.kv), validated."""
        rec = np.zeros((), KV_PARAMS)
        rec["batch_size"] = self.batch_size
        if self.config.page_size == 0:
            if cache is not None or block_table is not None:
                raise ValueError("this BatchMLAPrefill reads a contiguous k_rope (page_size=None); pass k_rope=, not "
                                 "cache= / block_table=")
            if k_rope is None:
                raise ValueError("k_rope is missing: page_size=None reads the rope part from k_rope[total_kv, 64]")
            kr, _ = check_device_array("k_rope", k_rope, dtypes=(self.dtype,), declared=self.dtype, ndim=2, align=16)
            check_mla_prefill_shapes(self.num_heads, self.total_q, self.kv_rows, None, None, None, kr.shape)
            _check_rows("k_rope", kr)
            rec["k"] = rec["v"] = ptr(kr)
            rec["k_stride"] = rec["v_stride"] = (0, kr.strides[0] // 2, 0, 1)
            rec["block_table"], rec["num_pages"] = ptr(self._kv_offsets), kr.shape[0]
            self._keep = kr
            return rec
        if k_rope is not None:
            raise ValueError(f"this BatchMLAPrefill reads the rope part from a paged cache (page_size="
                             f"{self.page_size}); pass cache= and block_table=, not k_rope=")
        if not isinstance(cache, MLAKVCache):
            raise TypeError(f"cache must be an MLAKVCache, got {type(cache).__name__}")
        if cache.page_size != self.config.page_size:
            raise ValueError(f"cache.page_size={cache.page_size}; this BatchMLAPrefill was built for page_size="
                             f"{self.config.page_size}")
        if cache.quantized:
            if self.dtype != "bfloat16":
                raise TypeError(f"an FP8 cache's rope values are bf16; this BatchMLAPrefill was built for {self.dtype}")
            base = cache.ptr + FP8_ROPE_BYTE
        else:
            if cache.dtype != self.dtype:
                raise TypeError(f"cache is {cache.dtype}; this BatchMLAPrefill was built for {self.dtype}")
            base = cache.ptr + 2 * NOPE
        if cache.page_stride % 16 or cache.row_stride % 16:
            raise ValueError(f"cache strides ({cache.page_stride}, {cache.row_stride}) bytes must be multiples of 16")
        bt = check_device_array("block_table", block_table, dtypes=(np.int32,), ndim=2, unit_last_stride=True)
        if bt.shape[0] < self.batch_size:
            raise ValueError(f"block_table has {bt.shape[0]} rows; the plan has {self.batch_size} sequences")
        need = -(-int(self._host_lengths.max(initial=0)) // cache.page_size)
        if bt.shape[1] < need:
            raise ValueError(f"block_table has {bt.shape[1]} pages per row ({bt.shape[1] * cache.page_size} tokens); "
                             f"the plan's longest sequence needs {need}")
        if check:
            check_table(bt[: self.batch_size].get(), self._host_lengths, cache.page_size, cache.num_pages,
                        ("block_table", "kv_lengths"))
        rec["k"] = rec["v"] = base
        rec["k_stride"] = rec["v_stride"] = (cache.page_stride // 2, cache.row_stride // 2, 0, 1)
        rec["block_table"], rec["cache_lengths"] = ptr(bt), ptr(self._kv_lengths)
        rec["bt_stride"], rec["max_pages_per_seq"] = bt.strides[0] // 4, bt.shape[1]
        rec["num_pages"] = cache.num_pages
        self._keep = (cache, bt)
        return rec


def _output_map(out):
    """``config.tma_store``'s output tensor map (kernel argument): ``out[T, H, 128]`` as bytes ``[1, T, H, 256]`` in
    boxes of one 128-byte swizzle atom x one head x 16 tokens (a consumer warp's rows; templates/prefill_consumer.cuh
    ``store_output_tma``)."""
    import cupy as cp

    from .. import tma

    return tma.as_maps_arg(tma.encode_pages("out", tma.OnePage(out.view(cp.uint8)), 128, 16, tma.SWIZZLE_128B))


def _check_rows(name: str, a) -> None:
    """16-byte copies of every row: a unit dim stride and 16-byte token (and head) strides."""
    if a.strides[-1] != 2 or any(s % 16 for s in a.strides[:-1]):
        raise ValueError(f"{name} must have a unit last stride and 16-byte aligned row strides; got strides "
                         f"{a.strides} bytes")


def mla_prefill(q, k_nope, v, q_offsets, kv_lengths, *, cache: MLAKVCache | None = None, block_table=None,
                k_rope=None, kv_offsets=None, mask: str = "causal", **kwargs):
    """One-shot convenience: plan for this batch and run (use :class:`BatchMLAPrefill` when the batch repeats:
    ``plan`` costs host work and a device copy). The rope part comes from ``cache`` through ``block_table`` or from
    a contiguous ``k_rope[Tk, 64]``; ``kwargs`` go to :meth:`BatchMLAPrefill.run` (``return_lse``, ``sink``,
    ``softmax_scale``, ``out``, ``check``).

    Examples
    --------
    >>> import cupy as cp, numpy as np, cukv
    >>> from cukv import reference
    >>> from cukv.testing import assert_close
    >>> rng = np.random.default_rng(1)
    >>> q = rng.standard_normal((9, 2, 192)).astype(np.float16)
    >>> k_nope, v = (rng.standard_normal((9, 2, 128)).astype(np.float16) for _ in range(2))
    >>> k_rope = rng.standard_normal((9, 64)).astype(np.float16)
    >>> out = cukv.mla_prefill(*(cp.asarray(x) for x in (q, k_nope, v)), [0, 9], [9], k_rope=cp.asarray(k_rope))
    >>> want, _ = reference.mla_prefill(q, [0, 9], k_nope, v, k_rope, [0, 9])
    >>> assert_close(out.get(), want, "float16") < 0.01
    True
    """
    qa, dt = check_device_array("q", q, dtypes=("bfloat16", "float16"), ndim=3)
    if cache is not None and not isinstance(cache, MLAKVCache):
        raise TypeError(f"cache must be an MLAKVCache; got {type(cache).__name__}")
    page_size = cache.page_size if cache is not None else None
    pf = BatchMLAPrefill(qa.shape[1], page_size, dt)
    pf.plan(q_offsets, kv_lengths, kv_offsets=kv_offsets, mask=mask)
    return pf.run(q, k_nope, v, cache=cache, block_table=block_table, k_rope=k_rope, **kwargs)
