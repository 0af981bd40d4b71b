"""Helpers for checking kernels: tolerances that explain themselves and random paged batches.

Used by cukv's tests, examples and benchmarks; handy for users who fuzz their own shapes.
"""
from __future__ import annotations

import numpy as np

from . import reference
from .dtypes import from_storage, to_storage

#: (atol, rtol) of a kernel output in dtype against the float64 reference
TOLERANCE = {"bfloat16": (2e-2, 2e-2), "float16": (4e-3, 4e-3), "float32": (1e-4, 1e-4)}


def assert_close(actual, expected, dtype: str = "bfloat16", *, atol=None, rtol=None, name: str = "output"):
    """Fail with the worst coordinates when ``|actual - expected| > atol + rtol * |expected|`` anywhere.

    NaN never passes; matching infinities (LSE of an empty row) do. Returns the relative error
    ``|actual - expected| / |expected|`` (Frobenius norms over the finite entries).

    Examples
    --------
    >>> import numpy as np
    >>> from cukv.testing import assert_close
    >>> want = np.random.default_rng(0).standard_normal((4, 8))
    >>> assert_close(want + 1e-3, want, "bfloat16") < 0.01             # (atol, rtol) from TOLERANCE["bfloat16"]
    True
    >>> assert_close(want + 0.5, want, "bfloat16", name="decode out")
    Traceback (most recent call last):
    ...
    AssertionError: decode out: 32 of 32 elements outside atol=0.02, rtol=0.02; worst: ...
    """
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape {a.shape} != expected {e.shape}")
    d_atol, d_rtol = TOLERANCE[dtype]
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    same_inf = np.isinf(a) & np.isinf(e) & (np.sign(a) == np.sign(e))
    err = np.where(same_inf, 0.0, np.abs(a - e))
    err = np.where(np.isnan(err), np.inf, err)
    # a non-finite expected value (an empty row's -inf LSE) must be matched exactly; NaN never passes
    bound = atol + rtol * np.abs(np.where(np.isfinite(e), e, 0.0))
    bad = np.where(np.isfinite(e), err > bound, ~same_inf)
    if bad.any():
        idx = np.argsort(np.where(bad, err, -1).ravel())[::-1][:5]
        worst = "\n".join(f"  at {np.unravel_index(i, a.shape)}: got {a.ravel()[i]:.6g}, want {e.ravel()[i]:.6g}, "
                          f"|diff| {err.ravel()[i]:.3g}" for i in idx)
        raise AssertionError(f"{name}: {int(bad.sum())} of {bad.size} elements outside atol={atol}, rtol={rtol}; "
                             f"worst:\n{worst}")
    finite = np.isfinite(e)
    rel = np.linalg.norm(a[finite] - e[finite]) / max(np.linalg.norm(e[finite]), 1e-30)
    return float(rel)


def assert_within_staging(actual, exact, staged, dtype: str = "bfloat16", *, max_outside: float = 1e-3,
                          name: str = "output"):
    """Accuracy yardstick for kernels whose arithmetic is not reproducible in float64 (prefill's FP8 scores:
    the e4m3 tensor cores accumulate with fewer bits than float32). ``exact`` is the float64 reference on the
    kernel's inputs; ``staged`` the same reference with the cache rounded to ``dtype`` first, i.e. what a
    16-bit kernel over the dequantized cache computes. Passes when the kernel is no further from ``exact``
    than ``staged`` is (largest error) and at most ``max_outside`` of the elements leave ``dtype``'s
    tolerance; fails with the worst coordinates otherwise. NaN never passes."""
    a, e, st = (np.asarray(x, np.float64) for x in (actual, exact, staged))
    err = np.abs(a - e)
    err = np.where(np.isnan(err), np.inf, err)
    yard = float(np.max(np.abs(st - e), initial=0.0))
    atol, rtol = TOLERANCE[dtype]
    outside = err > atol + rtol * np.abs(e)
    if err.max(initial=0.0) > yard or outside.mean() > max_outside:
        idx = np.argsort(err.ravel())[::-1][:5]
        worst = "\n".join(f"  at {np.unravel_index(i, a.shape)}: got {a.ravel()[i]:.6g}, want {e.ravel()[i]:.6g}, "
                          f"|diff| {err.ravel()[i]:.3g}" for i in idx)
        raise AssertionError(f"{name}: largest error {err.max():.4g} (staging to {dtype}: {yard:.4g}); "
                             f"{outside.mean():.3%} of elements outside atol={atol}, rtol={rtol} (allowed "
                             f"{max_outside:.3%}); worst:\n{worst}")
    return float(err.max(initial=0.0))


def random_decode_case(rng, *, batch, lengths, num_qo_heads, num_kv_heads, head_dim, page_size, dtype="bfloat16",
                       layout="combined", extra_pages=3, shuffle=True, big_page_ids=False, kv_dtype=None,
                       scale_granularity=None):
    """A NaN-poisoned paged cache filled through :func:`cukv.append_kv`, a page table in random page order,
    and a query batch. Returns a dict with device objects and host float64 copies for the reference.

    ``kv_dtype='fp8_e4m3'`` builds a quantized cache (``dtype`` is then the query's and the appended
    tokens' type); per-token K/V magnitudes vary over two decades so granules get different scales, and a
    per-tensor cache gets scales from the data's amax."""
    import cupy as cp

    from .kvcache import PagedKVCache, PageTable
    from .ops.append import append_kv

    lengths = np.asarray(lengths, np.int64)
    pages_per = -(-lengths // page_size)
    max_pages = max(1, int(pages_per.max(initial=0)))
    base = 65536 + 7 if big_page_ids else 0  # physical ids above 65536 exercise 64-bit offsets
    num_pages = int(pages_per.sum()) + extra_pages + base
    quant = kv_dtype == "fp8_e4m3"
    cache = PagedKVCache(num_pages, page_size, num_kv_heads, head_dim, dtype=kv_dtype or dtype, layout=layout,
                         fill="nan", scale_granularity=scale_granularity if quant else None)
    ids = np.arange(base, num_pages)
    if shuffle:
        rng.shuffle(ids)
    table = np.zeros((batch, max_pages), np.int32)
    slots, cursor = [], 0
    for b in range(batch):
        n = int(pages_per[b])
        table[b, :n] = ids[cursor: cursor + n]
        cursor += n
        pos = np.arange(lengths[b])
        slots.append(table[b, pos // page_size].astype(np.int64) * page_size + pos % page_size)
    slots = np.concatenate(slots) if slots else np.zeros(0, np.int64)
    total = int(lengths.sum())
    k_new = rng.standard_normal((total, num_kv_heads, head_dim)).astype(np.float32)
    v_new = rng.standard_normal((total, num_kv_heads, head_dim)).astype(np.float32)
    if quant:
        k_new *= np.exp(rng.uniform(-2.3, 2.3, (total, num_kv_heads, 1))).astype(np.float32)
        v_new *= np.exp(rng.uniform(-2.3, 2.3, (total, num_kv_heads, 1))).astype(np.float32)
        if cache.scale_block == 0 and total:
            cache.set_tensor_scales(float(np.abs(from_storage(to_storage(k_new, dtype), dtype)).max()) / 448,
                                    float(np.abs(from_storage(to_storage(v_new, dtype), dtype)).max()) / 448)
    kd, vd = cp.asarray(to_storage(k_new, dtype)), cp.asarray(to_storage(v_new, dtype))
    append_kv(cache, kd, vd, cp.asarray(slots))
    q = rng.standard_normal((batch, num_qo_heads, head_dim)).astype(np.float32)
    pt = PageTable(cp.asarray(table), cp.asarray(lengths.astype(np.int32)), page_size)
    return {
        "cache": cache, "table": pt, "q": cp.asarray(to_storage(q, dtype)),
        "q_host": from_storage(to_storage(q, dtype), dtype),
        "k_new": from_storage(to_storage(k_new, dtype), dtype), "v_new": from_storage(to_storage(v_new, dtype), dtype),
        "slots": slots, "block_table": table, "lengths": lengths,
    }


def cache_pages_host(cache):
    """Host float64 copies of K and V pages ``[num_pages, page_size, H, D]`` (dequantized for FP8)."""
    return cache_values_host(cache, (slice(None),))


def cache_values_host(cache, index, rounded_to: str | None = None, round_k: bool = True, round_v: bool | None = None):
    """float64 K and V at ``cache.k[index]`` (a tuple of device indices over (page, token)), dequantized
    exactly (``e4m3 * scale`` in float64) for an FP8 cache, or, with ``rounded_to`` ('bfloat16'/'float16'),
    as the FP8 prefill stages them: the float32 product rounded to that type, for K unless ``round_k=False``
    (the FP8-scores path keeps K exact) and for V unless the cache has one scale per tensor (the fused prefill
    stages V's exact codes then and multiplies the output by the scale; ``round_v=True`` rounds it anyway, as
    ``fp8_prefill='dequantize_first'`` does)."""
    if not getattr(cache, "quantized", False):
        return from_storage(cache.k[index].get(), cache.dtype), from_storage(cache.v[index].get(), cache.dtype)
    from .fp8 import dequantize

    out = []
    round_v = cache.scale_block != 0 if round_v is None else round_v
    for codes, scales, rnd in ((cache.k, cache.k_scales, round_k), (cache.v, cache.v_scales, round_v)):
        sc = scales.get() if cache.scale_block == 0 else scales[index].get()
        vals = dequantize(codes[index].get(), sc, cache.scale_block)
        if rounded_to is not None and rnd:
            vals = from_storage(to_storage(vals.astype(np.float32), rounded_to), rounded_to)
        out.append(vals)
    return tuple(out)


def reference_decode(case, **kw):
    """float64 decode of a :func:`random_decode_case`, reading back only the slots the table reaches
    (gathered on the device, so a cache of 100k pages costs no more than a small one)."""
    import cupy as cp

    cache, table, lengths = case["cache"], case["block_table"], case["lengths"]
    ps = cache.page_size
    rows_p, rows_o = [], []
    for b, n in enumerate(lengths):
        pos = np.arange(int(n))
        rows_p.append(table[b, pos // ps])
        rows_o.append(pos % ps)
    rp, ro = np.concatenate(rows_p).astype(np.int64), np.concatenate(rows_o).astype(np.int64)
    k, v = cache_values_host(cache, (cp.asarray(rp), cp.asarray(ro)))
    k, v = k[:, None], v[:, None]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    compact = np.zeros((len(lengths), max(1, int(lengths.max(initial=1)))), np.int64)
    for b, n in enumerate(lengths):
        compact[b, : int(n)] = np.arange(starts[b], starts[b] + int(n))
    return reference.decode(case["q_host"], k, v, compact, lengths, **kw)


def random_prefill_case(rng, *, q_lens, cache_lens, num_qo_heads, num_kv_heads, head_dim, page_size,
                        dtype="bfloat16", layout="combined", big_page_ids=False, kv_dtype=None, scale_granularity=None):
    """A ragged prefill batch over a NaN-poisoned paged cache (random page order): sequence b already holds
    ``cache_lens[b]`` tokens and brings ``q_lens[b]`` new ones; all ``kv_len = cache_len + q_len`` tokens are
    written with :func:`cukv.append_kv` (the step appends first, then attends).

    Returns a dict: ``q`` (device ``[total_q, Hq, D]`` in storage dtype), ``q_offsets`` (host int32
    ``[B+1]``) and ``q_offsets_device``, ``cache``, ``table`` (a PageTable with lengths ``kv_len``),
    ``k``/``v`` (the same tokens as contiguous device ``[total_kv, Hkv, D]`` arrays) with ``kv_offsets`` (host)
    and ``kv_offsets_device`` (int32) for the contiguous-K/V path, and host float64 copies ``q_host``,
    ``k_new``, ``v_new`` plus ``q_lens``, ``cache_lens``, ``kv_lens``, ``block_table``, ``slots``.
    """
    import cupy as cp

    q_lens = np.asarray(q_lens, np.int64)
    cache_lens = np.asarray(cache_lens, np.int64)
    if q_lens.ndim != 1 or q_lens.shape != cache_lens.shape or np.any(q_lens < 0) or np.any(cache_lens < 0):
        raise ValueError(f"q_lens={q_lens.tolist()} and cache_lens={cache_lens.tolist()} must be equally long "
                         "lists of non-negative integers")
    kv_lens = cache_lens + q_lens
    case = random_decode_case(rng, batch=len(q_lens), lengths=kv_lens, num_qo_heads=num_qo_heads,
                              num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, dtype=dtype,
                              layout=layout, big_page_ids=big_page_ids, kv_dtype=kv_dtype,
                              scale_granularity=scale_granularity)
    total_q = int(q_lens.sum())
    q = to_storage(rng.standard_normal((total_q, num_qo_heads, head_dim)).astype(np.float32), dtype)
    q_offsets = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv_offsets = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    case.update({
        "q": cp.asarray(q), "q_host": from_storage(q, dtype),
        "q_offsets": q_offsets, "q_offsets_device": cp.asarray(q_offsets),
        "kv_offsets": kv_offsets, "kv_offsets_device": cp.asarray(kv_offsets),
        "k": cp.asarray(to_storage(case["k_new"], dtype)), "v": cp.asarray(to_storage(case["v_new"], dtype)),
        "q_lens": q_lens, "cache_lens": cache_lens, "kv_lens": kv_lens,
    })
    return case


def reference_prefill(case, staged: str | None = None, fp8_scores: bool = False, round_v: bool | None = None,
                      round_k: bool | None = None, **kw):
    """float64 prefill of a :func:`random_prefill_case`, reading back only the slots the table reaches
    (gathered on the device, like :func:`reference_decode`). ``kw`` are :func:`cukv.reference.prefill_contiguous`'s
    options (``mask``, ``window``, ``chunk``, ``softcap``, ``sink``, ``sm_scale``); a device ``sink`` is copied
    to the host. ``staged='bfloat16'`` (or 'float16') reads an FP8 cache as the prefill kernel stages it
    (``code * scale`` in float32, rounded to that type; V exact with a per-tensor scale, which the kernel applies
    to the output); with ``fp8_scores`` (``PrefillConfig.fp8_scores``) K stays exact and the query is read as the
    kernel splits it (:func:`cukv.fp8.split_query`). ``round_v``, ``round_k`` (default: not ``fp8_scores``): see
    :func:`cache_values_host`; ``fp8_prefill='convert_once'`` over a per-tensor cache stages both exact."""
    import cupy as cp

    if kw.get("sink") is not None and hasattr(kw["sink"], "get") and not isinstance(kw["sink"], np.ndarray):
        kw["sink"] = kw["sink"].get()
    cache, table, lengths = case["cache"], case["block_table"], case["kv_lens"]
    ps = cache.page_size
    pos = [np.arange(int(n)) for n in lengths]
    rp = np.concatenate([table[b, p // ps] for b, p in enumerate(pos)] + [np.zeros(0, np.int64)]).astype(np.int64)
    ro = np.concatenate([p % ps for p in pos] + [np.zeros(0, np.int64)]).astype(np.int64)
    round_k = not fp8_scores if round_k is None else round_k
    k, v = cache_values_host(cache, (cp.asarray(rp), cp.asarray(ro)), staged, round_k=round_k, round_v=round_v)
    q = case["q_host"]
    if fp8_scores:
        from .fp8 import split_query

        q = split_query(q)
    return reference.prefill_contiguous(q, case["q_offsets"], k, v, case["kv_offsets"], **kw)


def capture(run):
    """A CUDA graph of ``run(stream)``: one direct call on a new non-blocking stream (it loads the module and
    allocates), then one captured there. Returns ``(graph, stream)``; launch it with :func:`replay`."""
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        run(stream)
        stream.begin_capture()
        run(stream)
        graph = stream.end_capture()
    return graph, stream


def replay(graph, stream) -> None:
    """Launch a captured CUDA graph on ``stream`` after every device operation issued before it, and wait for it.

    A non-blocking stream does not wait for the default stream, where ``arr[...] = new`` and ``out.fill(0)`` run
    when issued outside ``with stream:``; launching the graph without this wait may read the old inputs."""
    import cupy as cp

    cp.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
