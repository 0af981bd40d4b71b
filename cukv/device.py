"""What GPU (if any) this process can use. Never raises: callers decide what a missing GPU means."""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=None)
def gpu_capability() -> tuple[int, int] | None:
    """(major, minor) compute capability of the current device, or None without a usable GPU."""
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            return None
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        return int(props["major"]), int(props["minor"])
    except Exception:  # noqa: BLE001 - no driver, no device, no cupy: all mean "no GPU"
        return None


def has_gpu() -> bool:
    return gpu_capability() is not None


@lru_cache(maxsize=None)
def sm_count() -> int:
    """Multiprocessor count of the current device (132 on an H100 SXM when there is none to ask)."""
    try:
        import cupy as cp

        return int(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"])
    except Exception:  # noqa: BLE001
        return 132


def require_gpu(what: str) -> None:
    from .errors import NoGPUError

    if not has_gpu():
        raise NoGPUError(f"{what} needs a CUDA GPU and this process sees none (see `python -m cukv doctor`)")
