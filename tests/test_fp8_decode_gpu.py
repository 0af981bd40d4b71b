"""Decode over FP8 e4m3 caches on the GPU.

Tolerances are bf16's for both query dtypes. With an FP8 cache P.V runs in f16 whatever the query dtype (P times
the V scale over a power-of-two bound, rounded to f16), and the register kernel's
scores run in the query dtype; the tolerance was not tightened when P.V moved to f16.

Two references: the float64 decode over the *dequantized* cache (``e4m3 * scale`` exactly), which the kernel
must match to bf16/fp16 level (it rounds each dequantized value once to the query dtype before the mma),
and the float64 decode over the *unquantized* tokens, which it matches only to the quantization error
(documented tolerance: 0.1 absolute/relative on outputs of unit scale; e4m3 keeps 3 mantissa bits, so each
value is within 6.25% and the errors average out over the context).
"""
import numpy as np
import pytest

import cukv
from cukv import reference
from cukv.dtypes import from_storage
from cukv.testing import assert_close, random_decode_case, reference_decode, replay

pytestmark = pytest.mark.gpu

GRANULARITIES = ["token", "tensor", 32, 64, 128]
STAGING = {"registers": 0, "ring": 2}  # 2: the shipped default ring depth
_stages = {"now": 0}


@pytest.fixture(params=sorted(STAGING), autouse=True)
def staging(request):
    """Every test runs on both FP8 stagings: loads straight into registers, and the shared-memory ring
    (plan would pick registers for these small problems, so the ring is forced)."""
    _stages["now"] = STAGING[request.param]
    return STAGING[request.param]


def _run(case, hq, hkv, d, ps, dtype, gran, num_splits=None, **kw):
    import cupy as cp

    b = len(case["lengths"])
    dec = cukv.BatchDecode(hq, hkv, d, ps, dtype, kv_dtype="fp8_e4m3", scale_granularity=gran, stages=_stages["now"])
    dec.plan(b, max(1, int(case["lengths"].max())), num_splits=num_splits)
    out = cp.full(case["q"].shape, np.float16(np.nan) if dtype == "float16" else np.uint16(0x7FC0), case["q"].dtype)
    lse = cp.full((b, hq), np.nan, cp.float32)
    dec.run(case["q"], case["cache"], case["table"], out=out, lse=lse, **kw)
    return from_storage(out.get(), dtype), lse.get()


def _case(rng, lengths, hq, hkv, d, ps, dtype, gran, **kw):
    return random_decode_case(rng, batch=len(lengths), lengths=lengths, num_qo_heads=hq, num_kv_heads=hkv,
                              head_dim=d, page_size=ps, dtype=dtype, kv_dtype="fp8_e4m3", scale_granularity=gran, **kw)


def _check(rng, lengths, hq, hkv, d, ps, dtype="bfloat16", gran="token", num_splits=None, **kw):
    case = _case(rng, lengths, hq, hkv, d, ps, dtype, gran)
    out, lse = _run(case, hq, hkv, d, ps, dtype, gran, num_splits=num_splits, **kw)
    ref_o, ref_lse = reference_decode(case, **kw)
    assert_close(out, ref_o, "bfloat16", name="out vs dequantized reference")
    assert_close(lse, ref_lse, "float32", atol=4e-3, rtol=4e-3, name="lse vs dequantized reference")
    return case, out


@pytest.mark.parametrize("gran", GRANULARITIES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_granularities(rng, gran, dtype):
    _check(rng, [1, 517, 1100, 33], 32, 8, 128, 16, dtype, gran)


@pytest.mark.parametrize("d,gran", [(64, "token"), (64, 32), (96, "token"), (96, 32), (256, "token"), (256, 64),
                                    (256, "tensor")])
@pytest.mark.parametrize("group", [1, 4, 6, 16])
def test_head_dims_and_groups(rng, d, gran, group):
    try:
        cukv.BatchDecode(group * 2, 2, d, 16, "bfloat16", kv_dtype="fp8_e4m3", scale_granularity=gran,
                         stages=_stages["now"])
    except ValueError as e:  # the register kernel spilled there (test_configs pins where): outside the domain
        assert "DecodeConfig.stages=0 is not valid" in str(e), e
        pytest.skip(str(e))
    _check(rng, [3, 700, 1500], group * 2, 2, d, 16, "bfloat16", gran)


@pytest.mark.parametrize("ps", [1, 16, 48, 256])
def test_page_sizes_and_splits(rng, ps):
    _check(rng, [17, 1, 300, 4099], 32, 8, 128, ps, "bfloat16", 64)
    _check(rng, [4099, 3], 8, 2, 128, ps, "bfloat16", "token", num_splits=7)


def test_sink_window_softcap(rng):
    import cupy as cp

    sink = cp.asarray(rng.standard_normal(16).astype(np.float32))
    case = _case(rng, [900, 40, 2000], 16, 4, 128, 16, "bfloat16", 32)
    out, lse = _run(case, 16, 4, 128, 16, "bfloat16", 32, sink=sink, window=300, softcap=20.0)
    ref_o, ref_lse = reference_decode(case, sink=sink.get(), window=300, softcap=20.0)
    assert_close(out, ref_o, "bfloat16")
    assert_close(lse, ref_lse, "float32", atol=4e-3, rtol=4e-3)


def test_close_to_unquantized(rng):
    """Against the float64 decode of the tokens before quantization: the quantization error only."""
    case, out = _check(rng, [2000, 777], 16, 4, 128, 16, "bfloat16", 32)
    lengths = case["lengths"]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    compact = np.zeros((len(lengths), int(lengths.max())), np.int64)
    for b, n in enumerate(lengths):
        compact[b, :n] = np.arange(starts[b], starts[b] + n)
    ref_o, _ = reference.decode(case["q_host"], case["k_new"][:, None], case["v_new"][:, None], compact, lengths)
    ref_o = ref_o / np.maximum(1.0, np.abs(ref_o).max())  # outputs of unit scale: V magnitudes vary per token
    got = out / np.maximum(1.0, np.abs(out).max())
    assert_close(got, ref_o, "bfloat16", atol=0.1, rtol=0.1, name="out vs unquantized reference")


def test_graph_capture_replay_and_repeat(rng):
    import cupy as cp

    case = _case(rng, [600, 1000, 33, 999], 16, 4, 128, 16, "bfloat16", "tensor")
    dec = cukv.BatchDecode(16, 4, 128, 16, "bfloat16", kv_dtype="fp8_e4m3", scale_granularity="tensor",
                           stages=_stages["now"]).plan(4, 1000)
    out = cp.empty(case["q"].shape, case["q"].dtype)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        dec.run(case["q"], case["cache"], case["table"], out=out, stream=stream)
        first = out.copy()
        dec.run(case["q"], case["cache"], case["table"], out=out, stream=stream)
        stream.synchronize()
        assert np.array_equal(first.get(), out.get()), "repeat runs must be bit-identical"
        stream.begin_capture()
        dec.run(case["q"], case["cache"], case["table"], out=out, stream=stream)
        graph = stream.end_capture()
    for new_lengths in ([1, 700, 17, 2], [600, 999, 33, 998]):
        case["table"].lengths.set(np.asarray(new_lengths, np.int32))
        case["lengths"] = np.asarray(new_lengths)
        out.fill(0)
        replay(graph, stream)
        ref_o, _ = reference_decode(case)
        assert_close(from_storage(out.get(), "bfloat16"), ref_o, "bfloat16")


def test_mismatched_cache_is_rejected(rng):
    case = _case(rng, [20], 8, 2, 128, 16, "bfloat16", 64)
    dec = cukv.BatchDecode(8, 2, 128, 16, "bfloat16", kv_dtype="fp8_e4m3", scale_granularity="token").plan(1, 20)
    with pytest.raises(ValueError, match="scale block"):
        dec.run(case["q"], case["cache"], case["table"])


def test_one_shot_decode_infers_fp8(rng):
    case = _case(rng, [300, 5], 8, 2, 64, 16, "float16", 32)
    out = cukv.decode(case["q"], case["cache"], case["table"])
    ref_o, _ = reference_decode(case)
    assert_close(from_storage(out.get(), "float16"), ref_o, "bfloat16")
