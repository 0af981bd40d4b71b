"""append_kv: write new tokens' K and V into their cache slots."""
from __future__ import annotations

import numpy as np

from ..arrays import as_device, check_contiguous, element_dtype
from ..configs.append import AppendConfig
from ..operand import APPEND_ARGS, as_kernel_arg, kv_params, ptr
from ..validate import check_slots, checked


def append_kv(cache, k_new, v_new, slot_mapping, *, stream=None, check: bool | None = None) -> None:
    """Write ``k_new``/``v_new`` ``[tokens, num_kv_heads, head_dim]`` into ``cache`` at ``slot_mapping[tokens]``.

    An FP8 cache quantizes on the way in (``k_new``/``v_new`` in bf16 or fp16): each granule's scale is
    ``max(amax, 448 * 2**-32) / 448`` and each code ``e4m3(x / scale)`` (round to nearest even, saturating),
    bit-identical to :func:`cukv.fp8.quantize`; per-tensor caches divide by the scales the caller set with
    :meth:`PagedKVCache.set_tensor_scales` (read on the device, so graph replays see updates).

    ``slot = physical_page * page_size + offset``; a slot of -1 (or any slot outside the cache) is skipped,
    so padding tokens and a bad mapping never write outside the cache. Graph-capturable when
    ``slot_mapping`` is an int64 device array. ``check=True`` (or ``CUKV_CHECK=1``) copies the slots to the host
    first and refuses a slot outside the cache (other than -1) or one written twice (see docs/errors.md).

    Examples
    --------
    >>> import cupy as cp, numpy as np, cukv
    >>> from cukv.testing import cache_pages_host
    >>> cache = cukv.PagedKVCache(num_pages=8, page_size=4, num_kv_heads=2, head_dim=64, dtype="float16")
    >>> seqs = cukv.SequenceTable(cache, max_batch=1, max_pages_per_seq=8)
    >>> slots = seqs.extend([6])                   # 6 tokens -> 2 pages
    >>> slots.tolist()
    [0, 1, 2, 3, 4, 5]
    >>> rng = np.random.default_rng(0)
    >>> k, v = (rng.standard_normal((6, 2, 64)).astype(np.float16) for _ in range(2))
    >>> cukv.append_kv(cache, cp.asarray(k), cp.asarray(v), cp.asarray(slots))
    >>> k_pages, v_pages = cache_pages_host(cache)
    >>> bool((k_pages[0] == k[:4]).all() and (k_pages[1, :2] == k[4:]).all() and (v_pages[1, :2] == v[4:]).all())
    True
    >>> cukv.append_kv(cache, cp.asarray(k[:1]), cp.asarray(v[:1]), cp.asarray([-1]))   # -1: a padding token
    """
    import cupy as cp

    from ..kvcache import PagedKVCache

    check = checked(check)
    kd, kdt = as_device(k_new, "k_new")
    vd, vdt = as_device(v_new, "v_new")
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache; got {type(cache).__name__}")
    quantized = getattr(cache, "quantized", False)
    dt = element_dtype(kd, kdt or ("bfloat16" if kd.dtype == cp.uint16 else None), "k_new")
    if not quantized and dt != cache.dtype:
        raise TypeError(f"k_new is {dt}; the cache holds {cache.dtype}")
    want = (None, cache.num_kv_heads, cache.head_dim)
    for name, a in (("k_new", kd), ("v_new", vd)):
        if a.ndim != 3 or a.shape[1:] != want[1:]:
            raise ValueError(f"{name} has shape {tuple(a.shape)}; expected [tokens, {cache.num_kv_heads}, {cache.head_dim}]")
        check_contiguous(a, name)
    if vd.shape != kd.shape or vd.dtype != kd.dtype:
        raise ValueError(f"v_new {tuple(vd.shape)}/{vd.dtype} must match k_new {tuple(kd.shape)}/{kd.dtype}")
    if isinstance(slot_mapping, np.ndarray):
        slot_mapping = cp.asarray(slot_mapping)
    sd, _ = as_device(slot_mapping, "slot_mapping")
    if sd.dtype not in (cp.int32, cp.int64):
        raise TypeError(f"slot_mapping has dtype {sd.dtype}; expected int64 (or int32, converted with a copy)")
    if sd.shape != (kd.shape[0],):
        raise ValueError(f"slot_mapping has shape {tuple(sd.shape)}; expected ({kd.shape[0]},), one slot per token")
    sd = cp.ascontiguousarray(sd, dtype=cp.int64)
    if check:
        check_slots(sd, cache.num_slots)
    if kd.shape[0] == 0:
        return
    if quantized:
        cfg = AppendConfig(dt, cache.head_dim, cache.page_size, kv_dtype=cache.dtype, scale_block=cache.scale_block)
    else:
        cfg = AppendConfig(cache.dtype, cache.head_dim, cache.page_size)
    rec = np.zeros((), APPEND_ARGS)
    rec["kv"] = kv_params(cache)
    rec["k_new"], rec["v_new"], rec["slots"] = ptr(kd), ptr(vd), ptr(sd)
    rec["num_tokens"], rec["num_heads"] = kd.shape[0], cache.num_kv_heads
    grid = cfg.grid(kd.shape[0], cache.num_kv_heads)
    fn = cfg.compiled.function(cfg.name)
    with (stream or cp.cuda.get_current_stream()):
        fn((grid,), (cfg.threads,), (as_kernel_arg(rec),))
