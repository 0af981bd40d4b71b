"""Absorbed MLA decode under both consumer schedules (MLADecodeConfig.schedule: "split", "alternate") and the
alternating one over per-slice ring barriers (MLADecodeConfig.slice_release) on the GPU, against the float64
reference: a representative subset of tests/test_mla_decode_gpu.py (heads 16/64/128, s_q 1/2, contexts 1/140/4096
and tile counts odd and even, pages 64 and 16 (tensor copies) and 48 (cp.async), zero-length rows, NaN in unused
slots and pages, garbage past each table row), plus the variants against each other, repeat runs and graph replay."""
import numpy as np
import pytest

from cukv.testing import replay

from test_mla_decode_gpu import _to_host, make_problem, run_check

pytestmark = pytest.mark.gpu

SCHEDULES = ["split", "alternate", "slices"]  # "slices": schedule="alternate", slice_release=True


def _kw(schedule):
    # explicit slice_release: from 128 heads the policy turns it on by default
    return ({"schedule": "alternate", "slice_release": True} if schedule == "slices"
            else {"schedule": schedule, "slice_release": False})

CASES = [  # (lens, s_q, heads, page_size)
    ([1], 1, 16, 64),                    # one tile: warpgroup 1 only takes P
    ([140, 0, 20], 2, 16, 16),           # 3 tiles (a pair and a last odd tile), an empty row, 1 tile
    ([65, 128, 64, 0], 1, 128, 64),      # 2 tiles (the second holds 1 token), 2 full tiles, 1 tile, empty
    ([4096, 140, 0], 1, 64, 64),
    ([4096, 1], 2, 128, 16),
    ([140, 4096], 2, 64, 16),
    ([20] * 40 + [4096], 1, 16, 64),     # many short rows beside one split long one
    ([4096, 140, 0, 65], 2, 128, 48),    # page 48: every tile by cp.async (whole-tile arrivals on every slice)
]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("lens,s_q,heads,page_size", CASES, ids=lambda x: str(x)[:20])
def test_schedule_grid(rng, schedule, lens, s_q, heads, page_size):
    dec, *_ = run_check(rng, lens, s_q, heads, page_size, **_kw(schedule))
    assert dec.config.schedule == _kw(schedule)["schedule"]
    assert dec.config.slice_release == (schedule == "slices")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_schedule_sink_scale_dtype(rng, schedule, dtype):
    run_check(rng, [700, 0, 65], 2, 16, 16, dtype=dtype, sink=True, scale=0.1, **_kw(schedule))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_small_tiles(rng, schedule):
    run_check(rng, [3000, 0, 33], 2, 16, 16, block_n=32, num_kv_stages=4, sink=True, **_kw(schedule))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("chunk_tiles", [1, 2, 3])
def test_schedule_chunks_through_the_combine(rng, schedule, chunk_tiles):
    """Chunks of 1, 2 and 3 tiles (an odd last tile in every chunk, or none): partials merged by the combine."""
    dec, *_ = run_check(rng, [4096, 300, 0], 2, 64, 64, sink=True, plan_kw={"chunk_tiles": chunk_tiles},
                        **_kw(schedule))
    assert dec.chunk_tiles == chunk_tiles and dec.num_items > 3


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_schedule_growing_scores(rng, schedule, dtype):
    """Keys whose norm grows 30x along each sequence: the running max passes the lazy rescale's bound many times a
    row, so every rescale path runs (with per-slice barriers at 64-token tiles: warpgroup 1's P0 V before its P1 V,
    O moved between the two, where P1's max passes P0's)."""
    ramp = 30.0  # outputs up to 31x the usual: the tolerance with them
    atol = (2e-2 if dtype == "bfloat16" else 4e-3) * (1 + ramp)
    run_check(rng, [4096, 700, 65, 0], 2, 128, 64, dtype, ramp=ramp, atol=atol, **_kw(schedule))


@pytest.mark.parametrize("other", ["alternate", "slices"])
def test_alternate_matches_split(rng, other):
    """The same inputs through two schedules: outputs within bf16 rounding, LSE within float32 noise."""
    from cukv.ops.mla_decode import BatchMLADecode

    lens = [5000, 0, 77, 1, 640]
    cache, table, q, *_ = make_problem(rng, lens, 2, 128, 64)
    outs = {}
    for schedule in ("split", other):
        dec = BatchMLADecode(128, **_kw(schedule)).plan(lens, 2)
        outs[schedule] = dec.run(q, cache, table, return_lse=True)
    (a, la), (b, lb) = outs["split"], outs[other]
    np.testing.assert_allclose(_to_host(b, "bfloat16"), _to_host(a, "bfloat16"), atol=1e-2, rtol=1e-2)
    la, lb = la.get(), lb.get()
    assert np.array_equal(np.isinf(la), np.isinf(lb))
    np.testing.assert_allclose(lb[np.isfinite(la)], la[np.isfinite(la)], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("schedule", ["alternate", "slices"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_alternate_q_split_and_repeat(rng, schedule, page_size):
    """q_nope + q_pe give the same bits as q; repeated runs are bit-identical (the handover is deterministic)."""
    import cupy as cp

    from cukv.ops.mla_decode import BatchMLADecode

    lens = [3000, 5, 0, 900]
    cache, table, q, *_ = make_problem(rng, lens, 2, 16, page_size)
    dec = BatchMLADecode(16, **_kw(schedule)).plan(lens, 2)
    a = dec.run(q, cache, table)
    b = dec.run(q_nope=cp.ascontiguousarray(q[..., :512]), q_pe=cp.ascontiguousarray(q[..., 512:]),
                cache=cache, block_table=table)
    runs = [dec.run(q, cache, table) for _ in range(5)]
    assert cp.array_equal(a, b) and all(cp.array_equal(a, c) for c in runs)


@pytest.mark.parametrize("heads,s_q", [(16, 1), (128, 2)])
def test_slices_cuda_graph_replay(rng, heads, s_q):
    """slice_release: a captured run replayed after plan() with new lengths (a tile count that changes parity, an
    empty row, a row that no longer splits) matches the reference."""
    import cupy as cp

    from cukv import reference
    from cukv.ops.mla_decode import BatchMLADecode

    lens1, lens2 = [4000, 30, 0], [100, 5000, 64]
    cache, table, q, qv, vals, table_h = make_problem(rng, [5000, 5000, 100], s_q, heads, 64, garbage=False)
    dec = BatchMLADecode(heads, slice_release=True).plan(lens1, s_q)
    out = cp.zeros((3, s_q, heads, 512), cp.uint16)
    lse = cp.zeros((3, s_q, heads), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        dec.run(q, cache, table, out=out, lse=lse)  # load the module outside the capture
        stream.begin_capture()
        dec.run(q, cache, table, out=out, lse=lse, stream=stream)
        graph = stream.end_capture()
    dec.plan(lens2, s_q)  # new lengths, same buffers
    replay(graph, stream)
    stream.synchronize()
    ro, rl = reference.mla_decode(qv, np.nan_to_num(vals), table_h, lens2)
    np.testing.assert_allclose(_to_host(out, "bfloat16"), ro, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(lse.get(), rl, atol=2e-3)
    first = out.copy()
    replay(graph, stream)
    stream.synchronize()
    assert cp.array_equal(first, out)


MC = {"schedule": "alternate", "slice_release": True, "multicast": True}
MC_CASES = [c for c in CASES if -(-c[1] * c[2] // 64) % 2 == 0]  # an even count of 64-row blocks: cluster pairs


@pytest.mark.parametrize("lens,s_q,heads,page_size", MC_CASES, ids=lambda x: str(x)[:20])
def test_multicast_grid(rng, lens, s_q, heads, page_size):
    """multicast: a chunk's two row blocks as a cluster pair, every full tile copied once into both (pages 64 and 16
    by tensor copies, 48 by each block's own cp.async); against the reference, and bit-identical to the per-slice
    kernel without the pair."""
    import cupy as cp

    from cukv.ops.mla_decode import BatchMLADecode

    dec, out, lse = run_check(rng, lens, s_q, heads, page_size, sink=True, **MC)
    assert dec.config.multicast and dec.config.name.endswith("_mc_lr")
    cache, table, q, *_ = make_problem(rng, lens, s_q, heads, page_size)
    outs = [BatchMLADecode(heads, **kw).plan(lens, s_q).run(q, cache, table) for kw in (MC, _kw("slices"))]
    assert cp.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("chunk_tiles", [1, 2, 3])
def test_multicast_chunks_and_growing_scores(rng, chunk_tiles):
    """Pairs of 1-3 tile chunks (an odd last tile in each) through the combine kernel, with keys growing 30x along
    each sequence (every lazy-rescale path)."""
    dec, *_ = run_check(rng, [4096, 300, 0, 65], 2, 128, 64, sink=True, ramp=30.0, atol=2e-2 * 31,
                        plan_kw={"chunk_tiles": chunk_tiles}, **MC)
    assert dec.config.multicast and dec.num_items > 8


def _captured_replay(rng, cfg, lens1, lens2, cache_lens):
    """A run planned for lens1 captured in a graph, planned again for lens2 (same buffers) and replayed: the output
    against the reference. Returns the op."""
    import cupy as cp

    from cukv import reference
    from cukv.ops.mla_decode import BatchMLADecode

    cache, table, q, qv, vals, table_h = make_problem(rng, cache_lens, 1, 128, 64, garbage=False)
    dec = BatchMLADecode(128, **cfg).plan(lens1, 1)
    out = cp.zeros((len(lens1), 1, 128, 512), cp.uint16)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        dec.run(q, cache, table, out=out)
        stream.begin_capture()
        dec.run(q, cache, table, out=out, stream=stream)
        graph = stream.end_capture()
    dec.plan(lens2, 1)
    replay(graph, stream)
    stream.synchronize()
    want, _ = reference.mla_decode(qv, np.nan_to_num(vals), table_h, lens2)
    np.testing.assert_allclose(_to_host(out, "bfloat16"), want, atol=2e-2, rtol=2e-2)
    return dec


def test_multicast_graph_replay_and_odd_row_blocks(rng):
    """A captured multicast run replayed after plan() with new lengths matches the reference; an odd count of row
    blocks is refused before launch, naming them."""
    from cukv.ops.mla_decode import BatchMLADecode

    _captured_replay(rng, MC, [4000, 30, 0], [100, 5000, 64], [5000, 5000, 100])
    with pytest.raises(ValueError, match=r"cluster pairs .* 3 row blocks"):
        BatchMLADecode(96, **MC).plan([100, 7], 2)


PS = {"schedule": "alternate", "slice_release": True, "persistent": True}


def _persistent_check(rng, lens, s_q, page_size, multicast, **kw):
    """run_check with persistent blocks (more items than blocks: each takes several), then bit-identical to the
    per-slice kernel of one block per item."""
    import cupy as cp

    from cukv.ops.mla_decode import BatchMLADecode

    dec, out, lse = run_check(rng, lens, s_q, 128, page_size, multicast=multicast, **PS, **kw)
    assert dec.config.persistent and dec.config.multicast == multicast and dec.num_items > dec._grid
    cache, table, q, *_ = make_problem(rng, lens, s_q, 128, page_size)
    plan_kw = kw.get("plan_kw") or {}
    outs = [BatchMLADecode(128, multicast=multicast, **k).plan(lens, s_q, **plan_kw).run(q, cache, table)
            for k in (PS, _kw("slices"))]
    assert cp.array_equal(outs[0], outs[1])
    return dec


@pytest.mark.parametrize("multicast", [False, True])
@pytest.mark.parametrize("page_size", [64, 48])
def test_persistent_many_short_items(rng, multicast, page_size):
    """persistent: 300 sequences of 0-200 tokens (items of 0-4 tiles, odd and even, so the ring's position moves
    between items; zero-length ones with no tile), pages by tensor copies (64) and cp.async (48)."""
    lens = [int(x) for x in rng.integers(0, 200, 300)]
    lens[:3] = [0, 1, 64]
    _persistent_check(rng, lens, 1, page_size, multicast, sink=True)


@pytest.mark.parametrize("multicast", [False, True])
@pytest.mark.parametrize("chunk_tiles", [1, 3])
def test_persistent_chunks_and_growing_scores(rng, multicast, chunk_tiles):
    """persistent: chunks of 1 and 3 tiles through the combine kernel, keys growing 30x (every lazy-rescale path)."""
    dec = _persistent_check(rng, [4096, 3000, 0, 65], 2, 64, multicast, ramp=30.0, atol=2e-2 * 31,
                            plan_kw={"chunk_tiles": chunk_tiles})
    assert dec.chunk_tiles == chunk_tiles


def test_persistent_graph_replay(rng):
    """A captured persistent run replayed after plan() with new lengths (another count of items, several a block)
    matches the reference."""
    lens1 = [int(x) for x in rng.integers(1, 300, 200)]
    lens2 = [int(x) for x in rng.integers(0, 600, 200)]
    dec = _captured_replay(rng, PS, lens1, lens2, [600] * 200)
    assert dec.num_items > 2 * dec._grid
