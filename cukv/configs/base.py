"""The shared base of every kernel config: a frozen dataclass names its kernel and its template's parameters;
the base renders the template and compiles it (once per config object)."""
from __future__ import annotations

from functools import cached_property

from .. import compiler


class KernelConfig:
    """Mixin of the frozen kernel-config dataclasses. A config supplies ``template`` (a ``templates/*.cu.j2`` name),
    ``name`` (the kernel's entry symbol, unique per config) and ``render_params()`` (the template's parameters);
    the base owns ``render()`` and ``compiled``."""

    template: str = ""

    @property
    def name(self) -> str:  # pragma: no cover - every config defines it
        raise NotImplementedError

    def render_params(self) -> dict:  # pragma: no cover - every config defines it
        raise NotImplementedError

    def render(self) -> str:
        """The kernel's CUDA source (``compiler.render`` of ``template`` with ``render_params()``)."""
        return compiler.render(self.template, **self.render_params())

    @cached_property
    def compiled(self) -> compiler.CompiledModule:
        """The compiled module (NVRTC, or the disk cache)."""
        return compiler.compile_source(self.name, self.render())
