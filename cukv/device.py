"""What GPUs (if any) this process can use. Never raises: callers decide what a missing GPU means.

Per-device facts (capability, SM count) are asked of the current device unless a device id is given, and
remembered per device id, so a host whose GPUs differ gets each one's own answer.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache


def device_count() -> int:
    """How many CUDA devices this process sees (0 without a driver or CuPy)."""
    try:
        import cupy as cp

        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no driver, no device, no cupy: all mean "no GPU"
        return 0


def current_device() -> int | None:
    """The current CUDA device id, or None without a usable GPU."""
    try:
        import cupy as cp

        return int(cp.cuda.runtime.getDevice())
    except Exception:  # noqa: BLE001
        return None


def device_name(device: int | None = None) -> str | None:
    """The name of ``device`` (``cudaDeviceProp.name``; default: the current one), e.g. ``"NVIDIA H200"``, or None
    without a usable GPU. Never raises."""
    dev = current_device() if device is None else int(device)
    return None if dev is None or not has_gpu() else _device_name(dev)


def _name(props) -> str:
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


@lru_cache(maxsize=None)
def _device_name(dev: int) -> str | None:
    try:
        import cupy as cp

        return _name(cp.cuda.runtime.getDeviceProperties(dev))
    except Exception:  # noqa: BLE001
        return None


def gpu_capability(device: int | None = None) -> tuple[int, int] | None:
    """(major, minor) compute capability of ``device`` (default: the current one), or None without a usable GPU."""
    dev = current_device() if device is None else int(device)
    return None if dev is None else _capability(dev)


@lru_cache(maxsize=None)
def _capability(dev: int) -> tuple[int, int] | None:
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() <= dev:
            return None
        props = cp.cuda.runtime.getDeviceProperties(dev)
        return int(props["major"]), int(props["minor"])
    except Exception:  # noqa: BLE001
        return None


def has_gpu() -> bool:
    return gpu_capability() is not None


def sm_count(device: int | None = None) -> int:
    """Multiprocessor count of ``device`` (default: the current one; 132, an H100 SXM's, when there is none)."""
    dev = current_device() if device is None else int(device)
    return 132 if dev is None else _sm_count(dev)


@lru_cache(maxsize=None)
def _sm_count(dev: int) -> int:
    try:
        import cupy as cp

        return int(cp.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"])
    except Exception:  # noqa: BLE001
        return 132


@dataclasses.dataclass(frozen=True)
class GPU:
    """One visible device, as ``python -m cukv doctor`` lists it."""

    id: int
    name: str
    capability: tuple[int, int]
    sm_count: int
    memory_gib: float


def gpus() -> list[GPU]:
    """Every device this process sees (``CUDA_VISIBLE_DEVICES`` applied), in id order; [] without a GPU."""
    out = []
    for dev in range(device_count()):
        try:
            import cupy as cp

            p = cp.cuda.runtime.getDeviceProperties(dev)
            out.append(GPU(dev, _name(p), (int(p["major"]), int(p["minor"])), int(p["multiProcessorCount"]),
                           p["totalGlobalMem"] / 2**30))
        except Exception:  # noqa: BLE001 - a device that cannot be queried is left out
            continue
    return out


def require_gpu(what: str) -> None:
    from .errors import NoGPUError

    if not has_gpu():
        raise NoGPUError(f"{what} needs a CUDA GPU and this process sees none (see `python -m cukv doctor`)")


def check_same_device(what: str, planned: int | None) -> None:
    """Raise if the current device is not ``planned``, the one ``what`` allocated its buffers on at plan time."""
    if planned is None:
        return
    now = current_device()
    if now is not None and now != planned:
        from .errors import DeviceMismatchError

        raise DeviceMismatchError(
            f"{what} was planned on device {planned} and is run on device {now}; its plan-time buffers live on "
            f"device {planned}: run it under `with cupy.cuda.Device({planned}):`, or plan a separate object on "
            f"device {now}")
