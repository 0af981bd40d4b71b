"""Exceptions that carry what a user needs to act on them."""
from __future__ import annotations


class CukvError(Exception):
    """Base class of cukv's own errors."""


class CompileError(CukvError):
    """NVRTC rejected a rendered kernel.

    Attributes
    ----------
    name : str
        The kernel's readable name.
    log : str
        The NVRTC log.
    source : str
        The rendered source, with line numbers, so the log's line references can be read directly.

    Examples
    --------
    >>> from cukv import CompileError, compiler
    >>> try:
    ...     compiler.compile_source("cukv_broken", 'extern "C" __global__ void cukv_broken() { undefined_fn(); }')
    ... except CompileError as e:
    ...     print(e.log.splitlines()[0])
    ...     print(e.source)
    cukv_broken.cu(1): error: identifier "undefined_fn" is undefined
        1  extern "C" __global__ void cukv_broken() { undefined_fn(); }
    """

    def __init__(self, name: str, log: str, source: str):
        self.name = name
        self.log = log
        self._raw_source = source
        self.source = "\n".join(f"{i + 1:5d}  {line}" for i, line in enumerate(source.splitlines()))
        super().__init__(
            f"NVRTC failed to compile {name}:\n{log.strip()}\n"
            "(set CUKV_DUMP_SOURCE=DIR to write the source and its headers to DIR; "
            "the numbered source is in this exception's .source)"
        )

    def __reduce__(self):
        # picklable with its arguments, so `python -m cukv compile --jobs N` workers report the NVRTC log instead
        # of a broken process pool
        return (CompileError, (self.name, self.log, self._raw_source))


class CompileForbidden(CukvError):
    """CUKV_NO_COMPILE is set and a kernel was missing from the disk cache."""


class NoGPUError(CukvError):
    """The operation needs a CUDA GPU and none is usable."""


class DeviceMismatchError(CukvError, ValueError):
    """An op object planned on one GPU was run on another (its plan-time buffers live on the first)."""


class NotPlannedError(CukvError, RuntimeError):
    """``run`` was called on a plan/run object before ``plan``."""
