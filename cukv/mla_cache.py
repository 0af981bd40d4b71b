"""The MLA latent KV cache (DeepSeek-V2/V3, Kimi K2, GLM): one 576-wide row per token, 512 latent + 64 rope.

Two forms (design.md, "MLA cache"):

* 16-bit: ``[pages, page_size, 576]`` bfloat16 or float16;
* FP8: 656 bytes per token, byte-compatible with FlashMLA's and vLLM's ``fp8_ds_mla`` rows: 512 e4m3 latent
  codes, 4 float32 scales (one per 128 latent values), 64 bf16 rope values (not quantized).

:meth:`MLAKVCache.from_arrays` wraps an existing tensor (vLLM, FlashMLA, PyTorch: ``[blocks, page, 1, 576]``,
``[blocks, page, 576]``, ``[blocks, page, 656]`` uint8 or float8) without a copy; page and row strides are
taken from the array, so strided page layouts work, and offsets are 64-bit. :func:`append_mla` writes new
tokens into their slots (quantizing for FP8, exactly as :func:`cukv.reference.mla_quantize_fp8`).
"""
from __future__ import annotations

import dataclasses
from functools import cached_property

import numpy as np

from . import compiler
from .arrays import as_device, canonical_kv_dtype
from .configs.checks import CTYPES, SHORT, check_bool, check_in

NOPE, ROPE, DIM = 512, 64, 576
FP8_ROW_BYTES = 656
DTYPES = ("bfloat16", "float16", "fp8_e4m3")

# the kernel's by-value argument (templates/mla_append.cuh MLAAppendArgs)
APPEND_ARGS = np.dtype([("kv_c", "<u8"), ("k_pe", "<u8"), ("slots", "<u8"), ("cache", "<u8"),
                        ("kv_c_stride", "<i8"), ("k_pe_stride", "<i8"), ("page_stride", "<i8"),
                        ("row_stride", "<i8"), ("num_tokens", "<i4"), ("num_pages", "<i4"),
                        ("page_size", "<i4"), ("pad", "<i4")])


# -- argument checks (local until cukv/validate.py lands; same names) -----------------------------------
def check_int(name: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}={value!r} must be an integer")
    if value < lo or (hi is not None and value > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}={value!r} is out of range; accepted: {rng}")
    return int(value)


def check_device_array(name: str, x, *, ndim: int | None = None, dtypes=None, last: int | None = None):
    """A device array (CuPy, DLPack, __cuda_array_interface__) as ``(cupy_array, declared_dtype)``."""
    a, declared = as_device(x, name)
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} has shape {tuple(a.shape)} ({a.ndim} dimensions); expected {ndim}")
    if last is not None and a.shape[-1] != last:
        raise ValueError(f"{name} has shape {tuple(a.shape)}; its last dimension must be {last}")
    if dtypes is not None and str(a.dtype) not in dtypes:
        raise TypeError(f"{name} has dtype {a.dtype}; accepted: {', '.join(dtypes)}")
    return a, declared


def _float16_kind(a, declared, name: str) -> str:
    if declared:
        return declared
    if str(a.dtype) == "float16":
        return "float16"
    if str(a.dtype) == "uint16":
        return "bfloat16"
    raise TypeError(f"{name} has dtype {a.dtype}; accepted: float16, or bfloat16 (a torch/JAX bf16 tensor or "
                    "CuPy uint16 holding bf16 bits)")


def _torch_float8_as_uint8(x):
    """torch float8 tensors cross DLPack as uint8 bytes (a view, no copy)."""
    if str(getattr(x, "dtype", "")).startswith("torch.float8"):
        import torch

        return x.view(torch.uint8)
    return x


class MLAKVCache:
    """A paged MLA latent cache.

    Parameters
    ----------
    num_pages, page_size : int
        Pages of ``page_size`` tokens (any size from 1; FlashMLA needs 64, vLLM defaults to 16).
    dtype : {'bfloat16', 'float16', 'fp8_e4m3'}
        16-bit rows of 576 values, or 656-byte FP8 rows.
    fill : {None, 'zeros', 'nan'}
        Initial bytes (None leaves the memory as allocated).

    Attributes: ``data`` (the array), ``dtype``, ``num_pages``, ``page_size``, ``page_stride`` and
    ``row_stride`` (bytes), ``row_bytes`` (1152 or 656), ``ptr`` (device address of page 0, token 0).

    Examples
    --------
    >>> import cupy as cp, cukv                                                     # doctest: +SKIP
    >>> cache = cukv.MLAKVCache(num_pages=8, page_size=64, dtype="fp8_e4m3", fill="zeros")
    >>> kv_c = cp.random.randn(3, 512).astype(cp.float16); k_pe = cp.random.randn(3, 64).astype(cp.float16)
    >>> cukv.append_mla(cache, kv_c, k_pe, cp.asarray([0, 1, 64]))
    >>> rows = cache.dequantize()                       # float32 [8, 64, 576]
    """

    def __init__(self, num_pages: int, page_size: int, dtype="bfloat16", fill=None):
        import cupy as cp

        num_pages = check_int("num_pages", num_pages, 1, (1 << 31) - 1)
        page_size = check_int("page_size", page_size, 1, 1 << 16)
        kind = canonical_kv_dtype(dtype, "dtype")
        if fill not in (None, "zeros", "nan"):
            raise ValueError(f"fill={fill!r} is not valid; accepted: None, 'zeros', 'nan'")
        if kind == "fp8_e4m3":
            data = cp.empty((num_pages, page_size, FP8_ROW_BYTES), cp.uint8)
            if fill:
                data.fill(0 if fill == "zeros" else 0xFF)  # 0xff bytes: NaN codes, NaN scales and rope
        else:
            data = cp.empty((num_pages, page_size, DIM), cp.uint16 if kind == "bfloat16" else cp.float16)
            if fill == "zeros":
                data.fill(0)
            elif fill == "nan":
                data.view(cp.uint16).fill(0x7FC0 if kind == "bfloat16" else 0x7E00)
        self._set(data, kind)

    def _set(self, data, kind: str) -> None:
        self.data, self.dtype = data, kind
        self.num_pages, self.page_size = int(data.shape[0]), int(data.shape[1])
        self.page_stride, self.row_stride = int(data.strides[0]), int(data.strides[1])
        self.row_bytes = FP8_ROW_BYTES if kind == "fp8_e4m3" else 2 * DIM
        self.ptr = int(data.data.ptr)

    @property
    def quantized(self) -> bool:
        return self.dtype == "fp8_e4m3"

    @classmethod
    def from_arrays(cls, x, dtype=None) -> "MLAKVCache":
        """Wrap an existing cache without copying: ``[blocks, page, 576]`` or ``[blocks, page, 1, 576]``
        (bf16/fp16; a CuPy uint16 array is read as bf16 bits), or ``[blocks, page, 656]`` /
        ``[blocks, page, 1, 656]`` uint8 or float8 (FP8 rows). Pages and rows may be strided (16-byte
        multiples); each row's bytes must be contiguous."""
        a, declared = check_device_array("x", _torch_float8_as_uint8(x))
        if a.ndim == 4:
            if a.shape[2] != 1:
                raise ValueError(f"x has shape {tuple(a.shape)}; a 4-d cache must be [blocks, page, 1, 576 or 656]")
            a = a[:, :, 0]
        if a.ndim != 3:
            raise ValueError(f"x has shape {tuple(a.shape)}; expected [blocks, page, 576], [blocks, page, 656] "
                             "or either with a head dimension of 1")
        if str(a.dtype) == "uint8":
            kind = "fp8_e4m3"
            if dtype is not None and canonical_kv_dtype(dtype, "dtype") != kind:
                raise TypeError(f"dtype={dtype!r} does not match x's uint8 rows (FP8); pass dtype=None or 'fp8_e4m3'")
            if a.shape[2] != FP8_ROW_BYTES:
                raise ValueError(f"x has {a.shape[2]}-byte rows; FP8 MLA rows are {FP8_ROW_BYTES} bytes "
                                 "(512 e4m3 codes, 4 float32 scales, 64 bf16 rope values)")
        else:
            kind = _float16_kind(a, declared or (None if dtype is None else canonical_kv_dtype(dtype, "dtype")), "x")
            if kind not in ("bfloat16", "float16"):
                raise TypeError(f"dtype={dtype!r} does not match x's 16-bit elements")
            if a.shape[2] != DIM:
                raise ValueError(f"x has rows of {a.shape[2]} values; MLA rows are {DIM} (512 latent + 64 rope)")
        if a.strides[2] != a.itemsize:
            raise ValueError(f"x's rows must be contiguous (last stride {a.strides[2]} bytes, element {a.itemsize})")
        for n, v in (("page stride", a.strides[0]), ("row stride", a.strides[1]), ("address", int(a.data.ptr))):
            if v % 16 or v < 0:
                raise ValueError(f"x's {n} is {v} bytes; it must be a non-negative multiple of 16")
        cache = cls.__new__(cls)
        cache._set(a, kind)
        return cache

    def row_span(self) -> tuple[int, int]:
        """The lowest and one-past-highest byte any row of the cache touches (relative to ``ptr``)."""
        last = (self.num_pages - 1) * self.page_stride + (self.page_size - 1) * self.row_stride
        return 0, last + self.row_bytes

    def dequantize(self):
        """Every row as float32 ``[num_pages, page_size, 576]`` (FP8: ``e4m3(code) * scale``, then the rope)."""
        import cupy as cp

        d = self.data
        if self.dtype == "float16":
            return d.astype(cp.float32)
        if self.dtype == "bfloat16":
            return (d.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
        from .fp8 import E4M3_VALUES

        table = cp.asarray(E4M3_VALUES.astype(np.float32))
        codes = table[d[..., :NOPE]].reshape(d.shape[0], d.shape[1], 4, 128)
        scales = cp.ascontiguousarray(d[..., NOPE:NOPE + 16]).view(cp.float32)
        rope = (cp.ascontiguousarray(d[..., NOPE + 16:]).view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
        return cp.concatenate([(codes * scales[..., None]).reshape(d.shape[0], d.shape[1], NOPE), rope], axis=-1)


@dataclasses.dataclass(frozen=True)
class MLAAppendConfig:
    """Template parameters of the MLA append kernel."""

    #: element type of kv_c and k_pe
    dtype: str = "bfloat16"
    #: write 656-byte FP8 rows (else 16-bit rows of ``dtype``)
    fp8: bool = False
    #: FP8: round each scale up to a power of two (FlashMLA's quantizer)
    pow2_scales: bool = False

    def __post_init__(self):
        check_in("MLAAppendConfig", "dtype", self.dtype, tuple(CTYPES))
        check_bool("MLAAppendConfig", "fp8", self.fp8)
        check_bool("MLAAppendConfig", "pow2_scales", self.pow2_scales)
        if self.pow2_scales and not self.fp8:
            raise ValueError("MLAAppendConfig.pow2_scales=True is not valid: applies to FP8 rows only (fp8=True)")

    @property
    def name(self) -> str:
        kind = ("_e4m3" + ("_pow2" if self.pow2_scales else "")) if self.fp8 else ""
        return f"cukv_mla_append_{SHORT[self.dtype]}{kind}"

    def render(self) -> str:
        return compiler.render("mla_append.cu.j2", name=self.name, ctype=CTYPES[self.dtype], fp8=self.fp8,
                               pow2=self.pow2_scales, args_bytes=APPEND_ARGS.itemsize)

    @cached_property
    def compiled(self) -> compiler.CompiledModule:
        return compiler.compile_source(self.name, self.render())


def append_mla(cache: MLAKVCache, kv_c, k_pe, slots, *, pow2_scales: bool = False, dtype=None, stream=None):
    """Write ``kv_c[T, 512]`` and ``k_pe[T, 64]`` (bf16 or fp16, rows contiguous, any row stride) into
    ``cache`` at ``slots[T]`` (int32 or int64: ``physical_page * page_size + offset``). A slot of -1, or any
    slot outside the cache, is skipped. A 16-bit cache needs inputs of its own dtype; an FP8 cache
    quantizes (see :func:`cukv.reference.mla_quantize_fp8`; ``pow2_scales`` rounds each scale up to a power
    of two as FlashMLA's quantizer does). ``dtype`` names bf16 when CuPy uint16 arrays carry its bits."""
    import cupy as cp

    if not isinstance(cache, MLAKVCache):
        raise TypeError(f"cache must be an MLAKVCache; got {type(cache).__name__}")
    if not isinstance(pow2_scales, (bool, np.bool_)):
        raise TypeError(f"pow2_scales={pow2_scales!r} must be True or False")
    if pow2_scales and not cache.quantized:
        raise ValueError("pow2_scales=True applies to an FP8 cache only (this cache is " + cache.dtype + ")")
    kc, kcd = check_device_array("kv_c", kv_c, ndim=2, last=NOPE)
    kp, kpd = check_device_array("k_pe", k_pe, ndim=2, last=ROPE)
    decl = None if dtype is None else canonical_kv_dtype(dtype, "dtype")
    dt_c = _float16_kind(kc, kcd or decl, "kv_c")
    dt_p = _float16_kind(kp, kpd or decl, "k_pe")
    if dt_c != dt_p:
        raise TypeError(f"kv_c is {dt_c} and k_pe is {dt_p}; they must match")
    if not cache.quantized and dt_c != cache.dtype:
        raise TypeError(f"kv_c is {dt_c}; this 16-bit cache holds {cache.dtype} (only FP8 caches convert)")
    sl, _ = check_device_array("slots", slots, ndim=1, dtypes=("int32", "int64"))
    t = kc.shape[0]
    if kp.shape[0] != t or sl.shape[0] != t:
        raise ValueError(f"kv_c has {t} tokens, k_pe {kp.shape[0]}, slots {sl.shape[0]}; they must agree")
    for n, a in (("kv_c", kc), ("k_pe", kp)):
        if a.strides[1] != a.itemsize:
            raise ValueError(f"{n}'s rows must be contiguous (last stride {a.strides[1]} bytes)")
        if a.strides[0] % a.itemsize or a.strides[0] < 0:
            raise ValueError(f"{n} has row stride {a.strides[0]} bytes; a non-negative multiple of the element size")
    if t == 0:
        return cache
    sl64 = sl.astype(cp.int64) if sl.dtype != cp.int64 else cp.ascontiguousarray(sl)
    cfg = MLAAppendConfig(dt_c, cache.quantized, bool(pow2_scales))
    rec = np.zeros((), APPEND_ARGS)
    rec["kv_c"], rec["k_pe"], rec["slots"], rec["cache"] = kc.data.ptr, kp.data.ptr, sl64.data.ptr, cache.ptr
    rec["kv_c_stride"], rec["k_pe_stride"] = kc.strides[0] // kc.itemsize, kp.strides[0] // kp.itemsize
    rec["page_stride"], rec["row_stride"] = cache.page_stride, cache.row_stride
    rec["num_tokens"], rec["num_pages"], rec["page_size"] = t, cache.num_pages, cache.page_size
    raw = rec.tobytes()
    arg = np.frombuffer(raw, dtype=np.dtype((np.void, len(raw))))[0]
    fn = cfg.compiled.function(cfg.name)
    with (stream or cp.cuda.get_current_stream()):
        fn((min(t, 65535),), (128,), (arg,))
    return cache
