"""Accepting arrays from users: CuPy, anything with __cuda_array_interface__, DLPack producers
(PyTorch, JAX), all without copies, and the array checks that turn a wrong argument into a clear error.
``cukv.validate`` builds the shared argument checks of every entry point on these."""
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


def _host_tensor(x) -> str | None:
    """What ``x`` is, if it is a host (CPU) array that a DLPack import would copy or refuse; else None."""
    if isinstance(x, np.ndarray):
        return "a NumPy (host) array"
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None and not hasattr(x, "__cuda_array_interface__"):
        try:
            kind = int(dev()[0])
        except Exception:  # noqa: BLE001 - a producer that cannot say: the import decides
            return None
        if kind in (1, 3):  # kDLCPU, kDLCUDAHost
            return f"a host (CPU) {type(x).__module__.split('.')[0]}.{type(x).__name__}"
    return None


def as_device(x, arg: str):
    """Return (cupy_array, dtype_name) without copying.

    bfloat16 arrays from PyTorch/JAX arrive through DLPack; CuPy has no bfloat16 type, so they are viewed
    as uint16 bit patterns and the dtype name travels beside them. A CuPy array of uint16 is taken as
    bfloat16 bits only when the caller says so (``dtype=`` on the op), else it is rejected.
    """
    import cupy as cp

    if isinstance(x, cp.ndarray):
        return x, None
    host = _host_tensor(x)
    if host is not None:
        raise TypeError(f"{arg} is {host}; pass a device array (cupy.asarray({arg}) copies it over; "
                        f"a torch tensor: {arg}.cuda())")
    tname = _torch_dtype_name(x)
    if tname == "bfloat16":
        # DLPack of bf16 is not importable by CuPy: reinterpret the storage as int16 first (no copy)
        import torch  # only reached when the caller passed a torch tensor

        return cp.from_dlpack(x.view(torch.int16)).view(cp.uint16), "bfloat16"
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
