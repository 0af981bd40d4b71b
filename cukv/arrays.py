"""Accepting arrays from users: CuPy, anything with __cuda_array_interface__, DLPack producers
(PyTorch, JAX), all without copies, and the checks that turn a wrong argument into a clear error."""
from __future__ import annotations

import numpy as np

#: dtype names users may pass, mapped to the template's element type and NumPy/CuPy dtype
DTYPES = {
    "float16": ("half", np.dtype(np.float16)),
    "bfloat16": ("bf16", None),  # CuPy has no bfloat16: stored as uint16 bits, see as_device
}
DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "float16": "float16",
                 "bf16": "bfloat16", "bfloat16": "bfloat16"}


def canonical_dtype(dtype, arg: str = "dtype") -> str:
    """Map a user's dtype (string, NumPy dtype, torch dtype) to 'float16' or 'bfloat16'."""
    try:
        name = np.dtype(dtype).name  # NumPy/CuPy dtypes and scalar types (np.float16)
    except TypeError:
        name = getattr(dtype, "name", None) or str(dtype)
    name = str(name).replace("torch.", "")
    if name in DTYPE_ALIASES:
        return DTYPE_ALIASES[name]
    raise TypeError(f"{arg}={dtype!r} is not supported; accepted: 'float16' or 'bfloat16'")


KV_DTYPE_ALIASES = {"fp8_e4m3": "fp8_e4m3", "fp8": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "e4m3": "fp8_e4m3"}


def canonical_kv_dtype(dtype, arg: str = "dtype") -> str:
    """A cache's element type: 'float16', 'bfloat16' or 'fp8_e4m3' (aliases 'fp8', 'e4m3', 'float8_e4m3fn')."""
    name = str(getattr(dtype, "name", None) or dtype).replace("torch.", "")
    if name in KV_DTYPE_ALIASES:
        return KV_DTYPE_ALIASES[name]
    try:
        return canonical_dtype(dtype, arg)
    except TypeError:
        raise TypeError(f"{arg}={dtype!r} is not supported; accepted: 'float16', 'bfloat16' or 'fp8_e4m3'") from None


def _torch_dtype_name(x) -> str | None:
    dt = getattr(x, "dtype", None)
    s = str(dt)
    return s.replace("torch.", "") if s.startswith("torch.") else None


def as_device(x, arg: str):
    """Return (cupy_array, dtype_name) without copying.

    bfloat16 arrays from PyTorch/JAX arrive through DLPack; CuPy has no bfloat16 type, so they are viewed
    as uint16 bit patterns and the dtype name travels beside them. A CuPy array of uint16 is taken as
    bfloat16 bits only when the caller says so (``dtype=`` on the op), else it is rejected.
    """
    import cupy as cp

    if isinstance(x, cp.ndarray):
        return x, None
    tname = _torch_dtype_name(x)
    if tname == "bfloat16":
        # DLPack of bf16 is not importable by CuPy: reinterpret the storage as int16 first (no copy)
        import torch  # only reached when the caller passed a torch tensor

        return cp.from_dlpack(x.view(torch.int16)).view(cp.uint16), "bfloat16"
    if isinstance(x, np.ndarray):
        raise TypeError(f"{arg} is a NumPy (host) array; pass a device array (cupy.asarray({arg}) copies it over)")
    if hasattr(x, "__cuda_array_interface__"):
        return cp.asarray(x), None
    if hasattr(x, "__dlpack__"):
        try:
            return cp.from_dlpack(x), None
        except Exception as e:  # noqa: BLE001
            raise TypeError(f"{arg}: could not import {type(x).__name__} through DLPack without a copy: {e}") from e
    raise TypeError(f"{arg} must be a CuPy array, a DLPack producer or expose __cuda_array_interface__; "
                    f"got {type(x).__name__}")


def element_dtype(a, declared: str | None, arg: str) -> str:
    """The float dtype name of a device array (uint16 means bf16 bits)."""
    import cupy as cp

    if declared:
        return declared
    if a.dtype == cp.float16:
        return "float16"
    if a.dtype == cp.uint16:
        return "bfloat16"
    raise TypeError(f"{arg} has dtype {a.dtype}; accepted: float16, or bfloat16 (as a torch/JAX bf16 tensor "
                    "or CuPy uint16 holding bf16 bits)")


def check_shape(a, shape: tuple, arg: str) -> None:
    """shape entries may be None (any size)."""
    ok = a.ndim == len(shape) and all(s is None or s == d for s, d in zip(shape, a.shape))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{arg} has shape {tuple(a.shape)}; expected {want}")


def check_int_array(a, arg: str, ndim: int) -> None:
    import cupy as cp

    if a.dtype != cp.int32:
        raise TypeError(f"{arg} has dtype {a.dtype}; expected int32")
    if a.ndim != ndim:
        raise ValueError(f"{arg} has {a.ndim} dimensions (shape {tuple(a.shape)}); expected {ndim}")


def check_contiguous(a, arg: str) -> None:
    if not a.flags.c_contiguous:
        raise ValueError(f"{arg} must be C-contiguous (strides {a.strides}); use cupy.ascontiguousarray({arg})")


def check_aligned(a, arg: str, nbytes: int) -> None:
    """Kernels load and store with vector instructions: a view that starts mid-vector (a DLPack tensor with an
    odd storage offset) would fault on the device, so it is refused here."""
    addr = int(a.data.ptr)
    if addr % nbytes:
        raise ValueError(f"{arg} starts at device address {addr:#x}, which is not {nbytes}-byte aligned; pass an "
                         f"array whose data starts on a {nbytes}-byte boundary (e.g. cupy.ascontiguousarray of a copy)")


def elem_strides(a) -> tuple[int, ...]:
    return tuple(s // a.itemsize for s in a.strides)


def attention_outputs(like, out, lse, rows: int, heads: int, return_lse: bool, sink, softcap):
    """The optional arguments every attention ``run`` shares, checked and allocated in one place: ``out``
    (like the query), ``lse[rows, heads]`` float32, ``sink[heads]`` float32 and ``softcap > 0``."""
    import cupy as cp

    if out is None:
        out = cp.empty(like.shape, like.dtype)
    else:
        out, _ = as_device(out, "out")
        if out.shape != like.shape or out.dtype != like.dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous {like.dtype} array of shape {tuple(like.shape)}")
    if lse is None and return_lse:
        lse = cp.empty((rows, heads), cp.float32)
    elif lse is not None:
        lse, _ = as_device(lse, "lse")
        if lse.shape != (rows, heads) or lse.dtype != cp.float32 or not lse.flags.c_contiguous:
            raise ValueError(f"lse must be a contiguous float32 array of shape ({rows}, {heads})")
    if sink is not None:
        sink, _ = as_device(sink, "sink")
        if sink.shape != (heads,) or sink.dtype != cp.float32:
            raise ValueError(f"sink must be float32 of shape ({heads},); got {sink.dtype} {tuple(sink.shape)}")
    if softcap is not None and not (float(softcap) > 0):
        raise ValueError(f"softcap={softcap!r} must be > 0 (or None for no soft-cap)")
    return out, lse, sink


def host_ints(x, name):
    """``x`` (host or device, any integer dtype) as a host int64 array; TypeError naming ``name`` otherwise."""
    if hasattr(x, "get"):
        x = x.get()
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array (host), got dtype {a.dtype}")
    return a.astype(np.int64)
