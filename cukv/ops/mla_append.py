"""append_mla: write new tokens' latent rows (``kv_c[T, 512]`` + ``k_pe[T, 64]``) into an MLA cache's slots,
quantizing for an FP8 cache."""
from __future__ import annotations

import numpy as np

from ..arrays import canonical_kv_dtype
from ..configs.mla_append import APPEND_ARGS, THREADS, MLAAppendConfig
from ..mla_cache import NOPE, ROPE, MLAKVCache
from ..operand import as_kernel_arg, ptr
from ..validate import check_bool, check_device_array, check_slots, checked

FLOAT16 = ("bfloat16", "float16")


def append_mla(cache: MLAKVCache, kv_c, k_pe, slots, *, pow2_scales: bool = False, dtype=None, stream=None,
               check: bool | None = None) -> None:
    """Write ``kv_c[T, 512]`` and ``k_pe[T, 64]`` (bf16 or fp16, rows contiguous, any row stride) into
    ``cache`` at ``slots[T]`` (int32 or int64: ``physical_page * page_size + offset``). A slot of -1, or any
    slot outside the cache, is skipped. A 16-bit cache needs inputs of its own dtype; an FP8 cache
    quantizes (see :func:`cukv.reference.mla_quantize_fp8`; ``pow2_scales`` rounds each scale up to a power
    of two as FlashMLA's quantizer does). ``dtype`` names bf16 when CuPy uint16 arrays carry its bits.
    ``check=True`` (or ``CUKV_CHECK=1``) copies the slots to the host first and refuses a slot outside the
    cache (other than -1) or one written twice.

    Examples
    --------
    >>> import cupy as cp, numpy as np, cukv
    >>> from cukv.dtypes import from_storage, to_storage
    >>> rng = np.random.default_rng(0)
    >>> cache = cukv.MLAKVCache(num_pages=4, page_size=16, dtype="bfloat16", fill="nan")
    >>> kv_c = to_storage(rng.standard_normal((3, 512)), "bfloat16")                 # bf16 bits (uint16)
    >>> k_pe = to_storage(rng.standard_normal((3, 64)), "bfloat16")
    >>> cukv.append_mla(cache, cp.asarray(kv_c), cp.asarray(k_pe), cp.asarray([0, 17, -1]))   # -1: padding
    >>> rows = cache.data.get()                         # uint16 bf16 bits [4, 16, 576]
    >>> bool((rows[0, 0, :512] == kv_c[0]).all() and (rows[1, 1, 512:] == k_pe[1]).all())
    True
    >>> bool(np.isnan(from_storage(rows[0, 1], "bfloat16")).all())     # slot 1 was not written
    True
    """
    import cupy as cp

    pow2_scales, check = check_bool("pow2_scales", pow2_scales), checked(check)
    decl = None if dtype is None else canonical_kv_dtype(dtype, "dtype")
    kc, dt_c = check_device_array("kv_c", kv_c, dtypes=FLOAT16, shape=(None, NOPE), unit_last_stride=True,
                                  declared=decl)
    kp, dt_p = check_device_array("k_pe", k_pe, dtypes=FLOAT16, shape=(None, ROPE), unit_last_stride=True,
                                  declared=decl)
    sl = check_device_array("slots", slots, dtypes=(np.int32, np.int64), ndim=1)
    if not isinstance(cache, MLAKVCache):
        raise TypeError(f"cache must be an MLAKVCache; got {type(cache).__name__}")
    if pow2_scales and not cache.quantized:
        raise ValueError(f"pow2_scales=True applies to an FP8 cache only (this cache is {cache.dtype})")
    if dt_c != dt_p:
        raise TypeError(f"kv_c is {dt_c} and k_pe is {dt_p}; they must match")
    if not cache.quantized and dt_c != cache.dtype:
        raise TypeError(f"kv_c is {dt_c}; this 16-bit cache holds {cache.dtype} (only FP8 caches convert)")
    t = kc.shape[0]
    if kp.shape[0] != t or sl.shape[0] != t:
        raise ValueError(f"kv_c has {t} tokens, k_pe {kp.shape[0]}, slots {sl.shape[0]}; they must agree")
    for n, a in (("kv_c", kc), ("k_pe", kp)):
        if a.strides[0] % a.itemsize or a.strides[0] < 0:
            raise ValueError(f"{n} has row stride {a.strides[0]} bytes; a non-negative multiple of the element size")
    if check:
        check_slots(sl, cache.num_pages * cache.page_size, "slots")
    if t == 0:
        return
    sl64 = sl.astype(cp.int64) if sl.dtype != cp.int64 else cp.ascontiguousarray(sl)
    cfg = MLAAppendConfig(dt_c, cache.quantized, pow2_scales)
    rec = np.zeros((), APPEND_ARGS)
    rec["kv_c"], rec["k_pe"], rec["slots"], rec["cache"] = ptr(kc), ptr(kp), ptr(sl64), cache.ptr
    rec["kv_c_stride"], rec["k_pe_stride"] = kc.strides[0] // kc.itemsize, kp.strides[0] // kp.itemsize
    rec["page_stride"], rec["row_stride"] = cache.page_stride, cache.row_stride
    rec["num_tokens"], rec["num_pages"], rec["page_size"] = t, cache.num_pages, cache.page_size
    fn = cfg.compiled.function(cfg.name)
    with (stream or cp.cuda.get_current_stream()):
        fn((min(t, 65535),), (THREADS,), (as_kernel_arg(rec),))
