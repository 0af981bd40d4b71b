"""dequantize_kv: an FP8 paged cache's keys and values, gathered per sequence into ragged 16-bit K/V.

``BatchPrefill(fp8_prefill='dequantize_first')`` runs it before the 16-bit contiguous prefill: one pass that
reads each used code once, where the fused FP8 kernel converts every K/V tile once per query tile that
visits it (see ``BatchPrefill``). It is also a way to hand an FP8 cache to any 16-bit kernel.
"""
from __future__ import annotations

import numpy as np

from ..configs.dequant import DequantConfig
from ..operand import DEQUANT_ARGS, as_kernel_arg, kv_params, ptr
from ..validate import check_table, checked, host_ints


def dequantize_kv(cache, table, kv_lengths, dtype: str = "bfloat16", out=None, *, stream=None,
                  check: bool | None = None):
    """Gather sequence ``b``'s first ``kv_lengths[b]`` keys and values of an FP8 ``cache`` through ``table`` into
    ragged ``k, v [sum(kv_lengths), H, D]`` of ``dtype`` (bf16 as uint16 bits), ``e4m3(code) * scale`` in float32
    rounded once, exactly :meth:`PagedKVCache.dequantize`'s values. Returns ``(k, v, kv_offsets)`` with int32
    device ``kv_offsets[B + 1]``: the ``(k, v, kv_offsets)`` a contiguous ``BatchPrefill`` takes.

    ``kv_lengths`` is a host int array (it sizes the output). Slots past a sequence's length are never read, so
    NaN-poisoned unused slots cannot leak; a page id outside the cache reads as zeros. ``out`` = ``(k, v)``
    reuses arrays of the right shape and dtype (what ``BatchPrefill`` does, so CUDA graphs keep their addresses).
    ``check=True`` (or ``CUKV_CHECK=1``) validates the table's page ids on the host before the launch.

    Examples
    --------
    >>> import cupy as cp, numpy as np, cukv
    >>> from cukv.dtypes import to_storage
    >>> cache = cukv.PagedKVCache(num_pages=8, page_size=16, num_kv_heads=2, head_dim=128, dtype="fp8_e4m3")
    >>> seqs = cukv.SequenceTable(cache, max_batch=2, max_pages_per_seq=4)
    >>> slots = cp.asarray(seqs.extend([20, 5]))                    # 20 + 5 tokens -> 3 pages
    >>> rng = np.random.default_rng(0)
    >>> x, y = (cp.asarray(to_storage(rng.standard_normal((25, 2, 128)), "bfloat16")) for _ in range(2))
    >>> cukv.append_kv(cache, x, y, slots)                          # quantizes per (token, head)
    >>> k, v, offs = cukv.dequantize_kv(cache, seqs.page_table(), [20, 5])
    >>> k.shape, offs.get().tolist()
    ((25, 2, 128), [0, 20, 25])
    >>> k_pages, v_pages = cache.dequantize()                       # the same values, page by page
    >>> bool((k[:16] == k_pages[seqs.pages[0][0]]).all() and (v[20:] == v_pages[seqs.pages[1][0], :5]).all())
    True
    """
    import cupy as cp

    from ..arrays import canonical_dtype
    from ..dtypes import storage_dtype
    from ..kvcache import PagedKVCache, PageTable

    if not isinstance(cache, PagedKVCache) or not getattr(cache, "quantized", False):
        raise TypeError(f"cache must be an FP8 PagedKVCache (dequantize_kv reads FP8 codes); got {cache!r}")
    if not isinstance(table, PageTable):
        raise TypeError(f"table must be a PageTable; got {type(table).__name__}")
    dt = canonical_dtype(dtype)
    cfg = DequantConfig(dt, cache.head_dim, cache.page_size, cache.scale_block)
    kl = host_ints("kv_lengths", kv_lengths)
    if kl.ndim != 1 or kl.size < 1 or np.any(kl < 0):
        raise ValueError(f"kv_lengths must be a non-empty 1-D array of non-negative ints; got {kl.tolist()[:8]}")
    if kl.size > table.batch_size:
        raise ValueError(f"kv_lengths has {kl.size} sequences; table covers {table.batch_size}")
    need = -(-kl // cache.page_size)
    if np.any(need > table.block_table.shape[1]):
        i = int(np.argmax(need > table.block_table.shape[1]))
        raise ValueError(f"kv_lengths[{i}]={kl[i]} needs {need[i]} pages; the table has {table.block_table.shape[1]} "
                         "columns")
    if table.page_size != cache.page_size:
        raise ValueError(f"table.page_size={table.page_size}; the cache uses {cache.page_size}")
    if checked(check):  # the kernel reads kv_lengths[b] keys through the table (its lengths are not used)
        check_table(table.block_table[: kl.size].get(), kl, cache.page_size, cache.num_pages,
                    ("table.block_table", "kv_lengths"))
    offs, shape = ragged_layout(kl, cache.num_kv_heads, cache.head_dim)
    st = storage_dtype(dt)
    if out is None:
        k, v = cp.empty(shape, st), cp.empty(shape, st)
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError(f"out must be a (k, v) pair of arrays of shape {shape}; got {type(out).__name__}")
        k, v = out
        for n, a in (("out[0]", k), ("out[1]", v)):
            if not isinstance(a, cp.ndarray) or a.shape != shape or a.dtype != st or not a.flags.c_contiguous:
                raise ValueError(f"{n} must be a contiguous {np.dtype(st)} array of shape {shape}")
    offs_d = cp.asarray(offs.astype(np.int32))
    launch(cfg, kv_params(cache, table), k, v, offs_d, int(kl.max()), kl.size, stream)
    return k, v, offs_d


def ragged_layout(kv_lengths: np.ndarray, num_heads: int, head_dim: int) -> tuple:
    """Host ``kv_offsets[B + 1]`` (int64) and the ``[total, num_heads, head_dim]`` shape of ragged K/V holding
    ``kv_lengths[b]`` keys per sequence."""
    offs = np.zeros(kv_lengths.size + 1, np.int64)
    np.cumsum(kv_lengths, out=offs[1:])
    if offs[-1] >= 2**31:
        raise ValueError(f"kv_lengths sum to {offs[-1]}; at most 2**31 - 1 rows")
    return offs, (int(offs[-1]), int(num_heads), int(head_dim))


def launch(cfg: DequantConfig, kv_rec, k, v, kv_offsets, max_len: int, batch: int, stream=None) -> None:
    """The kernel over checked arguments: ``kv_rec`` the cache's and table's KV_PARAMS record
    (:func:`cukv.operand.kv_params`), ``kv_offsets[batch + 1]`` int32 on the device, ``k``/``v`` its rows."""
    import cupy as cp

    rec = np.zeros((), DEQUANT_ARGS)
    rec["kv"] = kv_rec
    rec["k_out"], rec["v_out"], rec["kv_offsets"] = ptr(k), ptr(v), ptr(kv_offsets)
    rec["num_heads"] = k.shape[1]
    if k.shape[0]:
        fn = cfg.compiled.function(cfg.name)
        with (stream or cp.cuda.get_current_stream()):
            fn(cfg.grid(max_len, k.shape[1], batch), (cfg.threads,), (as_kernel_arg(rec),))
