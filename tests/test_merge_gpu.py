"""merge_states / merge_states_n on the GPU against the float64 reference (cukv.reference.merge_states):
random states, empty (-inf) partitions holding NaN, all-empty rows, bf16/fp16/fp32, N = 1..5, strided
stacks, preallocated outputs, streams, CUDA-graph capture, and argument errors."""
import numpy as np
import pytest

from cukv import reference
from cukv.dtypes import from_storage, to_storage
from cukv.ops.merge import merge_states, merge_states_n
from cukv.testing import assert_close, capture, replay

pytestmark = pytest.mark.gpu

DTYPES = ("bfloat16", "float16", "float32")


def _store(x, dtype):
    return np.asarray(x, np.float32) if dtype == "float32" else to_storage(x, dtype)


def _host(a, dtype):
    a = a.get() if hasattr(a, "get") else a
    return np.asarray(a, np.float64) if dtype == "float32" else from_storage(a, dtype)


def _states(rng, n, t, h, d, dtype, p_empty=0.3, spread=4.0):
    """Host storage arrays v[n, t, h, d] and s[n, t, h]; empty partitions have s = -inf and NaN values."""
    v = rng.standard_normal((n, t, h, d)).astype(np.float32)
    s = (rng.standard_normal((n, t, h)) * spread).astype(np.float32)
    empty = rng.random((n, t, h)) < p_empty
    s[empty] = -np.inf
    v[empty] = np.nan  # never to be read
    if t * h:
        s[:, 0, 0] = -np.inf  # at least one row where every partition is empty
        v[:, 0, 0] = np.nan
    return _store(v, dtype), s


def _reference(v, s, dtype):
    vh = _host(v, dtype)
    return reference.merge_states(list(vh), list(np.asarray(s, np.float64)))


def _check(out, lse, v, s, dtype):
    ref_o, ref_l = _reference(v, s, dtype)
    o = _host(out, dtype)
    assert not np.isnan(o).any(), "NaN from an empty partition reached the output"
    assert_close(o, ref_o, dtype, name="v")
    assert_close(lse.get(), ref_l, "float32", atol=1e-5, rtol=1e-5, name="s")
    empty = np.isneginf(ref_l)
    assert (o[empty] == 0).all() and np.isneginf(lse.get()[empty]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_merge_n_matches_reference(rng, dtype, n, d):
    import cupy as cp

    v, s = _states(rng, n, 37, 8, d, dtype)
    out, lse = merge_states_n(cp.asarray(v), cp.asarray(s))
    assert out.shape == (37, 8, d) and out.dtype == cp.asarray(v).dtype
    assert lse.shape == (37, 8) and lse.dtype == cp.float32
    _check(out, lse, v, s, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 80, 96, 128, 192, 256, 512])
def test_merge_two_matches_reference_and_the_stacked_form(rng, dtype, d):
    import cupy as cp

    v, s = _states(rng, 2, 19, 5, d, dtype)
    vb, sb = cp.asarray(v[1]), cp.asarray(s[1])  # allocated first: b sits below a (a negative state stride)
    va, sa = cp.asarray(v[0]), cp.asarray(s[0])
    out, lse = merge_states(va, sa, vb, sb)
    _check(out, lse, v, s, dtype)
    out2, lse2 = merge_states(vb, sb, va, sa)  # and the other order
    _check(out2, lse2, v[::-1], s[::-1], dtype)
    # one algorithm, one order of operations: the stacked form gives the same bits
    out_n, lse_n = merge_states_n(cp.asarray(v), cp.asarray(s))
    assert cp.array_equal(out.view(cp.uint8), out_n.view(cp.uint8))
    assert cp.array_equal(lse, lse_n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_lse_spread_and_one_partition(rng, dtype):
    import cupy as cp

    v, s = _states(rng, 3, 64, 4, 128, dtype, p_empty=0.2, spread=60.0)  # weights down to e^-300: underflow to 0
    out, lse = merge_states_n(cp.asarray(v), cp.asarray(s))
    _check(out, lse, v, s, dtype)
    one_v, one_s = _states(rng, 1, 10, 3, 64, dtype)
    out, lse = merge_states_n(cp.asarray(one_v), cp.asarray(one_s))  # N = 1 copies, empty rows become 0
    _check(out, lse, one_v, one_s, dtype)


def test_all_empty(rng):
    import cupy as cp

    v = cp.full((2, 6, 4, 64), np.nan, cp.float16)
    s = cp.full((2, 6, 4), -np.inf, cp.float32)
    out, lse = merge_states_n(v, s)
    assert (out == 0).all() and cp.isneginf(lse).all()
    out, lse = merge_states(v[0], s[0], v[1], s[1])
    assert (out == 0).all() and cp.isneginf(lse).all()


def test_many_rows_use_the_grid_stride_loop(rng):
    import cupy as cp

    v, s = _states(rng, 2, 20000, 16, 64, "bfloat16", p_empty=0.1)  # 320k rows, more than one grid's worth
    out, lse = merge_states_n(cp.asarray(v), cp.asarray(s))
    _check(out, lse, v, s, "bfloat16")


def test_empty_batch(rng):
    import cupy as cp

    out, lse = merge_states_n(cp.zeros((3, 0, 8, 128), cp.uint16), cp.zeros((3, 0, 8), cp.float32))
    assert out.shape == (0, 8, 128) and lse.shape == (0, 8)


def test_strided_stacks(rng):
    """A slice of a bigger stack (state stride larger than a state) and a reversed stack (negative stride)."""
    import cupy as cp

    v, s = _states(rng, 4, 30, 4, 128, "float16")
    big_v = cp.full((4, 50, 4, 128), np.nan, cp.float16)
    big_s = cp.full((4, 50, 4), np.nan, cp.float32)
    big_v[:, 7:37] = cp.asarray(v)
    big_s[:, 7:37] = cp.asarray(s)
    out, lse = merge_states_n(big_v[:, 7:37], big_s[:, 7:37])
    _check(out, lse, v, s, "float16")
    out, lse = merge_states_n(cp.asarray(v)[::-1], cp.asarray(s)[::-1])
    _check(out, lse, v[::-1], s[::-1], "float16")


def test_preallocated_outputs_and_stream(rng):
    import cupy as cp

    v, s = _states(rng, 3, 9, 8, 128, "bfloat16")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:  # everything on one stream that does not wait for the default one
        out = cp.full((9, 8, 128), 0x7FC0, cp.uint16)
        lse = cp.full((9, 8), np.nan, cp.float32)
        vd, sd = cp.asarray(v), cp.asarray(s)
    got_o, got_l = merge_states_n(vd, sd, out=out, lse=lse, stream=stream)
    stream.synchronize()
    assert got_o is out and got_l is lse
    _check(out, lse, v, s, "bfloat16")


def test_repeat_runs_bit_identical(rng):
    import cupy as cp

    v, s = _states(rng, 5, 33, 8, 128, "bfloat16")
    vd, sd = cp.asarray(v), cp.asarray(s)
    a = merge_states_n(vd, sd)
    b = merge_states_n(vd, sd)
    assert cp.array_equal(a[0], b[0]) and cp.array_equal(a[1], b[1])


def test_graph_capture_replay(rng):
    import cupy as cp

    v, s = _states(rng, 2, 16, 8, 128, "float16")
    va, sa, vb, sb = (cp.asarray(x) for x in (v[0], s[0], v[1], s[1]))
    out = cp.empty((16, 8, 128), cp.float16)
    lse = cp.empty((16, 8), cp.float32)
    graph, stream = capture(lambda s: merge_states(va, sa, vb, sb, out=out, lse=lse, stream=s))
    for _ in range(2):
        v2, s2 = _states(rng, 2, 16, 8, 128, "float16")
        with stream:  # the new inputs and the poisoned output are ordered before the replay
            for dst, src in ((va, v2[0]), (sa, s2[0]), (vb, v2[1]), (sb, s2[1])):
                dst.set(src, stream=stream)
            out.fill(np.nan)
        replay(graph, stream)
        _check(out, lse, v2, s2, "float16")


def test_torch_bf16_tensors(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    v, s = _states(rng, 2, 8, 4, 128, "float32")
    tv = torch.from_numpy(np.ascontiguousarray(v)).cuda().to(torch.bfloat16)
    ts = torch.from_numpy(s).cuda()
    out, lse = merge_states(tv[0], ts[0], tv[1], ts[1])
    stored = to_storage(v, "bfloat16")  # what the bf16 tensors hold
    _check(out, lse, stored, s, "bfloat16")


# ----------------------------------------------------------------------------------------------
# argument errors


def _pair(dtype="float16", t=4, h=2, d=64):
    import cupy as cp

    dt = {"float16": cp.float16, "float32": cp.float32, "bfloat16": cp.uint16}[dtype]
    return cp.zeros((t, h, d), dt), cp.zeros((t, h), cp.float32)


def test_errors_name_argument_value_and_accepted():
    import cupy as cp

    va, sa = _pair()
    vb, sb = _pair()
    with pytest.raises(TypeError, match=r"v_b is bfloat16; v_a is float16"):
        merge_states(va, sa, _pair("bfloat16")[0], sb)
    with pytest.raises(TypeError, match=r"v_a has dtype int32; accepted: bfloat16 .* float16, float32"):
        merge_states(va.astype(cp.int32), sa, vb, sb)
    with pytest.raises(TypeError, match=r"s_b has dtype float64; accepted: float32"):
        merge_states(va, sa, vb, sb.astype(cp.float64))
    with pytest.raises(ValueError, match=r"v_a has shape \(4, 128\); expected \[tokens, heads, head_dim\]"):
        merge_states(va.reshape(4, 128), sa, vb, sb)
    with pytest.raises(ValueError, match=r"v_b has shape \(4, 2, 32\); expected \[4, 2, 64\]"):
        merge_states(va, sa, vb[..., :32].copy(), sb)
    with pytest.raises(ValueError, match=r"s_a has shape \(4, 3\); expected \[4, 2\]"):
        merge_states(va, cp.zeros((4, 3), cp.float32), vb, sb)
    with pytest.raises(ValueError, match=r"v_a must be C-contiguous"):
        merge_states(cp.zeros((2, 4, 64), cp.float16).transpose(1, 0, 2), sa, vb, sb)
    with pytest.raises(ValueError, match=r"MergeConfig.head_dim=12 is not valid: must be a multiple of 8 for float16"):
        merge_states(*_pair(d=12), *_pair(d=12))
    buf = cp.zeros(4 * 2 * 64 + 1, cp.float16)
    with pytest.raises(ValueError, match=r"v_a starts at device address .* not 16-byte aligned"):
        merge_states(buf[1:].reshape(4, 2, 64), sa, vb, sb)
    with pytest.raises(ValueError, match=r"out must be a C-contiguous float16 array .* of shape \[4, 2, 64\]"):
        merge_states(va, sa, vb, sb, out=cp.zeros((4, 2, 64), cp.float32))
    with pytest.raises(ValueError, match=r"lse must be a C-contiguous float32 array of shape \[4, 2\]"):
        merge_states(va, sa, vb, sb, lse=cp.zeros((4, 2), cp.float16))
    with pytest.raises(ValueError, match=r"out overlaps v_a; merge_states cannot work in place"):
        merge_states(va, sa, vb, sb, out=va)
    with pytest.raises(ValueError, match=r"lse overlaps s_b"):
        merge_states(va, sa, vb, sb, lse=sb)
    with pytest.raises(ValueError, match=r"vs has 0 states .*; accepted: 1 or more"):
        merge_states_n(cp.zeros((0, 4, 2, 64), cp.float16), cp.zeros((0, 4, 2), cp.float32))
    with pytest.raises(ValueError, match=r"vs has shape \(4, 2, 64\); expected \[num_states, tokens, heads, head_dim\]"):
        merge_states_n(va, sa)
    with pytest.raises(ValueError, match=r"ss has shape \(2, 4, 3\); expected \[2, 4, 2\]"):
        merge_states_n(cp.zeros((2, 4, 2, 64), cp.float16), cp.zeros((2, 4, 3), cp.float32))
    with pytest.raises(ValueError, match=r"vs must be C-contiguous within each state"):
        merge_states_n(cp.zeros((2, 2, 4, 64), cp.float16).transpose(0, 2, 1, 3), cp.zeros((2, 4, 2), cp.float32))
