"""Tensor-map (TMA) descriptors for kernels that load cache pages with ``cp.async.bulk.tensor``.

The descriptor is the driver's opaque 128-byte ``CUtensorMap``, encoded on the host by
``cuTensorMapEncodeTiled`` (libcuda through ctypes: CuPy does not wrap it) and passed to the kernel by value as a
``__grid_constant__`` parameter, so a launch captured in a CUDA graph keeps its own copy. Encoding costs a few
microseconds; descriptors are memoized by everything they encode (address, shape, strides, box, swizzle).

Only what the prefill producer needs is here: byte elements (e4m3 codes, or 16-bit values seen as byte pairs), a
cache viewed as the 4-d tensor ``[pages][token][head][dim]`` (innermost first in the driver's order; contiguous
K/V as one page), boxes of one head and ``rows`` tokens of one page, and the 128-byte swizzle or none. Coordinates
outside the tensor read as zeros.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

#: CUtensorMapDataType / CUtensorMapSwizzle / CUtensorMapL2promotion values from cuda.h
UINT8 = 0
SWIZZLE_NONE, SWIZZLE_128B = 0, 3
L2_PROMOTION_NONE, L2_PROMOTION_64B, L2_PROMOTION_128B, L2_PROMOTION_256B = 0, 1, 2, 3
#: the L2 promotion every descriptor is encoded with (read at each encode; benchmarks/probe_mla_tma.py varies it)
L2_PROMOTION = L2_PROMOTION_128B
MAP_BYTES = 128


@functools.lru_cache(maxsize=1)
def _libcuda():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:  # no driver: a machine without a GPU
        raise RuntimeError(f"TMA descriptors need the CUDA driver (libcuda.so.1): {e}") from None
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32),
                   ctypes.POINTER(ctypes.c_uint32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def check_page_tensor(name: str, ptr: int, shape, strides_bytes) -> None:
    """What the driver requires of a byte tensor ``[pages, page_size, heads, dim]`` with a unit dim stride:
    a 16-byte aligned base and token/head/page strides that are multiples of 16 bytes below 2^40."""
    if ptr % 16:
        raise ValueError(f"{name}: base address {ptr:#x} must be 16-byte aligned for tensor copies")
    if strides_bytes[3] != 1:
        raise ValueError(f"{name}: the dim stride must be 1 byte, got {strides_bytes[3]}")
    for s in strides_bytes[:3]:
        if s <= 0 or s % 16 or s >= 1 << 40:
            raise ValueError(f"{name}: strides (bytes) {tuple(strides_bytes)} must be positive multiples of 16 "
                             "below 2^40 for tensor copies")
    if any(int(n) >= 1 << 31 for n in shape):
        raise ValueError(f"{name}: shape {tuple(shape)} exceeds 2^31 in a dimension")


@functools.lru_cache(maxsize=256)
def _encode_cached(ptr: int, shape: tuple, strides: tuple, box_cols: int, box_rows: int, swizzle: int,
                   promotion: int) -> bytes:
    pages, page_size, heads, dim = shape
    gdim = (ctypes.c_uint64 * 4)(dim, heads, page_size, pages)
    gstride = (ctypes.c_uint64 * 3)(strides[2], strides[1], strides[0])  # of dims 1..3 (head, token, page)
    box = (ctypes.c_uint32 * 4)(box_cols, 1, box_rows, 1)
    estr = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    out = (ctypes.c_uint8 * MAP_BYTES)()
    res = _libcuda()(ctypes.cast(out, ctypes.c_void_p), UINT8, 4, ctypes.c_void_p(ptr), gdim, gstride, box, estr,
                     0, swizzle, promotion, 0)
    if res != 0:
        raise ValueError(f"cuTensorMapEncodeTiled returned CUresult {res} for a byte tensor {shape} with strides "
                         f"{strides} (bytes), box {box_cols} x {box_rows} rows, swizzle {swizzle}")
    return bytes(out)


class OnePage:
    """Contiguous ``[tokens, heads, dim]`` bytes seen as one page ``[1, tokens, heads, dim]`` (what encode_pages
    reads: ``shape``, ``strides``, ``data.ptr``)."""

    def __init__(self, arr):
        self.shape = (1,) + tuple(int(n) for n in arr.shape)
        self.strides = (int(arr.shape[0]) * int(arr.strides[0]),) + tuple(int(s) for s in arr.strides)
        self.data = arr.data


def encode_pages(name: str, arr, box_cols: int, box_rows: int, swizzle: int) -> bytes:
    """The descriptor of a byte array ``arr[pages, page_size, heads, dim]`` (CuPy, or contiguous rows in a
    :class:`OnePage`) for boxes of ``box_cols`` dims x ``box_rows`` tokens of one head; ``box_cols`` may exceed
    ``dim`` (the excess reads as zeros)."""
    return encode_bytes(name, int(arr.data.ptr), arr.shape, arr.strides, box_cols, box_rows, swizzle)


def encode_bytes(name: str, ptr: int, shape, strides_bytes, box_cols: int, box_rows: int, swizzle: int) -> bytes:
    """:func:`encode_pages` of the byte tensor ``[pages, page_size, heads, bytes]`` at device address ``ptr`` with
    these strides (bytes): a view no array describes (a column range of cache rows, 16-bit rows seen as bytes)."""
    shape = tuple(int(n) for n in shape)
    strides = tuple(int(s) for s in strides_bytes)
    check_page_tensor(name, int(ptr), shape, strides)
    return _encode_cached(int(ptr), shape, strides, int(box_cols), int(box_rows), int(swizzle), int(L2_PROMOTION))


def as_maps_arg(*maps: bytes):
    """Descriptors back to back as one by-value kernel argument (128-byte entries keep each 64-byte aligned in the
    kernel's struct)."""
    from .operand import as_kernel_arg

    return as_kernel_arg(np.frombuffer(b"".join(maps), np.uint8))
