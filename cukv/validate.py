"""One set of argument checks for every public entry point.

Every op (decode, prefill, append, merge, dequantize, the cache and its tables, the MLA ops) checks what a user
passed through these functions, so one kind of argument is accepted and refused the same way everywhere, with
an error that starts with the argument's name, shows the value and says what is accepted:

- :func:`check_int`: Python/NumPy integers in ``lo..hi``; a bool or a float (``16.5``, also ``16.0``) or an
  out-of-range value is a ValueError, a non-number a TypeError.
- :func:`check_float`: real numbers (never a bool), ``finite`` (the default; NaN never passes), ``positive``
  or ``nonnegative``.
- :func:`check_bool`: ``True``/``False`` (NumPy bools too), else TypeError.
- :func:`check_choice`: one of a tuple of strings or integers, of the same kind, else ValueError.
- :func:`device_array` / :func:`check_device_array`: CuPy, ``__cuda_array_interface__`` or DLPack device arrays
  viewed without a copy; a host array, a CPU tensor or a non-array is a TypeError, so is a wrong dtype; wrong
  shape, strides or alignment a ValueError.
- :func:`check_per_head`: an optional float32 ``[num_heads]`` device vector (an attention sink), contiguous.
- :func:`host_ints`: host integer arrays (device arrays are copied back); other dtypes are a TypeError.
- :func:`check_planned`: :class:`~cukv.errors.NotPlannedError` (a ``RuntimeError``) before ``plan()``.

A strided per-head vector (``sink[::2]``) is refused, not copied: a copy made inside ``run`` would be a hidden
allocation inside CUDA graph capture, and kernels read the vector as contiguous.

Device-side *data* (page ids, lengths, slots) is not read on the hot path, so ``run`` stays capturable in a
CUDA graph; :func:`checked` says whether the caller asked for the checked mode (``check=True`` or
``CUKV_CHECK=1``), in which :func:`check_page_table`, :func:`check_slots` and :func:`check_offsets` copy tables
to the host and validate them before the launch. ``docs/errors.md`` says what the unchecked kernels do with
each kind of bad device data.

This module is a leaf: it imports NumPy, :mod:`cukv.errors` and :mod:`cukv.arrays` (CuPy only inside functions).

Examples
--------
What a user sees from the entry points (no GPU needed to be refused):

>>> import cukv
>>> cukv.BatchDecode(8, 2, 128, page_size=16.5)
Traceback (most recent call last):
...
ValueError: page_size=16.5 must be in 1..4096 (an integer)
>>> cukv.BatchPrefill(8, 3, 128)
Traceback (most recent call last):
...
ValueError: num_qo_heads=8 must be a multiple of num_kv_heads=3
>>> cukv.BatchDecode(8, 2, 128, 16).run(None, None, None)
Traceback (most recent call last):
...
cukv.errors.NotPlannedError: BatchDecode.run() before plan(): call plan(batch_size, max_kv_len) first

The checks themselves:

>>> import numpy as np
>>> from cukv.validate import check_choice, check_float, check_int, check_slots, check_table, host_ints
>>> check_int("window", None, 1, none_ok=True), check_int("page_size", np.int64(16), 1)
(None, 16)
>>> check_int("window", 0, 1, none_ok=True, note="no window")
Traceback (most recent call last):
...
ValueError: window=0 must be a positive integer (or None for no window)
>>> check_float("sm_scale", float("nan"), positive=True)
Traceback (most recent call last):
...
ValueError: sm_scale=nan must be a finite number > 0
>>> check_choice("mask", "casual", ("none", "causal"))
Traceback (most recent call last):
...
ValueError: mask='casual' is not valid; accepted: 'none', 'causal'
>>> host_ints("kv_lengths", [1.5, 2])
Traceback (most recent call last):
...
TypeError: kv_lengths=[1.5, 2] must be an integer array; got dtype float64

The checked mode's table and slot checks, on host arrays:

>>> check_table(np.array([[0, 1], [2, 9]]), np.array([20, 17]), page_size=16, num_pages=8)
Traceback (most recent call last):
...
ValueError: block_table[1, 1]=9 is not a page of the cache (0..7)
>>> check_slots(np.array([0, 5, 5, -1]), num_slots=64)
Traceback (most recent call last):
...
ValueError: slot_mapping[1] and slot_mapping[2] both write slot 5
"""
from __future__ import annotations

import math
import numbers
import os
import reprlib

import numpy as np

from .arrays import as_device, check_aligned, check_contiguous, element_dtype
from .errors import NotPlannedError

__all__ = [
    "is_int", "check_int", "check_bool", "check_choice", "check_float", "device_array", "check_device_array",
    "check_per_head", "attention_outputs", "host_ints", "check_planned", "checked", "check_table", "check_page_table", "check_slots", "check_offsets",
]


# ----------------------------------------------------------------------------------------------
# scalars


def is_int(value) -> bool:
    """A Python or NumPy integer, never a bool (``True == 1`` and ``4.0 == 4`` would otherwise slip through)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _range_text(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"must be in {lo}..{hi} (an integer)"
    if lo == 1:
        return "must be a positive integer"
    if lo == 0:
        return "must be a non-negative integer"
    if lo is not None:
        return f"must be an integer >= {lo}"
    if hi is not None:
        return f"must be an integer <= {hi}"
    return "must be an integer"


def _tail(none_ok: bool, note: str) -> str:
    """`` (or None for {note})`` / `` (or None)`` / `` ({note})`` / nothing."""
    if none_ok:
        return f" (or None for {note})" if note else " (or None)"
    return f" ({note})" if note else ""


def check_int(name: str, value, lo: int | None = None, hi: int | None = None, *, none_ok: bool = False,
              note: str = "") -> int | None:
    """``value`` as an ``int`` if it is an integer in ``lo..hi`` (either bound may be None); ``None`` passes
    when ``none_ok``. A bool, a float (``16.5``, also ``16.0``) or an out-of-range integer is a ValueError, a
    non-number a TypeError; the message reads ``"{name}={value!r} must be ..."``, ending ``(or None for
    {note})`` where ``none_ok``, else ``({note})``."""
    if value is None and none_ok:
        return None
    if is_int(value) and (lo is None or value >= lo) and (hi is None or value <= hi):
        return int(value)
    text = _range_text(lo, hi) + _tail(none_ok, note)
    exc = ValueError if isinstance(value, (numbers.Number, np.bool_)) else TypeError
    raise exc(f"{name}={value!r} {text}")


def check_bool(name: str, value) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name}={value!r} must be True or False")


def check_choice(name: str, value, choices) -> object:
    """``value`` if it is one of ``choices`` and of the same kind (a string among strings, an integer and not a
    bool among integers; ``None`` only when ``None`` is listed)."""
    kinds = [c for c in choices if c is not None]
    if value is None:
        ok = None in choices
    elif isinstance(value, str):
        ok = value in [c for c in kinds if isinstance(c, str)]
    else:
        ok = is_int(value) and value in [c for c in kinds if is_int(c)]
    if ok:
        return value
    shown = ", ".join(map(repr, choices)) if len(choices) < 20 else f"{min(kinds)}..{max(kinds)}"
    raise ValueError(f"{name}={value!r} is not valid; accepted: {shown}")


def check_float(name: str, value, *, positive: bool = False, nonnegative: bool = False, finite: bool = True,
                none_ok: bool = False, note: str = "") -> float | None:
    """``value`` as a ``float`` if it is a real number (int, float, NumPy scalar; never a bool) meeting the
    rules: ``finite`` (no NaN, no inf), ``positive`` (> 0) or ``nonnegative`` (>= 0). NaN always fails."""
    if value is None and none_ok:
        return None
    want = "a " + ("finite " if finite else "") + "number" + (" > 0" if positive else " >= 0" if nonnegative else "")
    tail = _tail(none_ok, note)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        exc = ValueError if isinstance(value, (bool, np.bool_)) else TypeError
        raise exc(f"{name}={value!r} must be {want}{tail}")
    f = float(value)
    bad = math.isnan(f) or (finite and math.isinf(f)) or (positive and not f > 0) or (nonnegative and not f >= 0)
    if bad:
        raise ValueError(f"{name}={value!r} must be {want}{tail}")
    return f


# ----------------------------------------------------------------------------------------------
# device arrays


def device_array(name: str, x):
    """``(cupy_array, declared_dtype)`` viewing ``x`` without a copy: a CuPy array, anything exposing
    ``__cuda_array_interface__``, or a DLPack producer on a CUDA device (PyTorch, JAX; bf16 travels as uint16
    bits with ``declared_dtype='bfloat16'``). A host array or CPU tensor, or a non-array, is a TypeError naming
    ``name``."""
    return as_device(x, name)


def check_device_array(name: str, x, *, dtypes=None, ndim: int | None = None, shape: tuple | None = None,
                       contiguous: bool = False, unit_last_stride: bool = False, align: int = 0,
                       declared: str | None = None):
    """Check a device array and return its CuPy view (no copy).

    ``dtypes``: accepted NumPy dtypes (e.g. ``(np.int32,)``), or the strings ``'float16'``/``'bfloat16'`` for a
    16-bit float (bf16 as uint16 bits or a DLPack bf16 tensor); ``shape``: a tuple whose ``None`` entries match
    any size (it implies ``ndim``); ``contiguous``: C-contiguous; ``unit_last_stride``: the last axis is dense
    (other strides free); ``align``: the base address is a multiple of ``align`` bytes. ``declared`` is the
    dtype the caller says a uint16 array holds. With ``dtypes`` of 16-bit floats the dtype name comes back too:
    ``(array, 'bfloat16')``.
    """
    a, dt = device_array(name, x)
    float16 = dtypes is not None and all(isinstance(d, str) for d in dtypes)
    if dtypes is not None:
        if float16:
            got = element_dtype(a, dt or (declared if a.dtype == np.uint16 else None), name)
            if got not in dtypes:
                raise TypeError(f"{name} is {got}; accepted: {', '.join(dtypes)}")
        elif not any(a.dtype == np.dtype(d) for d in dtypes):
            raise TypeError(f"{name} has dtype {a.dtype}; accepted: {', '.join(np.dtype(d).name for d in dtypes)}")
    if shape is not None:
        ok = a.ndim == len(shape) and all(s is None or s == d for s, d in zip(shape, a.shape))
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} has shape {tuple(a.shape)}; expected {want}")
    elif ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} has {a.ndim} dimensions (shape {tuple(a.shape)}); expected {ndim}")
    if contiguous:
        check_contiguous(a, name)
    if unit_last_stride and a.ndim and a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        raise ValueError(f"{name} must be dense along its last axis (strides {a.strides}, itemsize {a.itemsize})")
    if align and a.size:
        check_aligned(a, name, align)
    return (a, got) if float16 else a


def check_per_head(name: str, x, num_heads: int):
    """An optional per-head float32 vector ``[num_heads]`` (an attention sink): None passes; a strided view is
    refused (kernels read it as contiguous, and a copy here would be a hidden allocation in graph capture)."""
    if x is None:
        return None
    return check_device_array(name, x, dtypes=(np.float32,), shape=(num_heads,), contiguous=True, align=4)


# ----------------------------------------------------------------------------------------------
# host arrays, plan state, the checked mode


def host_ints(name: str, x, ndim: int | None = None) -> np.ndarray:
    """An integer array on the host (a device array is copied back), as int64. Floats, bools and other dtypes
    are a TypeError naming ``name``; a wrong rank a ValueError."""
    if isinstance(x, (bool, np.bool_)) or (isinstance(x, numbers.Number) and not is_int(x)):
        raise TypeError(f"{name}={x!r} must be an integer array")
    if hasattr(x, "__cuda_array_interface__") and hasattr(x, "get"):  # CuPy
        x = x.get()
    elif hasattr(x, "cpu") and hasattr(x, "numpy"):  # torch
        x = x.cpu().numpy()
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}={reprlib.repr(x)} must be an integer array ({e})") from None
    if a.dtype.kind not in "iu" and a.size:  # an empty list comes out as float64
        raise TypeError(f"{name}={reprlib.repr(x)} must be an integer array; got dtype {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} has shape {a.shape}; expected {ndim} dimension{'s' if ndim != 1 else ''}")
    return a.astype(np.int64)


def check_planned(obj, how: str = "plan()") -> None:
    """Raise :class:`NotPlannedError` unless ``obj.plan`` has run (``obj._planned``)."""
    if not getattr(obj, "_planned", False):
        raise NotPlannedError(f"{type(obj).__name__}.run() before plan(): call {how} first")


def checked(check: bool | None) -> bool:
    """Whether to validate device data before a launch: ``check`` if given (True/False), else the environment
    switch ``CUKV_CHECK`` (``1``/``true``/``yes``/``on``)."""
    if check is None:
        return os.environ.get("CUKV_CHECK", "").strip().lower() in ("1", "true", "yes", "on")
    return check_bool("check", check)


def check_table(block_table: np.ndarray, lengths: np.ndarray, page_size: int, num_pages: int | None,
                names: tuple = ("block_table", "lengths")) -> None:
    """Host arrays of a page table: every length >= 0 and within its row's ``columns * page_size``, and every
    page a length reaches a page of the cache (``0 .. num_pages - 1``; not checked where ``num_pages`` is None).
    Unused columns are not looked at."""
    bt_name, len_name = names
    block_table, lengths = np.asarray(block_table), np.asarray(lengths, np.int64)
    if np.any(lengths < 0):
        i = int(np.argmax(lengths < 0))
        raise ValueError(f"{len_name}[{i}]={lengths[i]} is negative")
    need = -(-lengths // page_size)
    if np.any(need > block_table.shape[1]):
        i = int(np.argmax(need > block_table.shape[1]))
        raise ValueError(f"{len_name}[{i}]={lengths[i]} needs {need[i]} pages; {bt_name} has {block_table.shape[1]} "
                         f"columns (a row holds at most {block_table.shape[1] * page_size} tokens)")
    if num_pages is None:
        return
    cols = np.arange(block_table.shape[1])[None, :]
    used = cols < need[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bad.any():
        b, j = map(int, np.argwhere(bad)[0])
        raise ValueError(f"{bt_name}[{b}, {j}]={block_table[b, j]} is not a page of the cache (0..{num_pages - 1})")


def check_page_table(table, num_pages: int, batch: int | None = None, expect_lengths=None) -> None:
    """Checked mode: copy a :class:`~cukv.kvcache.PageTable`'s first ``batch`` rows to the host (a device sync)
    and run :func:`check_table`; ``expect_lengths`` (host ints) must equal ``table.lengths`` where given (the
    lengths ``BatchPrefill.plan`` was given)."""
    b = table.batch_size if batch is None else int(batch)
    bt, ln = table.block_table[:b].get(), table.lengths[:b].get()
    check_table(bt, ln, table.page_size, num_pages, ("table.block_table", "table.lengths"))
    if expect_lengths is not None:
        want = np.asarray(expect_lengths, np.int64)[:b]
        diff = ln.astype(np.int64) != want
        if diff.any():
            i = int(np.argmax(diff))
            raise ValueError(f"table.lengths[{i}]={ln[i]}, but plan() was given kv_lengths[{i}]={want[i]}; "
                             "plan again with the table's lengths")


def check_slots(slots, num_slots: int, name: str = "slot_mapping") -> None:
    """Checked mode: host or device slots must be -1 (padding) or in ``0 .. num_slots - 1``, with no slot written
    twice (two tokens racing for one slot)."""
    s = np.asarray(slots.get() if hasattr(slots, "get") and not isinstance(slots, np.ndarray) else slots, np.int64)
    bad = (s < -1) | (s >= num_slots)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{name}[{i}]={s[i]} is not a slot of the cache (0..{num_slots - 1}, or -1 to skip)")
    used = s[s >= 0]
    uniq, counts = np.unique(used, return_counts=True)
    if (counts > 1).any():
        dup = int(uniq[np.argmax(counts > 1)])
        where = np.flatnonzero(s == dup)[:2].tolist()
        raise ValueError(f"{name}[{where[0]}] and {name}[{where[1]}] both write slot {dup}")


def check_offsets(offsets, total: int, name: str = "kv_offsets") -> None:
    """Checked mode: ragged offsets ``[B + 1]`` start at 0, never decrease and end within ``total`` rows."""
    o = np.asarray(offsets.get() if hasattr(offsets, "get") and not isinstance(offsets, np.ndarray) else offsets,
                   np.int64)
    if o.size and o[0] != 0:
        raise ValueError(f"{name}[0]={o[0]} must be 0")
    if np.any(np.diff(o) < 0):
        i = int(np.argmax(np.diff(o) < 0))
        raise ValueError(f"{name}[{i + 1}]={o[i + 1]} is less than {name}[{i}]={o[i]}; offsets never decrease")
    if o.size and o[-1] > total:
        raise ValueError(f"{name}[-1]={o[-1]} exceeds the {total} rows of k and v")


# ----------------------------------------------------------------------------------------------
# attention outputs


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
    sink = check_per_head("sink", sink, heads)
    check_float("softcap", softcap, positive=True, none_ok=True, note="no soft-cap")
    return out, lse, sink



# ----------------------------------------------------------------------------------------------
# MLA prefill (cukv/ops/mla_prefill.py): the host checks, on shapes and host ints, so they run before any device work


def mla_prefill_batch(q_offsets, kv_lengths, kv_offsets=None):
    """``(q_offsets, kv_lengths, kv_offsets)`` as int64 host arrays, checked: ``q_offsets[B + 1]`` from 0 and never
    decreasing, ``kv_lengths[B]`` non-negative, ``kv_offsets[B + 1]`` (default their running sum) whose differences
    are ``kv_lengths``, and every row index below 2**31."""
    qo, kl = host_ints("q_offsets", q_offsets, 1), host_ints("kv_lengths", kv_lengths, 1)
    if qo.size < 2 or qo[0] != 0 or np.any(np.diff(qo) < 0):
        raise ValueError(f"q_offsets={qo.tolist()[:8]} must be [batch + 1] (batch >= 1), start at 0 and never decrease")
    b = qo.size - 1
    if kl.shape != (b,) or np.any(kl < 0):
        raise ValueError(f"kv_lengths has shape {kl.shape} / min {kl.min(initial=0)}; expected [{b}] non-negative")
    if kv_offsets is None:
        ko = np.concatenate([[0], np.cumsum(kl)])
    else:
        ko = host_ints("kv_offsets", kv_offsets, 1)
        if ko.shape != (b + 1,):
            raise ValueError(f"kv_offsets has shape {ko.shape}; expected [{b + 1}] (q_offsets' batch + 1)")
        if ko[0] < 0:
            raise ValueError(f"kv_offsets[0]={ko[0]} is negative")
        bad = np.diff(ko) != kl
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"kv_offsets[{i + 1}] - kv_offsets[{i}] = {ko[i + 1] - ko[i]}, but kv_lengths[{i}]={kl[i]}: "
                             "a sequence's k_nope / v rows are its kv_lengths keys")
    if ko[-1] >= 2**31 or qo[-1] >= 2**31:
        raise ValueError(f"kv_offsets reach {ko[-1]} rows, q_offsets {qo[-1]}; at most 2**31 - 1")
    return qo, kl, ko


def check_mla_prefill_shapes(num_heads: int, total_q: int, kv_rows: int, q, k_nope, v, k_rope=None) -> None:
    """Shapes of an MLA prefill's operands: ``q[total_q, H, 192]``, ``k_nope`` and ``v`` ``[>= kv_rows, H, 128]``,
    ``k_rope[>= kv_rows, 64]`` where given. A wrong width, head count or row count is a ValueError naming the
    argument."""
    widths = {"q": (192, "128 nope + 64 rope dims per head"), "k_nope": (128, "dims per head"),
              "v": (128, "dims per head"), "k_rope": (64, "rope dims, shared by every head")}
    for name, shape in (("q", q), ("k_nope", k_nope), ("v", v), ("k_rope", k_rope)):
        if shape is None:
            continue
        shape = tuple(shape)
        nd = 2 if name == "k_rope" else 3
        if len(shape) != nd:
            raise ValueError(f"{name} has shape {shape}; expected {nd} dimensions")
        want, what = widths[name]
        if shape[-1] != want:
            raise ValueError(f"{name} has width {shape[-1]} (shape {shape}); MLA prefill takes {want} ({what})")
        if nd == 3 and shape[1] != num_heads:
            raise ValueError(f"{name} has {shape[1]} heads (shape {shape}); this MLA prefill has num_heads={num_heads}")
        if name == "q" and shape[0] != total_q:
            raise ValueError(f"q has {shape[0]} tokens (shape {shape}); plan() has total_q={total_q}")
        if name != "q" and shape[0] < kv_rows:
            raise ValueError(f"{name} has {shape[0]} rows (shape {shape}); the plan's kv_offsets reach {kv_rows}")


def check_sparse_indices(indices, tokens: int, topk: int | None, indices_stride: int | None = None):
    """Sparse MLA's key lists: ``(array, topk, stride in elements)``. ``indices`` is int32 (or uint32) ``[tokens,
    >= topk]`` with a dense last axis (a column slice of a wider buffer reads in place), or, with
    ``indices_stride``, any dense buffer holding ``(tokens - 1) * indices_stride + topk`` elements. ``topk``
    None takes the list width (``indices.shape[1]``, or ``indices_stride``)."""
    a = check_device_array("indices", indices, dtypes=(np.int32, np.uint32), align=4)
    if indices_stride is None:
        if a.ndim != 2 or a.shape[0] != tokens:
            raise ValueError(f"indices has shape {tuple(a.shape)}; expected [{tokens}, topk] (one list per token)")
        if a.shape[1] > 1 and a.strides[1] != 4:
            raise ValueError(f"indices must be dense along its last axis (strides {a.strides})")
        width, stride = int(a.shape[1]), int(a.strides[0]) // 4
        if a.strides[0] % 4 or stride < 0:
            raise ValueError(f"indices has row stride {a.strides[0]} bytes; it must be a non-negative multiple of 4")
    else:
        stride = check_int("indices_stride", indices_stride, 1)
        check_contiguous(a, "indices")
        width = stride
    topk = width if topk is None else check_int("topk", topk, 1)
    if topk > width or topk < 1:
        raise ValueError(f"topk={topk} must be in 1..{width} (the width of each token's list in indices)")
    if indices_stride is not None and a.size < (tokens - 1) * stride + topk:
        raise ValueError(f"indices holds {a.size} elements; {tokens} lists of {topk} at indices_stride={stride} need "
                         f"{(tokens - 1) * stride + topk}")
    return a, topk, stride


def mla_dtypes(dtype, kv_dtype) -> tuple:
    """An MLA op's query dtype and cache rows: ``('bfloat16' | 'float16', None | 'fp8_e4m3')``, None for a 16-bit
    cache of the query's dtype, 'fp8_e4m3' for 656-byte rows (dequantized to bf16 tiles, so bf16 queries only).
    Anything else is a TypeError naming the argument."""
    from .arrays import canonical_dtype, canonical_kv_dtype

    dt = canonical_dtype(dtype)
    if dt not in ("bfloat16", "float16"):
        raise TypeError(f"dtype={dtype!r} is not offered; accepted: bfloat16, float16")
    kvd = None if kv_dtype is None else canonical_kv_dtype(kv_dtype, "kv_dtype")
    if kvd not in (None, "fp8_e4m3"):
        if kvd != dt:
            raise TypeError(f"kv_dtype={kv_dtype!r} with dtype={dtype!r}: a 16-bit cache must match the query dtype")
        kvd = None
    if kvd is not None and dt != "bfloat16":
        raise TypeError(f"kv_dtype={kv_dtype!r} needs dtype='bfloat16' (FP8 rows dequantize to bf16 tiles); "
                        f"got dtype={dtype!r}")
    return dt, kvd
