"""bfloat16 on the host: CuPy and NumPy have no bfloat16, so cukv stores bf16 as uint16 bit patterns.

Examples
--------
>>> import numpy as np
>>> from cukv.dtypes import from_storage, to_storage
>>> bits = to_storage(np.array([1.0, 0.1, -3.14159, np.nan]), "bfloat16")    # round to nearest even
>>> bits.dtype, bits.tolist()
(dtype('uint16'), [16256, 15821, 49225, 32704])
>>> from_storage(bits, "bfloat16").tolist()                                   # float64 values again
[1.0, 0.10009765625, -3.140625, nan]
"""
from __future__ import annotations

import numpy as np


def bf16_bits(x, xp=np):
    """float array -> uint16 bf16 bits, rounding to nearest even (NaN stays NaN). ``xp`` is the array
    module (NumPy, or CuPy for device arrays)."""
    f = xp.asarray(x, dtype=xp.float32)
    if f.ndim:  # C order, as kernels take it (ascontiguousarray alone would make a 0-d input 1-d)
        f = xp.ascontiguousarray(f)
    u = f.view(xp.uint32).astype(xp.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(xp.uint16)
    return xp.where(xp.isnan(f), xp.uint16(0x7FC0), rounded)


def bf16_to_float(bits) -> np.ndarray:
    b = np.asarray(bits, dtype=np.uint16)
    b = np.ascontiguousarray(b) if b.ndim else b
    return (b.astype(np.uint32) << 16).view(np.float32)


def to_storage(x, dtype: str) -> np.ndarray:
    """float host array -> the host array cukv stores for dtype ('float16' or 'bfloat16')."""
    return bf16_bits(x) if dtype == "bfloat16" else np.asarray(x, dtype=np.float16)


def from_storage(x, dtype: str) -> np.ndarray:
    """stored host array -> float64 values."""
    x = np.asarray(x)
    return (bf16_to_float(x) if dtype == "bfloat16" else x.astype(np.float32)).astype(np.float64)


def storage_dtype(dtype: str):
    return {"bfloat16": np.uint16, "fp8_e4m3": np.uint8}.get(dtype, np.float16)


def nan_bits(dtype: str):
    """A NaN in storage form, for poisoning buffers."""
    return {"bfloat16": np.uint16(0x7FC0), "fp8_e4m3": np.uint8(0x7F)}.get(dtype, np.float16(np.nan))
