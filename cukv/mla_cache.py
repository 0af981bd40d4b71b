"""The MLA latent KV cache (DeepSeek-V2/V3, Kimi K2, GLM): one 576-wide row per token, 512 latent + 64 rope.

Two forms (docs/mla.md, "The cache"):

* 16-bit: ``[pages, page_size, 576]`` bfloat16 or float16;
* FP8: 656 bytes per token, byte-compatible with FlashMLA's and vLLM's ``fp8_ds_mla`` rows: 512 e4m3 latent
  codes, 4 float32 scales (one per 128 latent values), 64 bf16 rope values (not quantized).

:meth:`MLAKVCache.from_arrays` wraps an existing tensor (vLLM, FlashMLA, PyTorch: ``[blocks, page, 1, 576]``,
``[blocks, page, 576]``, ``[blocks, page, 656]`` uint8 or float8) without a copy; page and row strides are
taken from the array, so strided page layouts work, and offsets are 64-bit. :func:`cukv.append_mla`
(:mod:`cukv.ops.mla_append`) writes new tokens into their slots (quantizing for FP8, exactly as
:func:`cukv.reference.mla_quantize_fp8`).
"""
from __future__ import annotations

import numpy as np

from .arrays import canonical_kv_dtype
from .validate import check_choice, check_device_array, check_int, device_array

NOPE, ROPE, DIM = 512, 64, 576
FP8_ROW_BYTES = 656
DTYPES = ("bfloat16", "float16", "fp8_e4m3")


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
    >>> import cupy as cp, numpy as np, cukv
    >>> from cukv import reference
    >>> rng = np.random.default_rng(0)
    >>> cache = cukv.MLAKVCache(num_pages=8, page_size=64, dtype="fp8_e4m3", fill="nan")   # NaN until written
    >>> kv_c, k_pe = rng.standard_normal((3, 512)), rng.standard_normal((3, 64))
    >>> cukv.append_mla(cache, cp.asarray(kv_c, cp.float16), cp.asarray(k_pe, cp.float16), cp.asarray([0, 1, 64]))
    >>> rows = cache.dequantize()                       # float32 [8, 64, 576]
    >>> codes = reference.mla_quantize_fp8(kv_c.astype(np.float16), k_pe.astype(np.float16))   # uint8 [3, 656]
    >>> want = reference.mla_dequantize_fp8(codes).astype(np.float32)
    >>> bool((rows[0, :2].get() == want[:2]).all() and (rows[1, 0].get() == want[2]).all())
    True
    >>> bool(cp.isnan(rows[0, 2]).all())                 # an unwritten slot
    True
    """

    def __init__(self, num_pages: int, page_size: int, dtype="bfloat16", fill=None):
        import cupy as cp

        num_pages = check_int("num_pages", num_pages, 1, (1 << 31) - 1)
        page_size = check_int("page_size", page_size, 1, 1 << 16)
        kind = canonical_kv_dtype(dtype, "dtype")
        check_choice("fill", fill, (None, "zeros", "nan"))
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
        a, declared = device_array("x", _torch_float8_as_uint8(x))
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
            want = None if dtype is None else canonical_kv_dtype(dtype, "dtype")
            if want == "fp8_e4m3":
                raise TypeError(f"dtype={dtype!r} does not match x's {a.dtype} elements (FP8 rows are uint8)")
            a, kind = check_device_array("x", a, dtypes=("bfloat16", "float16"), declared=declared or want)
            if want is not None and kind != want:
                raise TypeError(f"dtype={dtype!r} does not match x's {kind} elements")
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

    def dequantize(self, chunk_bytes: int = 256 << 20):
        """Every row as float32 ``[num_pages, page_size, 576]`` (FP8: ``e4m3(code) * scale``, then the rope). FP8
        rows are converted ``chunk_bytes`` of output at a time, so the temporaries stay that small."""
        import cupy as cp

        d = self.data
        if self.dtype == "float16":
            return d.astype(cp.float32)
        if self.dtype == "bfloat16":
            return (d.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
        from .fp8 import E4M3_VALUES

        chunk_bytes = check_int("chunk_bytes", chunk_bytes, 1)
        table = cp.asarray(E4M3_VALUES.astype(np.float32))
        out = cp.empty((self.num_pages, self.page_size, DIM), cp.float32)
        step = max(1, chunk_bytes // (self.page_size * DIM * 4))  # pages per pass
        for p0 in range(0, self.num_pages, step):
            c = d[p0:p0 + step]
            n = c.shape[0]
            codes = table[c[..., :NOPE]].reshape(n, self.page_size, 4, 128)
            scales = cp.ascontiguousarray(c[..., NOPE:NOPE + 16]).view(cp.float32)
            out[p0:p0 + n, :, :NOPE] = (codes * scales[..., None]).reshape(n, self.page_size, NOPE)
            rope = cp.ascontiguousarray(c[..., NOPE + 16:]).view(cp.uint16)
            out[p0:p0 + n, :, NOPE:] = (rope.astype(cp.uint32) << 16).view(cp.float32)
        return out
