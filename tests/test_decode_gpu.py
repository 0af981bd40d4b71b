"""Decode on the GPU against the float64 reference (NaN-poisoned caches, random page order)."""
import numpy as np
import pytest

import cukv
from cukv.dtypes import from_storage
from cukv.testing import assert_close, capture, random_decode_case, reference_decode, replay

pytestmark = pytest.mark.gpu

STAGING = {"registers": 0, "ring": 3}


@pytest.fixture(params=sorted(STAGING), autouse=True)
def staging(request):
    """Every test runs on both kernels: strips staged in registers and through the shared-memory ring (plan
    would pick registers for these small problems, so the ring is forced where it applies)."""
    return STAGING[request.param]


def _decoder(num_qo_heads, num_kv_heads, head_dim, page_size, dtype, stages, cluster_merge=True):
    if stages and (page_size % 16 or head_dim % 64):
        pytest.skip("the shared-memory ring needs page_size % 16 == 0 and head_dim % 64 == 0")
    return cukv.BatchDecode(num_qo_heads, num_kv_heads, head_dim, page_size, dtype, stages=stages,
                            cluster_merge=cluster_merge)


def _run(case, num_qo_heads, num_kv_heads, head_dim, page_size, dtype, num_splits=None, **kw):
    import cupy as cp

    b = len(case["lengths"])
    dec = _decoder(num_qo_heads, num_kv_heads, head_dim, page_size, dtype, _run.stages, _run.cluster_merge)
    dec.plan(b, max(1, int(case["lengths"].max())), num_splits=num_splits)
    out = cp.full(case["q"].shape, np.float16(np.nan) if dtype == "float16" else np.uint16(0x7FC0), case["q"].dtype)
    lse = cp.full((b, num_qo_heads), np.nan, cp.float32)
    dec.run(case["q"], case["cache"], case["table"], out=out, lse=lse, **kw)
    return from_storage(out.get(), dtype), lse.get()


@pytest.fixture(autouse=True)
def _set_stages(staging):
    _run.stages = staging
    _run.cluster_merge = True


def _check(rng, batch, lengths, hq, hkv, d, ps, dtype="bfloat16", num_splits=None, **kw):
    case = random_decode_case(rng, batch=batch, lengths=lengths, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                              page_size=ps, dtype=dtype)
    out, lse = _run(case, hq, hkv, d, ps, dtype, num_splits=num_splits, **kw)
    ref_o, ref_lse = reference_decode(case, **{k: v for k, v in kw.items() if k != "sink"},
                                      **({"sink": kw["sink"].get()} if "sink" in kw else {}))
    assert_close(out, ref_o, dtype, name="out")
    assert_close(lse, ref_lse, "float32", atol=2e-3, rtol=2e-3, name="lse")


@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 4, 6, 8, 16])
def test_head_dims_and_groups(rng, d, group):
    _check(rng, 3, [1, 517, 1100], group * 2, 2, d, 16)


@pytest.mark.parametrize("ps", [1, 16, 64, 256, 48, 1024])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_page_sizes(rng, ps, dtype):
    _check(rng, 4, [17, 1, 300, 2049], 32, 8, 128, ps, dtype)


@pytest.mark.parametrize("batch,ctx", [(1, 1), (7, 17), (64, 512), (1, 33000), (257, 17)])
def test_batch_context(rng, batch, ctx):
    lengths = rng.integers(max(1, ctx // 2), ctx + 1, size=batch)
    lengths[0] = ctx
    _check(rng, batch, lengths, 32, 8, 128, 16)


@pytest.mark.parametrize("merge", ["cluster", "global"])
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 8, 64])
def test_forced_splits(rng, splits, merge):
    """2..8 splits merge in a thread-block cluster unless cluster_merge=False; both paths against the reference."""
    _run.cluster_merge = merge == "cluster"
    _check(rng, 2, [4099, 3], 8, 2, 128, 16, num_splits=splits)


@pytest.mark.parametrize("merge", ["cluster", "global"])
def test_split_merges_with_sink_window_lse(rng, merge):
    import cupy as cp

    _run.cluster_merge = merge == "cluster"
    sink = cp.asarray(rng.normal(size=16).astype(np.float32))
    _check(rng, 3, [2000, 1, 700], 16, 4, 128, 16, num_splits=4, sink=sink, window=900)


def test_lengths_past_the_planned_max(rng, staging):
    """plan() sizes the splits from max_kv_len; a longer sequence is still attended in full (the last split
    takes the rest), never truncated."""
    import cupy as cp

    case = random_decode_case(rng, batch=2, lengths=[1000, 300], num_qo_heads=8, num_kv_heads=2, head_dim=128,
                              page_size=16)
    dec = _decoder(8, 2, 128, 16, "bfloat16", staging).plan(2, 100, num_splits=4)
    out = dec.run(case["q"], case["cache"], case["table"])
    ref_o, _ = reference_decode(case)
    assert_close(from_storage(cp.asnumpy(out), "bfloat16"), ref_o, "bfloat16")


def test_sink_window_softcap(rng):
    import cupy as cp

    sink = cp.asarray(rng.standard_normal(16).astype(np.float32) * 3)
    _check(rng, 3, [700, 5, 64], 16, 2, 128, 16, sink=sink)
    _check(rng, 3, [700, 5, 64], 16, 2, 128, 16, window=100)
    _check(rng, 3, [700, 5, 64], 16, 2, 128, 16, softcap=5.0)
    _check(rng, 3, [700, 5, 64], 16, 2, 128, 16, sink=sink, window=33, softcap=3.0, num_splits=4)


def test_empty_sequence_gives_zero_and_neg_inf(rng):
    case = random_decode_case(rng, batch=2, lengths=[0, 40], num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    for splits in (1, 3):
        out, lse = _run(case, 8, 2, 64, 16, "bfloat16", num_splits=splits)
        assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0]))
        assert np.all(np.isfinite(out[1]))


def test_big_page_ids(rng):
    _check_big = random_decode_case(rng, batch=2, lengths=[300, 41], num_qo_heads=4, num_kv_heads=1, head_dim=64,
                                    page_size=1, big_page_ids=True)
    out, lse = _run(_check_big, 4, 1, 64, 1, "bfloat16")
    ref_o, ref_lse = reference_decode(_check_big)
    assert_close(out, ref_o, "bfloat16")


def test_plan_picks_staging_by_size():
    from cukv.device import device_name
    from cukv.policy.decode import kv_bytes, ring_min_bytes

    regs = kv_bytes(32, 512, 8, 128) < ring_min_bytes(device_name())  # this GPU stages small steps in registers
    dec = cukv.BatchDecode(32, 8, 128, 16, "bfloat16")
    assert (dec.plan(32, 512).config.stages == 0) == regs and dec.config.cluster == 0
    assert dec.plan(64, 4096).config.stages > 0
    # a small step whose pairs x splits fit one block per SM: clustered splits through the ring
    assert dec.plan(1, 512).config.cluster == 8 == dec.num_splits and dec.config.stages > 0
    assert dec.plan(8, 512).config.cluster == 2
    flat = cukv.BatchDecode(32, 8, 128, 16, "bfloat16", cluster_merge=False).plan(1, 512)
    assert flat.config.cluster == 0 and (flat.config.stages == 0) == regs
    assert cukv.BatchDecode(32, 8, 128, 16, "bfloat16", stages=2).plan(1, 512).config.stages == 2
    assert cukv.BatchDecode(32, 8, 96, 16, "bfloat16").plan(64, 4096).config.stages == 0  # no ring for d96


def test_repeat_runs_bit_identical(rng):
    case = random_decode_case(rng, batch=5, lengths=[3000, 20, 900, 1, 4099], num_qo_heads=32, num_kv_heads=8,
                              head_dim=128, page_size=16)
    a = _run(case, 32, 8, 128, 16, "bfloat16")
    b = _run(case, 32, 8, 128, 16, "bfloat16")
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_append_exact(rng):
    import cupy as cp

    case = random_decode_case(rng, batch=3, lengths=[40, 1, 17], num_qo_heads=8, num_kv_heads=2, head_dim=128,
                              page_size=16)
    cache, slots = case["cache"], case["slots"]
    k = from_storage(cache.k.get(), "bfloat16")
    ps = cache.page_size
    got = k[slots // ps, slots % ps]
    assert np.array_equal(got, case["k_new"])
    # slot -1 and out-of-range slots are skipped: nothing else changes
    before = cache.k.get().copy()
    kn = cp.asarray(np.full((2, 2, 128), 0x3F80, np.uint16))
    cukv.append_kv(cache, kn, kn, cp.asarray(np.array([-1, cache.num_slots + 5], np.int64)))
    assert np.array_equal(before.view(np.uint16), cache.k.get().view(np.uint16))


def test_graph_capture_replay(rng, staging):
    check_graph_replay(rng, _decoder(16, 4, 128, 16, "bfloat16", staging))


def check_graph_replay(rng, dec, kv_dtype=None, scale_granularity=None):
    """``dec`` (16/4 heads, d128, page 16, bf16; an FP8 cache of that granularity where ``kv_dtype`` says so) captured
    once in a CUDA graph, replayed after new lengths."""
    import cupy as cp

    case = random_decode_case(rng, batch=4, lengths=[600, 1000, 33, 999], num_qo_heads=16, num_kv_heads=4,
                              head_dim=128, page_size=16, kv_dtype=kv_dtype, scale_granularity=scale_granularity)
    lse_tol = 2e-3 if kv_dtype is None else 4e-3  # test_fp8_decode_gpu's
    dec.plan(4, 1000)
    out = cp.empty(case["q"].shape, case["q"].dtype)
    lse = cp.empty((4, 16), cp.float32)
    graph, stream = capture(lambda s: dec.run(case["q"], case["cache"], case["table"], out=out, lse=lse, stream=s))
    # new lengths stay within the tokens each sequence had appended (beyond them the table maps nothing)
    for new_lengths in ([600, 1000, 33, 999], [1, 700, 17, 2], [600, 999, 33, 998]):
        case["table"].lengths.set(np.asarray(new_lengths, np.int32))
        case["lengths"] = np.asarray(new_lengths)
        out.fill(0)
        replay(graph, stream)
        ref_o, ref_lse = reference_decode(case)
        assert_close(from_storage(out.get(), "bfloat16"), ref_o, "bfloat16")
        assert_close(lse.get(), ref_lse, "float32", atol=lse_tol, rtol=lse_tol)


def test_misaligned_query_is_refused(rng):
    import cupy as cp

    case = random_decode_case(rng, batch=2, lengths=[40, 7], num_qo_heads=8, num_kv_heads=2, head_dim=128,
                              page_size=16, dtype="bfloat16")
    dec = cukv.BatchDecode(8, 2, 128, 16, "bfloat16").plan(2, 64)
    flat = cp.empty(case["q"].size + 8, case["q"].dtype)
    q = flat[1:1 + case["q"].size].reshape(case["q"].shape)  # contiguous, 2 bytes past a 16-byte boundary
    q[...] = case["q"]
    with pytest.raises(ValueError, match="q starts at device address .* not 16-byte aligned"):
        dec.run(q, case["cache"], case["table"])
