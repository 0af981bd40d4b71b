"""Every public entry point walked through one table of bad values per argument kind (cukv/validate.py).

Each case asserts the exception type and that the message names the argument (and, for scalars, shows the value).
Scalar, host-array and constructor cases run without a GPU: the checks come before any device work. Device-array
cases that need real CuPy arrays (dtype, shape, strides, the checked mode) are marked ``gpu``.
"""
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest

import cukv
from cukv import validate
from cukv.errors import CukvError, NotPlannedError

# ----------------------------------------------------------------------------------------------
# the tables: bad value -> the exception it must raise

POSITIVE_INT = [(True, ValueError), (16.5, ValueError), (128.5, ValueError), (16.0, ValueError), (0, ValueError),
                (-3, ValueError), ("16", TypeError), (None, TypeError), (np.float32(2), ValueError)]
OPTIONAL_POSITIVE_INT = [(True, ValueError), (2.5, ValueError), (0, ValueError), (-1, ValueError), ("3", TypeError)]
OPTIONAL_NONNEG_INT = [(True, ValueError), (2.5, ValueError), (-1, ValueError), ("2", TypeError)]
OPTIONAL_POSITIVE_FLOAT = [(math.nan, ValueError), (-1.0, ValueError), (0.0, ValueError), (math.inf, ValueError),
                           (True, ValueError), ("0.1", TypeError), (np.float32("nan"), ValueError)]
BOOL = [(1, TypeError), ("yes", TypeError), (None, TypeError)]
OPTIONAL_BOOL = [(1, TypeError), ("yes", TypeError)]
HOST_INTS = [(np.array([0.0, 1.0]), TypeError), (np.array([True, False]), TypeError), (3.5, TypeError),
             ({}, TypeError), ("0, 1", TypeError)]
DEVICE_ARRAY = ["numpy", "cpu_dlpack", "list", "str"]


class CpuTensor:
    """A DLPack producer living on the host, as a torch CPU tensor is (kDLCPU)."""

    def __dlpack__(self, stream=None):
        raise AssertionError("a host tensor must be refused before it is imported")

    def __dlpack_device__(self):
        return (1, 0)


def _device_bad(kind):
    if kind == "numpy":
        return np.zeros((2, 8, 64), np.float16), TypeError
    if kind == "cpu_dlpack":
        return CpuTensor(), TypeError
    if kind == "list":
        return [[0.0]], TypeError
    return "q", TypeError


try:  # a real torch CPU tensor where torch is installed (it is not a cukv dependency)
    import torch

    DEVICE_ARRAY.append("torch_cpu")
except ImportError:
    torch = None


def _device_value(kind):
    if kind == "torch_cpu":
        return torch.zeros((2, 8, 64), dtype=torch.bfloat16), TypeError
    return _device_bad(kind)


# ----------------------------------------------------------------------------------------------
# the entry points: name -> (call(**override), {argument: table})

FAKE_CACHE = SimpleNamespace(num_pages=8, page_size=4)


def _decode_ctor(**kw):
    return cukv.BatchDecode(**{**dict(num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16), **kw})


def _decode_plan(**kw):
    return _decode_ctor().plan(**{**dict(batch_size=2, max_kv_len=64), **kw})


def _decode_run(**kw):
    return _decode_ctor().run(None, None, None, **kw)


def _prefill_ctor(**kw):
    return cukv.BatchPrefill(**{**dict(num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16), **kw})


def _prefill_plan(**kw):
    args = {**dict(q_offsets=np.array([0, 3, 5]), kv_lengths=np.array([20, 5])), **kw}
    return _prefill_ctor().plan(args.pop("q_offsets"), args.pop("kv_lengths"), **args)


def _prefill_run(**kw):
    return _prefill_ctor().run(None, None, **kw)


def _cache_ctor(**kw):
    return cukv.PagedKVCache(**{**dict(num_pages=4, page_size=16, num_kv_heads=2, head_dim=64, dtype="float16"), **kw})


def _flashinfer(**kw):
    args = {**dict(indptr=np.array([0, 1]), indices=np.array([0]), last_page_len=np.array([3]), page_size=16), **kw}
    return cukv.PageTable.from_flashinfer(**args)


def _vllm(**kw):
    args = {**dict(block_table=np.zeros((1, 2), np.int32), seq_lens=np.array([3]), page_size=16), **kw}
    return cukv.PageTable.from_vllm(**args)


def _seq_table(**kw):
    return cukv.SequenceTable(**{**dict(cache=FAKE_CACHE, max_batch=2, max_pages_per_seq=2), **kw})


def _extend(**kw):
    return cukv.SequenceTable(FAKE_CACHE, 2, 2).extend(kw["counts"])


def _mla_ctor(**kw):
    return cukv.BatchMLADecode(**{**dict(num_heads=16), **kw})


def _mla_plan(**kw):
    return _mla_ctor().plan(**{**dict(seq_lens=np.array([100, 7]), s_q=1), **kw})


def _mla_run(**kw):
    return _mla_ctor().run(None, None, None, **kw)


def _mla_cache(**kw):
    return cukv.MLAKVCache(**{**dict(num_pages=4, page_size=64, dtype="bfloat16"), **kw})


def _append_mla(**kw):
    args = {**dict(cache=None, kv_c=None, k_pe=None, slots=None), **kw}
    return cukv.append_mla(args.pop("cache"), args.pop("kv_c"), args.pop("k_pe"), args.pop("slots"), **args)


def _sparse_ctor(**kw):
    return cukv.SparseMLA(**{**dict(num_heads=16), **kw})


def _sparse_plan(**kw):
    return _sparse_ctor().plan(**{**dict(num_tokens=4, topk=128), **kw})


def _mlap_ctor(**kw):
    return cukv.BatchMLAPrefill(**{**dict(num_heads=16, page_size=64), **kw})


def _mlap_plan(**kw):
    args = {**dict(q_offsets=np.array([0, 3, 5]), kv_lengths=np.array([20, 5])), **kw}
    return _mlap_ctor().plan(args.pop("q_offsets"), args.pop("kv_lengths"), **args)


def _mlap_run(**kw):
    return _mlap_ctor().run(None, None, None, **kw)


SCALARS = {
    "BatchDecode": (_decode_ctor, {"num_qo_heads": POSITIVE_INT, "num_kv_heads": POSITIVE_INT, "head_dim": POSITIVE_INT,
                                   "page_size": POSITIVE_INT, "num_warps": POSITIVE_INT, "stages": OPTIONAL_NONNEG_INT,
                                   "cluster_merge": BOOL, "tma": OPTIONAL_BOOL}),
    "BatchDecode.plan": (_decode_plan, {"batch_size": POSITIVE_INT, "max_kv_len": POSITIVE_INT,
                                        "num_splits": OPTIONAL_POSITIVE_INT}),
    "BatchDecode.run": (_decode_run, {"window": OPTIONAL_POSITIVE_INT, "sm_scale": OPTIONAL_POSITIVE_FLOAT,
                                      "softcap": OPTIONAL_POSITIVE_FLOAT, "return_lse": BOOL, "check": OPTIONAL_BOOL}),
    "BatchPrefill": (_prefill_ctor, {"num_qo_heads": POSITIVE_INT, "num_kv_heads": POSITIVE_INT,
                                     "head_dim": POSITIVE_INT, "page_size": OPTIONAL_POSITIVE_INT,
                                     "fp8_prefill": [("fused ", ValueError), (1, ValueError), (None, ValueError)]}),
    "BatchPrefill.plan": (_prefill_plan, {"window": OPTIONAL_POSITIVE_INT, "chunk": OPTIONAL_POSITIVE_INT,
                                          "mask": [("Causal", ValueError), (True, ValueError), (None, ValueError)],
                                          "q_offsets": HOST_INTS, "kv_lengths": HOST_INTS}),
    "BatchPrefill.run": (_prefill_run, {"sm_scale": OPTIONAL_POSITIVE_FLOAT, "softcap": OPTIONAL_POSITIVE_FLOAT,
                                        "return_lse": BOOL, "check": OPTIONAL_BOOL}),
    "PagedKVCache": (_cache_ctor, {"num_pages": POSITIVE_INT, "page_size": POSITIVE_INT, "num_kv_heads": POSITIVE_INT,
                                   "head_dim": POSITIVE_INT, "num_layers": POSITIVE_INT}),
    "PageTable.from_flashinfer": (_flashinfer, {"page_size": POSITIVE_INT, "max_pages": OPTIONAL_POSITIVE_INT,
                                                "indptr": HOST_INTS, "indices": HOST_INTS, "last_page_len": HOST_INTS}),
    "PageTable.from_vllm": (_vllm, {"page_size": POSITIVE_INT, "block_table": HOST_INTS, "seq_lens": HOST_INTS}),
    "SequenceTable": (_seq_table, {"max_batch": POSITIVE_INT, "max_pages_per_seq": POSITIVE_INT,
                                   "cache": [(None, TypeError), (object(), TypeError)]}),
    "SequenceTable.extend": (_extend, {"counts": HOST_INTS}),
    "PageAllocator": (lambda **kw: cukv.PageAllocator(**kw), {"num_pages": POSITIVE_INT}),
    "PageAllocator.alloc": (lambda **kw: cukv.PageAllocator(4).alloc(**kw),
                            {"n": [(True, ValueError), (1.5, ValueError), (-1, ValueError), ("1", TypeError)]}),
    "MLAKVCache": (_mla_cache, {"num_pages": POSITIVE_INT, "page_size": POSITIVE_INT,
                                "fill": [("zero", ValueError), (0, ValueError), (True, ValueError)]}),
    "append_mla": (_append_mla, {"pow2_scales": BOOL, "check": OPTIONAL_BOOL}),
    "BatchMLADecode": (_mla_ctor, {"num_heads": POSITIVE_INT + [(129, ValueError)],
                                   "block_n": [(True, ValueError), (48, ValueError), (64.0, ValueError),
                                               ("64", ValueError)],
                                   "num_kv_stages": OPTIONAL_POSITIVE_INT + [(1, ValueError), (9, ValueError)],
                                   "schedule": [("alt", ValueError), (1, ValueError), (True, ValueError)],
                                   "tma": OPTIONAL_BOOL, "prefetch_tiles": [(5, ValueError), (True, ValueError)],
                                   "fp8_rows": [(12, ValueError), (True, ValueError)], "slice_release": OPTIONAL_BOOL,
                                   "multicast": OPTIONAL_BOOL, "persistent": OPTIONAL_BOOL}),
    "BatchMLADecode.plan": (_mla_plan, {"s_q": POSITIVE_INT + [(9, ValueError)], "chunk_tiles": OPTIONAL_POSITIVE_INT,
                                        "seq_lens": HOST_INTS}),
    "BatchMLADecode.run": (_mla_run, {"softmax_scale": OPTIONAL_POSITIVE_FLOAT, "return_lse": BOOL,
                                      "check": OPTIONAL_BOOL}),
    "SparseMLA": (_sparse_ctor, {"num_heads": POSITIVE_INT + [(129, ValueError)],
                                 "block_n": [(True, ValueError), (48, ValueError), ("64", ValueError)],
                                 "num_kv_stages": OPTIONAL_POSITIVE_INT + [(1, ValueError), (9, ValueError)],
                                 "schedule": [("alt", ValueError), (1, ValueError), (True, ValueError)],
                                 "multicast": OPTIONAL_BOOL, "persistent": OPTIONAL_BOOL}),
    "SparseMLA.plan": (_sparse_plan, {"num_tokens": POSITIVE_INT, "topk": POSITIVE_INT,
                                      "chunk_tiles": OPTIONAL_POSITIVE_INT}),
    "SparseMLA.run": (lambda **kw: _sparse_ctor().run(None, None, None, **kw),
                      {"softmax_scale": OPTIONAL_POSITIVE_FLOAT}),
    "BatchMLAPrefill": (_mlap_ctor, {"num_heads": POSITIVE_INT, "page_size": OPTIONAL_POSITIVE_INT,
                                     "max_blocks": OPTIONAL_POSITIVE_INT}),
    "BatchMLAPrefill.plan": (_mlap_plan, {"mask": [("Causal", ValueError), (True, ValueError), (None, ValueError)],
                                          "q_offsets": HOST_INTS, "kv_lengths": HOST_INTS}),
    "BatchMLAPrefill.run": (_mlap_run, {"softmax_scale": OPTIONAL_POSITIVE_FLOAT, "return_lse": BOOL,
                                       "check": OPTIONAL_BOOL}),
}
# None is no bad value where the argument takes None
OPTIONAL = {("BatchPrefill", "page_size"), ("BatchMLAPrefill", "page_size")}


def _scalar_cases():
    for entry, (_, args) in SCALARS.items():
        for arg, table in args.items():
            for value, exc in table:
                if value is None and (entry, arg) in OPTIONAL:
                    continue
                yield pytest.param(entry, arg, value, exc, id=f"{entry}-{arg}={value!r}")


@pytest.mark.parametrize("entry,arg,value,exc", list(_scalar_cases()))
def test_bad_scalars_name_the_argument(entry, arg, value, exc):
    call, _ = SCALARS[entry]
    with pytest.raises(exc) as e:
        call(**{arg: value})
    msg = str(e.value)
    assert re.search(rf"\b{re.escape(arg)}\b", msg), msg
    if not isinstance(value, np.ndarray) and arg != "cache":  # scalars: the value as the user wrote it
        assert f"{arg}={value!r}" in msg, msg


# entry points whose first check is a device array: called with that argument bad, the rest placeholders
DEVICE_ENTRIES = {
    "decode": ("q", lambda x: cukv.decode(x, None, None)),
    "prefill": ("q", lambda x: cukv.prefill(x, np.array([0, 2]), None)),
    "append_kv": ("k_new", lambda x: cukv.append_kv(None, x, x, None)),
    "merge_states": ("v_a", lambda x: cukv.merge_states(x, None, None, None)),
    "merge_states_n": ("vs", lambda x: cukv.merge_states_n(x, None)),
    "PagedKVCache.from_arrays": ("k", lambda x: cukv.PagedKVCache.from_arrays(x, x)),
    "PageTable": ("block_table", lambda x: cukv.PageTable(x, x, 16)),
    "MLAKVCache.from_arrays": ("x", lambda x: cukv.MLAKVCache.from_arrays(x)),
    "append_mla": ("kv_c", lambda x: cukv.append_mla(None, x, x, x)),
    "mla_decode": ("q", lambda x: cukv.mla_decode(x, None, None, [1])),
    "mla_prefill": ("q", lambda x: cukv.mla_prefill(x, None, None, [0, 1], [1])),
    "sparse_mla_prefill": ("q", lambda x: cukv.sparse_mla_prefill(x, None, None)),
    "sparse_mla_decode": ("q", lambda x: cukv.sparse_mla_decode(x, None, None)),
    "check_device_array": ("x", lambda x: validate.check_device_array("x", x)),
    "check_per_head": ("sink", lambda x: validate.check_per_head("sink", x, 8)),
}


@pytest.mark.parametrize("kind", DEVICE_ARRAY)
@pytest.mark.parametrize("entry", list(DEVICE_ENTRIES))
def test_host_and_non_arrays_name_the_argument(entry, kind):
    arg, call = DEVICE_ENTRIES[entry]
    value, exc = _device_value(kind)
    with pytest.raises(exc, match=rf"^{re.escape(arg)}\b"):
        call(value)


def test_cpu_tensor_message_says_host():
    with pytest.raises(TypeError, match=r"^q is a host \(CPU\) .*CpuTensor; pass a device array"):
        cukv.decode(CpuTensor(), None, None)


@pytest.mark.parametrize("obj,how", [(lambda: _decode_ctor(), "plan(batch_size, max_kv_len)"),
                                     (lambda: _prefill_ctor(), "plan(q_offsets, kv_lengths)"),
                                     (lambda: _mla_ctor(), "plan(seq_lens, s_q)"),
                                     (lambda: _mlap_ctor(), "plan(q_offsets, kv_lengths)")])
def test_run_before_plan(obj, how):
    o = obj()
    with pytest.raises(NotPlannedError, match=re.escape(f"call {how} first")) as e:
        o.run(None, None) if isinstance(o, cukv.BatchPrefill) else o.run(None, None, None)
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, CukvError)


def test_dequantize_kv_names_the_cache():
    with pytest.raises(TypeError, match=r"^cache must be an FP8 PagedKVCache"):
        cukv.dequantize_kv(object(), None, [1])


# ----------------------------------------------------------------------------------------------
# the shared checks themselves


@pytest.mark.parametrize("value", [1, np.int32(7), np.int64(2**40)])
def test_check_int_accepts_numpy_ints(value):
    assert validate.check_int("n", value, 1) == int(value) and type(validate.check_int("n", value, 1)) is int


def test_check_int_messages():
    with pytest.raises(ValueError, match=r"^page_size=16\.5 must be in 1\.\.4096 \(an integer\)$"):
        validate.check_int("page_size", 16.5, 1, 4096)
    with pytest.raises(ValueError, match=r"^num_qo_heads=True must be a positive integer$"):
        validate.check_int("num_qo_heads", True, 1)
    with pytest.raises(ValueError, match=r"^window=0 must be a positive integer \(or None for no window\)$"):
        validate.check_int("window", 0, 1, none_ok=True, note="no window")
    assert validate.check_int("window", None, 1, none_ok=True) is None


def test_check_float_messages():
    with pytest.raises(ValueError, match=r"^sm_scale=nan must be a finite number > 0 \(or None for 1/sqrt"):
        validate.check_float("sm_scale", math.nan, positive=True, none_ok=True, note="1/sqrt(head_dim)")
    with pytest.raises(ValueError, match=r"^x=nan must be a number"):
        validate.check_float("x", math.nan, finite=False)
    assert validate.check_float("x", math.inf, finite=False) == math.inf
    assert validate.check_float("x", np.float16(0.5), positive=True) == 0.5


def test_check_choice_refuses_other_kinds():
    assert validate.check_choice("mask", "none", ("none", "causal")) == "none"
    assert validate.check_choice("g", 64, (32, 64)) == 64
    for bad in (True, 64.0, "64"):
        with pytest.raises(ValueError, match=rf"^g={re.escape(repr(bad))} is not valid; accepted: 32, 64$"):
            validate.check_choice("g", bad, (32, 64))


def test_host_ints_accepts_lists_and_empty():
    assert validate.host_ints("x", [1, 2]).dtype == np.int64
    assert validate.host_ints("x", []).size == 0
    with pytest.raises(ValueError, match=r"^x has shape \(2, 1\); expected 1 dimension$"):
        validate.host_ints("x", [[1], [2]], ndim=1)


def test_checked_follows_the_argument_then_the_environment(monkeypatch):
    monkeypatch.delenv("CUKV_CHECK", raising=False)
    assert validate.checked(None) is False and validate.checked(True) is True
    monkeypatch.setenv("CUKV_CHECK", "1")
    assert validate.checked(None) is True and validate.checked(False) is False
    monkeypatch.setenv("CUKV_CHECK", "0")
    assert validate.checked(None) is False


@pytest.mark.parametrize("bt,lens,match", [
    ([[0, 1]], [33], r"^table\.lengths\[0\]=33 needs 3 pages; table\.block_table has 2 columns \(a row holds at most 32"),
    ([[0, 9]], [17], r"^table\.block_table\[0, 1\]=9 is not a page of the cache \(0\.\.7\)"),
    ([[0, -1]], [17], r"^table\.block_table\[0, 1\]=-1"),
    ([[0, 1]], [-1], r"^table\.lengths\[0\]=-1 is negative"),
])
def test_check_table_names_the_bad_entry(bt, lens, match):
    with pytest.raises(ValueError, match=match):
        validate.check_table(np.array(bt), np.array(lens), 16, 8, ("table.block_table", "table.lengths"))
    validate.check_table(np.array([[0, 99]]), np.array([16]), 16, 8)  # an unused column is never looked at


@pytest.mark.parametrize("slots,match", [
    ([0, 5, 64], r"^slot_mapping\[2\]=64 is not a slot of the cache \(0\.\.63, or -1 to skip\)"),
    ([0, -2], r"^slot_mapping\[1\]=-2"),
    ([3, -1, 3], r"^slot_mapping\[0\] and slot_mapping\[2\] both write slot 3"),
])
def test_check_slots(slots, match):
    validate.check_slots(np.array([-1, 0, 63, -1]), 64)
    with pytest.raises(ValueError, match=match):
        validate.check_slots(np.array(slots), 64)


@pytest.mark.parametrize("offs,match", [([1, 2], r"kv_offsets\[0\]=1 must be 0"),
                                        ([0, 3, 2], r"kv_offsets\[2\]=2 is less than kv_offsets\[1\]=3"),
                                        ([0, 11], r"kv_offsets\[-1\]=11 exceeds the 10 rows")])
def test_check_offsets(offs, match):
    validate.check_offsets(np.array([0, 4, 10]), 10)
    with pytest.raises(ValueError, match=match):
        validate.check_offsets(np.array(offs), 10)


# ----------------------------------------------------------------------------------------------
# device arrays (GPU): dtype, shape, strides, per-head vectors, the checked mode


def _setup_paged(dtype="float16"):
    import cupy as cp

    cache = cukv.PagedKVCache(num_pages=8, page_size=16, num_kv_heads=2, head_dim=64, dtype=dtype, fill=0.0)
    seqs = cukv.SequenceTable(cache, max_batch=2, max_pages_per_seq=4)
    slots = cp.asarray(seqs.extend([20, 5]))
    kv = cp.zeros((25, 2, 64), cp.float16)
    cukv.append_kv(cache, kv, kv, slots)
    return cache, seqs.page_table()


def _device_table(kind):
    """(arg kind) -> list of (make(like) -> bad array, exception)."""
    import cupy as cp

    if kind == "query":
        return [(lambda q: q.astype(cp.float32), TypeError), (lambda q: q[:, :, :32], ValueError),
                (lambda q: cp.concatenate([q, q])[::2], ValueError), (lambda q: q[None], ValueError)]
    return [(lambda n: cp.zeros(2 * n, cp.float32)[::2], ValueError), (lambda n: cp.zeros(n, cp.float16), TypeError),
            (lambda n: cp.zeros(n + 1, cp.float32), ValueError), (lambda n: cp.zeros((n, 1), cp.float32), ValueError)]


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["decode", "prefill"])
@pytest.mark.parametrize("i", range(4))
@pytest.mark.parametrize("arg", ["q", "sink"])
def test_device_arrays_name_the_argument(op, i, arg):
    import cupy as cp

    cache, table = _setup_paged()
    if op == "decode":
        runner = cukv.BatchDecode(8, 2, 64, 16, dtype="float16").plan(2, 64)
        q = cp.zeros((2, 8, 64), cp.float16)
        run = lambda **kw: runner.run(kw.pop("q", q), cache, table, **kw)  # noqa: E731
    else:
        runner = cukv.BatchPrefill(8, 2, 64, 16, dtype="float16").plan(np.array([0, 3, 5]), np.array([20, 5]))
        q = cp.zeros((5, 8, 64), cp.float16)
        run = lambda **kw: runner.run(kw.pop("q", q), (cache, table), **kw)  # noqa: E731
    make, exc = _device_table("query" if arg == "q" else "per_head")[i]
    bad = make(q) if arg == "q" else make(8)
    with pytest.raises(exc, match=rf"^{arg}\b"):
        run(**{arg: bad})


@pytest.mark.gpu
def test_strided_sink_is_refused_not_misread():
    import cupy as cp

    cache, table = _setup_paged()
    dec = cukv.BatchDecode(8, 2, 64, 16, dtype="float16").plan(2, 64)
    sink = cp.arange(16, dtype=cp.float32)[::2]
    with pytest.raises(ValueError, match=r"^sink must be C-contiguous .*cupy\.ascontiguousarray\(sink\)"):
        dec.run(cp.zeros((2, 8, 64), cp.float16), cache, table, sink=sink)
    dec.run(cp.zeros((2, 8, 64), cp.float16), cache, table, sink=cp.ascontiguousarray(sink))


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["argument", "environment"])
def test_checked_mode_refuses_bad_tables(how, monkeypatch):
    import cupy as cp

    cache, good = _setup_paged()
    kw = {"check": True} if how == "argument" else {}
    if how == "environment":
        monkeypatch.setenv("CUKV_CHECK", "1")
    dec = cukv.BatchDecode(8, 2, 64, 16, dtype="float16").plan(2, 64)
    q = cp.zeros((2, 8, 64), cp.float16)
    dec.run(q, cache, good, **kw)  # a good table passes
    bt = good.block_table.get()
    bt[0, 1] = 99
    bad_page = cukv.PageTable(cp.asarray(bt), good.lengths, 16)
    with pytest.raises(ValueError, match=r"^table\.block_table\[0, 1\]=99 is not a page of the cache"):
        dec.run(q, cache, bad_page, **kw)
    too_long = cukv.PageTable(good.block_table, cp.asarray(np.array([65, 5], np.int32)), 16)
    with pytest.raises(ValueError, match=r"^table\.lengths\[0\]=65 needs 5 pages"):
        dec.run(q, cache, too_long, **kw)
    pf = cukv.BatchPrefill(8, 2, 64, 16, dtype="float16").plan(np.array([0, 3, 5]), np.array([20, 4]))
    with pytest.raises(ValueError, match=r"^table\.lengths\[1\]=5, but plan\(\) was given kv_lengths\[1\]=4"):
        pf.run(cp.zeros((5, 8, 64), cp.float16), (cache, good), **kw)
    k = cp.zeros((2, 2, 64), cp.float16)
    with pytest.raises(ValueError, match=r"^slot_mapping\[1\]=128 is not a slot of the cache"):
        cukv.append_kv(cache, k, k, cp.asarray(np.array([0, 128], np.int64)), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["tensor", "token", 32])
def test_dequantize_in_chunks_matches_one_pass(granularity):
    import cupy as cp

    cache = cukv.PagedKVCache(5, 4, 2, 64, dtype="fp8_e4m3", scale_granularity=granularity)
    cache.storage[...] = cp.asarray(np.random.default_rng(0).integers(0, 256, cache.storage.shape, np.uint8))
    if cache.scale_block:
        cache.scale_storage[...] = cp.random.rand(*cache.scale_storage.shape).astype(cp.float32)
    whole = cache.dequantize(1 << 30)
    for chunk in (1, 4 * 4 * 2 * 64 * 2):  # one page, two pages at a time
        for a, b in zip(whole, cache.dequantize(chunk)):
            assert cp.array_equal(a, b)


@pytest.mark.gpu
def test_mla_device_arrays_and_checked_mode():
    """BatchMLADecode.run: bad device arrays name the argument, a strided sink is refused, and the checked mode
    refuses a page id outside the cache (the unchecked kernel reads it as zeros); append_mla's checked slots."""
    import cupy as cp

    cache = cukv.MLAKVCache(num_pages=4, page_size=16, dtype="float16", fill="zeros")
    dec = cukv.BatchMLADecode(8, "float16").plan([20, 5])
    q = cp.zeros((2, 1, 8, 576), cp.float16)
    table = cp.asarray(np.array([[0, 1], [2, 3]], np.int32))
    dec.run(q, cache, table, check=True)
    for arg, bad, exc in [("q", q.astype(cp.float32), TypeError), ("q", q[..., :512], ValueError),
                          ("block_table", table.astype(cp.int64), TypeError),
                          ("sink", cp.zeros(16, cp.float32)[::2], ValueError),
                          ("sink", cp.zeros(8, cp.float16), TypeError),
                          ("out", cp.zeros((2, 1, 8, 512), cp.float32), TypeError)]:
        kw = {"q": q, "block_table": table, arg: bad}
        with pytest.raises(exc, match=rf"^{arg}\b"):
            dec.run(kw.pop("q"), cache, kw.pop("block_table"), **kw)
    bad_table = cp.asarray(np.array([[0, 9], [2, 3]], np.int32))
    with pytest.raises(ValueError, match=r"^block_table\[0, 1\]=9 is not a page of the cache \(0\.\.3\)"):
        dec.run(q, cache, bad_table, check=True)
    dec.run(q, cache, bad_table)  # unchecked: no error (docs/errors.md)
    kv = cp.zeros((2, 512), cp.float16)
    pe = cp.zeros((2, 64), cp.float16)
    with pytest.raises(ValueError, match=r"^slots\[1\]=64 is not a slot of the cache \(0\.\.63"):
        cukv.append_mla(cache, kv, pe, cp.asarray([0, 64]), check=True)
    cukv.append_mla(cache, kv, pe, cp.asarray([0, 64]))  # unchecked: slot 64 is skipped
