"""The decode rings with strips by tensor copies (``BatchDecode(tma=True)``; 16-bit and FP8 caches) on the GPU: against
the float64 reference (NaN-poisoned caches, random page order, uneven and zero lengths, windows, splits; FP8: over the
dequantized cache) and bitwise against the same ring by cp.async (same slot contents, same math: the outputs must be
the same bits)."""
import numpy as np
import pytest

import cukv
from cukv.dtypes import from_storage
from cukv.testing import assert_close, random_decode_case, reference_decode

pytestmark = pytest.mark.gpu


def _pair(case, hq, hkv, d, ps, dtype="bfloat16", stages=3, num_splits=None, cluster_merge=True, max_len=None, gran=None,
          **kw):
    """Runs the cp.async ring and the tensor-copy ring on ``case`` (an FP8 cache of granularity ``gran`` where given);
    asserts they agree bitwise and returns the tensor copies' (out, lse) on the host."""
    import cupy as cp

    b = len(case["lengths"])
    fp8 = {} if gran is None else dict(kv_dtype="fp8_e4m3", scale_granularity=gran)
    got = []
    for tma in (False, True):
        dec = cukv.BatchDecode(hq, hkv, d, ps, dtype, stages=stages, cluster_merge=cluster_merge, tma=tma, **fp8)
        dec.plan(b, max_len or max(1, int(np.max(case["lengths"]))), num_splits=num_splits)
        assert dec.config.tma == tma and dec.config.stages == stages
        out = cp.full(case["q"].shape, np.float16(np.nan) if dtype == "float16" else np.uint16(0x7FC0), case["q"].dtype)
        lse = cp.full((b, hq), np.nan, cp.float32)
        dec.run(case["q"], case["cache"], case["table"], out=out, lse=lse, **kw)
        got.append((out.get(), lse.get()))
    (o0, l0), (o1, l1) = got
    assert np.array_equal(o0.view(np.uint16), o1.view(np.uint16)), "tma and cp.async outputs differ"
    assert np.array_equal(l0, l1, equal_nan=True), "tma and cp.async LSE differ"
    return from_storage(o1, dtype), l1


def _check(rng, lengths, hq, hkv, d, ps, dtype="bfloat16", layout="combined", big_page_ids=False, gran=None, **kw):
    """FP8 (``gran`` given): the reference reads the dequantized cache, with test_fp8_decode_gpu's tolerances."""
    fp8 = {} if gran is None else dict(kv_dtype="fp8_e4m3", scale_granularity=gran)
    case = random_decode_case(rng, batch=len(lengths), lengths=lengths, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                              page_size=ps, dtype=dtype, layout=layout, big_page_ids=big_page_ids, **fp8)
    out, lse = _pair(case, hq, hkv, d, ps, dtype, gran=gran, **kw)
    ref_kw = {k: v for k, v in kw.items() if k in ("window", "softcap", "sm_scale")}
    if "sink" in kw:
        ref_kw["sink"] = kw["sink"].get()
    ref_o, ref_lse = reference_decode(case, **ref_kw)
    tol = 2e-3 if gran is None else 4e-3
    assert_close(out, ref_o, dtype if gran is None else "bfloat16", name="out")
    assert_close(lse, ref_lse, "float32", atol=tol, rtol=tol, name="lse")
    return out, lse


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8, 16])
def test_head_dims_and_groups(rng, d, group):
    # uneven lengths: strips cut by the end go by cp.async, whole ones by tensor copies; one sequence is empty
    _check(rng, [1, 517, 1100, 0, 16, 33], 2 * group, 2, d, 16, stages=2 if d == 256 else 3)


@pytest.mark.parametrize("ps", [16, 48, 64, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_page_sizes(rng, ps, dtype):
    _check(rng, [17, 1, 300, 2049, 64], 32, 8, 128, ps, dtype)


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_ring_depths(rng, stages):
    _check(rng, [4099, 3, 700], 32, 8, 64 if stages == 8 else 128, 16, stages=stages)  # 8 slots fit at d64


@pytest.mark.parametrize("merge", ["cluster", "global"])
@pytest.mark.parametrize("splits", [1, 2, 3, 8, 64])
def test_splits(rng, splits, merge):
    _check(rng, [4099, 3], 8, 2, 128, 16, num_splits=splits, cluster_merge=merge == "cluster")


def test_window_sink_softcap(rng):
    """Windows start mid-strip (the first strip goes by cp.async, masked), sinks and soft-caps change nothing in
    the staging."""
    import cupy as cp

    sink = cp.asarray(rng.standard_normal(16).astype(np.float32) * 3)
    _check(rng, [700, 5, 64, 2000], 16, 2, 128, 16, window=100)
    _check(rng, [700, 5, 64, 2000], 16, 2, 128, 16, window=33, sink=sink, softcap=3.0, num_splits=4)
    _check(rng, [2000, 1, 700], 16, 4, 128, 16, window=900, sink=sink, num_splits=4, cluster_merge=False)


def test_empty_sequences_give_zero_and_neg_inf(rng):
    out, lse = _check(rng, [0, 40, 0], 8, 2, 64, 16, num_splits=3)
    for b in (0, 2):
        assert np.all(out[b] == 0) and np.all(np.isneginf(lse[b]))
    assert np.all(np.isfinite(out[1]))


@pytest.mark.parametrize("layout", ["separate", "combined"])
def test_layouts_and_big_page_ids(rng, layout):
    """Physical pages above 65536 (the tensor map's page coordinate, 64-bit element offsets on the cp.async side)."""
    _check(rng, [300, 41, 2048], 8, 2, 128, 16, layout=layout, big_page_ids=True)


def test_lengths_past_the_planned_max(rng):
    _check(rng, [1000, 300], 8, 2, 128, 16, num_splits=4, max_len=100)


def test_unmapped_page_reads_as_zeros_either_way(rng):
    """A hole in the table (-1) inside a sequence: its strips go by cp.async with zero fill, as without tma."""
    case = random_decode_case(rng, batch=2, lengths=[640, 200], num_qo_heads=8, num_kv_heads=2, head_dim=128,
                              page_size=64)
    bt = case["table"].block_table
    bt[0, 3] = -1
    bt[1, 1] = case["cache"].num_pages + 5  # out of the cache: a hole too
    out, lse = _pair(case, 8, 2, 128, 64, check=False)  # the table is bad on purpose
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))


def test_graph_capture_replay(rng):
    """The tensor maps are kernel arguments: a captured launch keeps them and replays with new lengths."""
    from test_decode_gpu import check_graph_replay

    check_graph_replay(rng, cukv.BatchDecode(16, 4, 128, 16, "bfloat16", stages=3, tma=True))


@pytest.mark.parametrize("batch,ctx", [(1, 512), (64, 4096), (16, 32768), (128, 8192)])
def test_plan_on_bench_cells(batch, ctx):
    """What the probe times: plan() keeps the tensor-copy ring wherever it picks the ring (clusters included) and
    falls back to the register kernel, without tensor copies, where it picks registers."""
    dec = cukv.BatchDecode(32, 8, 128, 16, "bfloat16", tma=True).plan(batch, ctx)
    assert dec.config.tma == (dec.config.stages > 0)
    ref = cukv.BatchDecode(32, 8, 128, 16, "bfloat16").plan(batch, ctx)
    assert (ref.num_splits, ref.config.stages, ref.config.cluster) == (dec.num_splits, dec.config.stages,
                                                                       dec.config.cluster)


# ---- FP8 caches: the FP8 ring (decode.cuh, 2 slots by default) with whole strips by tensor copies, one 128-byte atom per
# row (d128) or two (d256); cut strips and all scales by cp.async

@pytest.mark.parametrize("gran,dtype", [("token", "bfloat16"), ("tensor", "bfloat16"), ("token", "float16")])
def test_fp8_granularities(rng, gran, dtype):
    # uneven lengths: strips cut by the end go by cp.async, whole ones by tensor copies; one sequence is empty
    _check(rng, [1, 517, 1100, 0, 16, 33], 32, 8, 128, 16, dtype, gran=gran, stages=2)


@pytest.mark.parametrize("d,group,ps", [(128, 1, 16), (128, 8, 64), (128, 16, 48), (256, 4, 16)])
def test_fp8_groups_pages_head_dims(rng, d, group, ps):
    _check(rng, [17, 1, 300, 2049, 64], 2 * group, 2, d, ps, gran="token", stages=2)


@pytest.mark.parametrize("merge", ["cluster", "global"])
@pytest.mark.parametrize("splits", [1, 3, 64])
def test_fp8_splits(rng, splits, merge):
    _check(rng, [4099, 3], 32, 8, 128, 16, gran="token", stages=2, num_splits=splits, cluster_merge=merge == "cluster")


def test_fp8_window_sink_softcap_and_late_lengths(rng):
    """Windows start mid-strip (a cut first strip, by cp.async); lengths past the planned max."""
    import cupy as cp

    sink = cp.asarray(rng.standard_normal(32).astype(np.float32) * 3)
    _check(rng, [700, 5, 64, 2000], 32, 8, 128, 16, gran="token", stages=2, window=100)
    _check(rng, [700, 5, 64, 2000], 32, 8, 128, 16, gran="token", stages=2, window=33, sink=sink, softcap=3.0,
           num_splits=4, cluster_merge=False)
    _check(rng, [1000, 300], 32, 8, 128, 16, gran="token", stages=2, num_splits=4, max_len=100)


def test_fp8_layouts_big_page_ids_and_empty(rng):
    out, lse = _check(rng, [0, 300, 41, 2048], 32, 8, 128, 16, layout="separate", big_page_ids=True, gran="token",
                      stages=2)
    assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0])) and np.all(np.isfinite(out[1:]))


def test_fp8_nan_in_unused_slots_and_unmapped_pages(rng):
    """The cache is NaN-poisoned past every sequence's end (codes and scales): cut strips zero-fill them, whole strips
    never reach them. A hole in the table (-1, or a page past the cache) inside a sequence reads as zeros either way."""
    case = random_decode_case(rng, batch=2, lengths=[640, 200], num_qo_heads=16, num_kv_heads=2, head_dim=128,
                              page_size=64, kv_dtype="fp8_e4m3", scale_granularity="token")
    bt = case["table"].block_table
    bt[0, 3] = -1
    bt[1, 1] = case["cache"].num_pages + 5
    out, lse = _pair(case, 16, 2, 128, 64, stages=2, gran="token", check=False)  # the table is bad on purpose
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))


def test_fp8_graph_capture_replay(rng):
    from test_decode_gpu import check_graph_replay

    check_graph_replay(rng, cukv.BatchDecode(16, 4, 128, 16, "bfloat16", kv_dtype="fp8_e4m3", scale_granularity="token",
                                             stages=2, tma=True), kv_dtype="fp8_e4m3", scale_granularity="token")


@pytest.mark.parametrize("batch,ctx", [(1, 512), (64, 4096), (16, 32768), (128, 8192)])
def test_fp8_plan_on_bench_cells(batch, ctx):
    """What the probe times (--kv-dtype fp8_e4m3): plan() keeps the tensor copies wherever it picks the FP8 ring (the
    split count may differ: it follows each kernel's registers, hence its blocks per SM)."""
    fp8 = dict(kv_dtype="fp8_e4m3", scale_granularity="token")
    dec = cukv.BatchDecode(32, 8, 128, 16, "bfloat16", tma=True, **fp8).plan(batch, ctx)
    assert dec.config.tma == (dec.config.stages > 0)
    ref = cukv.BatchDecode(32, 8, 128, 16, "bfloat16", **fp8).plan(batch, ctx)
    assert (ref.config.stages, ref.config.cluster) == (dec.config.stages, dec.config.cluster)
