"""Shared pieces of the frozen kernel-config dataclasses: domain checks and element types."""
from __future__ import annotations

from ..validate import is_int

CTYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half"}
SHORT = {"bfloat16": "bf16", "float16": "f16"}


def _same_kind(value, allowed) -> bool:
    """True == 1 and 4.0 == 4 would pass `in` and render an invalid kernel; NumPy integers are integers."""
    if value is None:
        return None in allowed
    kinds = [a for a in allowed if a is not None]
    if isinstance(kinds[0], str):
        return isinstance(value, str)
    return is_int(value)


def check_in(config: str, field: str, value, allowed) -> None:
    if not _same_kind(value, allowed) or value not in allowed:
        shown = ", ".join(map(str, allowed)) if len(allowed) < 20 else f"{min(allowed)}..{max(allowed)}"
        raise ValueError(f"{config}.{field}={value!r} is not valid; accepted: {shown}")


def check_bool(config: str, field: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{config}.{field}={value!r} is not valid; accepted: True, False")


def check_range(config: str, field: str, value, lo: int, hi: int, rule: str = "") -> None:
    if not is_int(value) or not (lo <= value <= hi):
        raise ValueError(f"{config}.{field}={value!r} is not valid; accepted: integers {lo}..{hi}"
                         + (f" ({rule})" if rule else ""))


def check_rule(config: str, field: str, value, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"{config}.{field}={value!r} is not valid: {rule}")


def check_kv_quant(config: str, kv_dtype, scale_block, head_dim: int) -> None:
    """The FP8 fields every kernel config shares: ``kv_dtype`` None or 'fp8_e4m3', and ``scale_block`` 0 (per
    tensor) or a block of 32/64/128 dims (or the whole head) that divides ``head_dim``; 0 without FP8."""
    check_in(config, "kv_dtype", kv_dtype, (None, "fp8_e4m3"))
    if kv_dtype is None:
        check_in(config, "scale_block", scale_block, (0,))
        return
    check_in(config, "scale_block", scale_block, (0, 32, 64, 128, head_dim))
    check_rule(config, "scale_block", scale_block, scale_block == 0 or head_dim % scale_block == 0,
               f"must divide head_dim={head_dim}")
