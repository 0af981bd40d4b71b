"""merge_states: combine partial attentions over disjoint key sets by their log-sum-exp.

Cascade (shared-prefix) attention and split-KV attention compute the attention of each query over
several disjoint sets of keys separately; ``merge_states`` turns the partial outputs ``v_i`` and their
natural-log LSEs ``s_i`` into the attention over the union:

    m = max_i s_i,   w_i = exp(s_i - m),   v = sum_i w_i v_i / sum_i w_i,   s = m + log(sum_i w_i)

Names and shapes follow FlashInfer's ``merge_state``/``merge_states``, with two differences: the LSE is
natural log (FlashInfer's is base 2), and the stacked form puts the state axis first (``[N, T, H, D]``).
A partition with LSE -inf (it saw no key) is ignored and its values are never read, so they may hold
anything (NaN included); a row whose partitions are all empty gets output 0 and LSE -inf.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ..arrays import as_device, check_aligned
from ..configs.merge import MERGE_ARGS, MERGE_DTYPES, THREADS, MergeConfig  # noqa: F401 - MERGE_DTYPES, THREADS: the domain
from ..device import sm_count
from ..operand import as_kernel_arg

@lru_cache(maxsize=None)
def _function(cfg: MergeConfig):
    return cfg.compiled.function(cfg.name)


# ----------------------------------------------------------------------------------------------
# argument checks


def _value_dtype(a, declared: str | None, arg: str) -> str:
    import cupy as cp

    if declared:
        return declared
    for name, dt in (("float32", cp.float32), ("float16", cp.float16), ("bfloat16", cp.uint16)):
        if a.dtype == dt:
            return name
    raise TypeError(f"{arg} has dtype {a.dtype}; accepted: bfloat16 (a torch/JAX bf16 tensor or CuPy uint16 "
                    "holding bf16 bits), float16, float32")


def _check_lse(s, arg: str, shape: tuple) -> None:
    import cupy as cp

    if s.dtype != cp.float32:
        raise TypeError(f"{arg} has dtype {s.dtype}; accepted: float32 (natural-log LSE)")
    if tuple(s.shape) != shape:
        raise ValueError(f"{arg} has shape {tuple(s.shape)}; expected {list(shape)}")


def _check_rows(a, arg: str, inner: bool = False) -> None:
    """Rows must be C-contiguous (``inner``: each state ``a[i]`` is) and 16-byte aligned for the values."""
    c = a[0] if inner and a.shape[0] else a
    if not c.flags.c_contiguous:
        raise ValueError(f"{arg} must be C-contiguous{' within each state' if inner else ''} (strides {a.strides}); "
                         f"use cupy.ascontiguousarray({arg})")


def _check_aligned(a, arg: str, align: int) -> None:
    if a.size:
        check_aligned(a, arg, align)


def _prepare_out(out, lse, shape: tuple, dtype, arg_dtype: str):
    import cupy as cp

    if out is None:
        out = cp.empty(shape, dtype)
    else:
        out, _ = as_device(out, "out")
        if tuple(out.shape) != shape or out.dtype != dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous {arg_dtype} array ({dtype}) of shape {list(shape)}; got "
                             f"{out.dtype} {tuple(out.shape)} with strides {out.strides}")
        _check_aligned(out, "out", 16)
    if lse is None:
        lse = cp.empty(shape[:-1], cp.float32)
    else:
        lse, _ = as_device(lse, "lse")
        if tuple(lse.shape) != shape[:-1] or lse.dtype != cp.float32 or not lse.flags.c_contiguous:
            raise ValueError(f"lse must be a C-contiguous float32 array of shape {list(shape[:-1])}; got "
                             f"{lse.dtype} {tuple(lse.shape)} with strides {lse.strides}")
    return out, lse


def _span(ptr: int, nbytes: int, n: int, stride: int) -> tuple[int, int]:
    """Byte interval covered by n states of nbytes each, state i at ptr + i * stride."""
    ends = (ptr, ptr + (n - 1) * stride)
    return min(ends), max(ends) + nbytes


def _check_no_overlap(out, lse, spans) -> None:
    for name, a in (("out", out), ("lse", lse)):
        lo, hi = a.data.ptr, a.data.ptr + a.nbytes
        for arg, (ilo, ihi) in spans:
            if a.nbytes and ilo < hi and lo < ihi:
                raise ValueError(f"{name} overlaps {arg}; merge_states cannot work in place (pass a separate buffer)")


def _launch(cfg: MergeConfig, v_ptr: int, v_stride: int, s_ptr: int, s_stride: int, num_states: int, rows: int,
            out, lse, stream) -> None:
    import cupy as cp

    rec = np.zeros((), MERGE_ARGS)
    rec["v"], rec["s"], rec["out"], rec["lse"] = v_ptr, s_ptr, out.data.ptr, lse.data.ptr
    rec["v_state_stride"], rec["s_state_stride"] = v_stride, s_stride
    rec["num_rows"], rec["num_states"] = rows, num_states
    fn = _function(cfg)
    resident = sm_count() * max(1, 2048 // cfg.threads)
    grid = max(1, min(math.ceil(rows / cfg.rows_per_block), 8 * resident))
    with (stream or cp.cuda.get_current_stream()):
        fn((grid,), (cfg.threads,), (as_kernel_arg(rec),))


# ----------------------------------------------------------------------------------------------
# public API


def merge_states(v_a, s_a, v_b, s_b, out=None, lse=None, *, stream=None):
    """Merge two partial attentions of the same queries over disjoint key sets.

    Parameters
    ----------
    v_a, v_b : device arrays ``[tokens, heads, head_dim]``
        Partial outputs, bfloat16 (a torch/JAX bf16 tensor or CuPy uint16 holding bf16 bits), float16 or
        float32, both of one dtype, C-contiguous and 16-byte aligned.
    s_a, s_b : device float32 arrays ``[tokens, heads]``
        Their natural-log LSEs; -inf marks an empty partition (its values are never read).
    out, lse : optional preallocated outputs (``[tokens, heads, head_dim]`` in the values' dtype and
        ``[tokens, heads]`` float32); neither may overlap an input. With them the call allocates nothing and
        can be captured in a CUDA graph.

    Returns
    -------
    (v, s): the merged output in the values' dtype (CuPy; bf16 as uint16 bits) and its float32 LSE.

    Examples
    --------
    >>> import cupy as cp, numpy as np, cukv
    >>> from cukv import reference
    >>> from cukv.testing import assert_close
    >>> rng = np.random.default_rng(0)
    >>> v_a, v_b = (rng.standard_normal((5, 8, 128)).astype(np.float16) for _ in range(2))
    >>> s_a, s_b = (rng.standard_normal((5, 8)).astype(np.float32) for _ in range(2))
    >>> v, s = cukv.merge_states(cp.asarray(v_a), cp.asarray(s_a), cp.asarray(v_b), cp.asarray(s_b))
    >>> want, want_s = reference.merge_states([v_a, v_b], [s_a, s_b])
    >>> assert_close(v.get(), want, "float16") < 0.01 and assert_close(s.get(), want_s, "float32") < 0.01
    True
    >>> s_b[:] = -np.inf                                  # b saw no key: the result is a
    >>> v, s = cukv.merge_states(cp.asarray(v_a), cp.asarray(s_a), cp.asarray(v_b), cp.asarray(s_b))
    >>> assert_close(v.get(), v_a, "float16") < 0.01 and assert_close(s.get(), s_a, "float32") < 0.01
    True
    """
    va, va_dt = as_device(v_a, "v_a")
    vb, vb_dt = as_device(v_b, "v_b")
    sa, _ = as_device(s_a, "s_a")
    sb, _ = as_device(s_b, "s_b")
    dt = _value_dtype(va, va_dt, "v_a")
    dtb = _value_dtype(vb, vb_dt, "v_b")
    if dtb != dt or vb.dtype != va.dtype:
        raise TypeError(f"v_b is {dtb}; v_a is {dt}: both partial outputs must have one dtype")
    if va.ndim != 3:
        raise ValueError(f"v_a has shape {tuple(va.shape)}; expected [tokens, heads, head_dim]")
    if vb.shape != va.shape:
        raise ValueError(f"v_b has shape {tuple(vb.shape)}; expected {list(va.shape)} like v_a")
    _check_lse(sa, "s_a", tuple(va.shape[:2]))
    _check_lse(sb, "s_b", tuple(va.shape[:2]))
    for arg, a in (("v_a", va), ("v_b", vb), ("s_a", sa), ("s_b", sb)):
        _check_rows(a, arg)
    _check_aligned(va, "v_a", 16)
    _check_aligned(vb, "v_b", 16)
    cfg = MergeConfig(dt, int(va.shape[2]))
    out, lse = _prepare_out(out, lse, tuple(va.shape), va.dtype, dt)
    _check_no_overlap(out, lse, [("v_a", _span(va.data.ptr, va.nbytes, 1, 0)), ("v_b", _span(vb.data.ptr, vb.nbytes, 1, 0)),
                                 ("s_a", _span(sa.data.ptr, sa.nbytes, 1, 0)), ("s_b", _span(sb.data.ptr, sb.nbytes, 1, 0))])
    rows = int(va.shape[0] * va.shape[1])
    if rows:
        # state 1 is reached from state 0 by the distance between the two base addresses
        _launch(cfg, va.data.ptr, vb.data.ptr - va.data.ptr, sa.data.ptr, sb.data.ptr - sa.data.ptr, 2, rows, out, lse,
                stream)
    return out, lse


def merge_states_n(vs, ss, out=None, lse=None, *, stream=None):
    """Merge N partial attentions stacked as ``vs[N, tokens, heads, head_dim]`` and ``ss[N, tokens, heads]``.

    Same dtypes and rules as :func:`merge_states`; each state ``vs[i]``/``ss[i]`` must be C-contiguous, the
    stride between states is free (a slice of a bigger stack works). N = 1 copies (empty rows become 0).
    Returns ``(v[tokens, heads, head_dim], s[tokens, heads])``.

    Examples
    --------
    >>> import cupy as cp, numpy as np, cukv
    >>> from cukv import reference
    >>> from cukv.testing import assert_close
    >>> rng = np.random.default_rng(0)
    >>> vs = rng.standard_normal((3, 5, 4, 64)).astype(np.float32)     # 3 partial attentions of 5 tokens, 4 heads
    >>> ss = rng.standard_normal((3, 5, 4)).astype(np.float32)
    >>> ss[2, 0] = -np.inf                                             # state 2 saw no key for token 0
    >>> v, s = cukv.merge_states_n(cp.asarray(vs), cp.asarray(ss))
    >>> want, want_s = reference.merge_states(list(vs), list(ss))
    >>> assert_close(v.get(), want, "float32") < 1e-4 and assert_close(s.get(), want_s, "float32") < 1e-4
    True
    """
    vd, v_dt = as_device(vs, "vs")
    sd, _ = as_device(ss, "ss")
    dt = _value_dtype(vd, v_dt, "vs")
    if vd.ndim != 4:
        raise ValueError(f"vs has shape {tuple(vd.shape)}; expected [num_states, tokens, heads, head_dim]")
    if vd.shape[0] < 1:
        raise ValueError(f"vs has {vd.shape[0]} states (shape {tuple(vd.shape)}); accepted: 1 or more")
    _check_lse(sd, "ss", tuple(vd.shape[:3]))
    _check_rows(vd, "vs", inner=True)
    _check_rows(sd, "ss", inner=True)
    _check_aligned(vd, "vs", 16)
    if vd.shape[0] > 1 and vd.strides[0] % 16:
        raise ValueError(f"vs has a state stride of {vd.strides[0]} bytes; accepted: multiples of 16")
    n = int(vd.shape[0])
    shape = tuple(vd.shape[1:])
    cfg = MergeConfig(dt, int(shape[2]))
    out, lse = _prepare_out(out, lse, shape, vd.dtype, dt)
    row_bytes = math.prod(shape) * vd.itemsize
    _check_no_overlap(out, lse, [("vs", _span(vd.data.ptr, row_bytes, n, vd.strides[0])),
                                 ("ss", _span(sd.data.ptr, math.prod(shape[:2]) * 4, n, sd.strides[0]))])
    rows = int(shape[0] * shape[1])
    if rows:
        _launch(cfg, vd.data.ptr, int(vd.strides[0]), sd.data.ptr, int(sd.strides[0]), n, rows, out, lse, stream)
    return out, lse
