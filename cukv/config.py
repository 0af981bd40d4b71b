"""Shared pieces of the frozen kernel-config dataclasses: domain checks and element types."""
from __future__ import annotations

import numbers

CTYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half"}
SHORT = {"bfloat16": "bf16", "float16": "f16"}


def _same_kind(value, allowed) -> bool:
    """True == 1 and 4.0 == 4 would pass `in` and render an invalid kernel; NumPy integers are integers."""
    if value is None:
        return None in allowed
    kinds = [a for a in allowed if a is not None]
    if isinstance(kinds[0], str):
        return isinstance(value, str)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_in(config: str, field: str, value, allowed) -> None:
    if not _same_kind(value, allowed) or value not in allowed:
        shown = ", ".join(map(str, allowed)) if len(allowed) < 20 else f"{min(allowed)}..{max(allowed)}"
        raise ValueError(f"{config}.{field}={value!r} is not valid; accepted: {shown}")


def check_range(config: str, field: str, value, lo: int, hi: int, rule: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not (lo <= value <= hi):
        raise ValueError(f"{config}.{field}={value!r} is not valid; accepted: integers {lo}..{hi}"
                         + (f" ({rule})" if rule else ""))


def check_rule(config: str, field: str, value, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"{config}.{field}={value!r} is not valid: {rule}")
