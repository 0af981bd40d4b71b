"""append_kv: write new tokens' K and V into their cache slots."""
from __future__ import annotations

import dataclasses
from functools import cached_property

import numpy as np

from . import compiler
from .arrays import as_device, check_contiguous, element_dtype
from .config import CTYPES, SHORT, check_in, check_kv_quant, check_range
from .operand import APPEND_ARGS, as_kernel_arg, kv_params, ptr


@dataclasses.dataclass(frozen=True)
class AppendConfig:
    """Template parameters of the append kernel."""

    dtype: str = "bfloat16"
    head_dim: int = 128
    page_size: int = 16
    threads: int = 256
    #: cache element type: None (same as ``dtype``) or 'fp8_e4m3' (quantizing append)
    kv_dtype: str | None = None
    #: FP8 only: dims per scale (the head dim for per-token scales), 0 for the caller's per-tensor scales
    scale_block: int = 0

    def __post_init__(self):
        check_in("AppendConfig", "dtype", self.dtype, tuple(CTYPES))
        check_kv_quant("AppendConfig", self.kv_dtype, self.scale_block, self.head_dim)
        if self.kv_dtype is not None and self.head_dim % 16:
            raise ValueError(f"AppendConfig.head_dim={self.head_dim} is not valid: must be a multiple of 16 for an "
                             "FP8 cache")
        check_range("AppendConfig", "head_dim", self.head_dim, 8, 1024)
        if self.head_dim % 8:
            raise ValueError(f"AppendConfig.head_dim={self.head_dim} is not valid: must be a multiple of 8")
        check_range("AppendConfig", "page_size", self.page_size, 1, 1 << 16)
        check_in("AppendConfig", "threads", self.threads, (128, 256, 512))

    @property
    def quantized(self) -> bool:
        return self.kv_dtype is not None

    @property
    def name(self) -> str:
        q = f"_e4m3s{self.scale_block}" if self.quantized else ""
        return f"cukv_append_{SHORT[self.dtype]}{q}_d{self.head_dim}_p{self.page_size}"

    def grid(self, num_tokens: int, num_heads: int) -> int:
        """Blocks to launch: a thread per 16-byte vector, or a warp per (token, head) row when quantizing."""
        work = num_tokens * num_heads * (32 if self.quantized else self.head_dim // 8)
        return max(1, min((work + self.threads - 1) // self.threads, 65535))

    def render(self) -> str:
        return compiler.render("append.cu.j2", name=self.name, ctype=CTYPES[self.dtype], page_size=self.page_size,
                               head_dim=self.head_dim, threads=self.threads, args_bytes=APPEND_ARGS.itemsize,
                               quantized=self.quantized, scale_block=self.scale_block)

    @cached_property
    def compiled(self) -> compiler.CompiledModule:
        return compiler.compile_source(self.name, self.render())


def append_kv(cache, k_new, v_new, slot_mapping, *, stream=None) -> None:
    """Write ``k_new``/``v_new`` ``[tokens, num_kv_heads, head_dim]`` into ``cache`` at ``slot_mapping[tokens]``.

    An FP8 cache quantizes on the way in (``k_new``/``v_new`` in bf16 or fp16): each granule's scale is
    ``max(amax, 448 * 2**-32) / 448`` and each code ``e4m3(x / scale)`` (round to nearest even, saturating),
    bit-identical to :func:`cukv.fp8.quantize`; per-tensor caches divide by the scales the caller set with
    :meth:`PagedKVCache.set_tensor_scales` (read on the device, so graph replays see updates).

    ``slot = physical_page * page_size + offset``; a slot of -1 (or any slot outside the cache) is skipped,
    so padding tokens and a bad mapping never write outside the cache. Graph-capturable when
    ``slot_mapping`` is an int64 device array.

    Examples
    --------
    >>> import cupy as cp, cukv                                                     # doctest: +SKIP
    >>> cache = cukv.PagedKVCache(num_pages=8, page_size=4, num_kv_heads=2, head_dim=64, dtype="float16")
    >>> seqs = cukv.SequenceTable(cache, max_batch=1, max_pages_per_seq=8)
    >>> slots = cp.asarray(seqs.extend([6]))       # 6 tokens -> 2 pages
    >>> k = cp.random.randn(6, 2, 64).astype(cp.float16); v = k.copy()
    >>> cukv.append_kv(cache, k, v, slots)
    """
    import cupy as cp

    kd, kdt = as_device(k_new, "k_new")
    vd, vdt = as_device(v_new, "v_new")
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
