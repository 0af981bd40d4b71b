"""Absorbed MLA decode and the MLA cache on the GPU, against the float64 references in cukv.reference."""
import numpy as np
import pytest

from cukv.testing import replay
from cukv import reference
from cukv.dtypes import bf16_bits, bf16_to_float

pytestmark = pytest.mark.gpu

NAN16 = {"bfloat16": 0x7FC0, "float16": 0x7E00}


def _to_dev(x, dtype):
    import cupy as cp

    return cp.asarray(bf16_bits(x) if dtype == "bfloat16" else np.asarray(x, np.float16))


def _to_host(x, dtype):
    h = x.get()
    return (bf16_to_float(h) if dtype == "bfloat16" else h.astype(np.float32)).astype(np.float64)


def make_problem(rng, lens, s_q, heads, page_size, dtype="bfloat16", garbage=True, ramp=0.0):
    """A 16-bit MLA cache with the batch's rows in random pages, NaN in every unused slot and page, and a
    table whose entries past each row's last page are garbage (out of range, -1 or NaN pages). ``ramp``: row t of
    a sequence of n is scaled by 1 + ramp * t / n (scores that grow along the sequence)."""
    import cupy as cp

    from cukv.mla_cache import MLAKVCache

    b = len(lens)
    need = [-(-n // page_size) for n in lens]
    width = max(1, max(need) + 2)
    spare = 3
    num_pages = sum(need) + spare
    perm = rng.permutation(num_pages)
    table = np.zeros((b, width), np.int32)
    pages = np.full((num_pages, page_size, 576), np.nan, np.float32)
    k = 0
    for i, n in enumerate(lens):
        table[i, :need[i]] = perm[k:k + need[i]]
        k += need[i]
        rows = rng.standard_normal((n, 576)).astype(np.float32)
        rows *= (1.0 + ramp * np.arange(n, dtype=np.float32) / max(n, 1))[:, None]
        for t in range(n):
            pages[table[i, t // page_size], t % page_size] = rows[t]
        if garbage:  # past the row's end: pages that hold NaN, ids outside the cache, -1
            tail = rng.choice([-1, num_pages, 2 ** 30, int(perm[-1])], size=width - need[i])
            table[i, need[i]:] = tail
    cache = MLAKVCache(num_pages, page_size, dtype)
    cache.data[...] = _to_dev(pages, dtype).view(cache.data.dtype)
    q = rng.standard_normal((b, s_q, heads, 576)).astype(np.float32)
    vals = _to_host(_to_dev(pages, dtype), dtype)  # what the cache holds after rounding
    qv = _to_host(_to_dev(q, dtype), dtype)
    return cache, cp.asarray(table), _to_dev(q, dtype), qv, vals, table


def run_check(rng, lens, s_q, heads, page_size, dtype="bfloat16", sink=False, scale=None, atol=None, plan_kw=None,
              ramp=0.0, **cfg):
    import cupy as cp

    from cukv.ops.mla_decode import BatchMLADecode

    cache, table, q, qv, vals, table_h = make_problem(rng, lens, s_q, heads, page_size, dtype, ramp=ramp)
    sk = rng.standard_normal(heads).astype(np.float32) if sink else None
    dec = BatchMLADecode(heads, dtype, **cfg).plan(np.array(lens), s_q, **(plan_kw or {}))
    out, lse = dec.run(q, cache, table, return_lse=True, sink=None if sk is None else cp.asarray(sk),
                       softmax_scale=scale)
    ro, rl = reference.mla_decode(qv, np.nan_to_num(vals), np.where(table_h < vals.shape[0], np.maximum(table_h, 0), 0),
                                  lens, softmax_scale=scale, sink=sk)
    o = _to_host(out, dtype)
    tol = 2e-2 if dtype == "bfloat16" else 4e-3
    assert np.isfinite(o).all()
    np.testing.assert_allclose(o, ro, atol=atol or tol, rtol=tol)
    lh = lse.get()
    assert np.array_equal(np.isinf(lh), np.isinf(rl))
    fin = np.isfinite(rl)
    np.testing.assert_allclose(lh[fin], rl[fin], atol=2e-3, rtol=1e-4)
    return dec, out, lse


GRID = [  # (lens, s_q, heads, page_size)
    ([1], 1, 1, 1),
    ([20, 0, 140], 1, 16, 16),
    ([140, 20], 2, 3, 48),
    ([4096, 1, 0, 77, 140, 20], 4, 16, 64),
    ([4096, 300], 1, 128, 16),
    ([1000, 0], 2, 63, 64),
    ([5000], 1, 64, 1),
    ([20] * 64, 1, 128, 64),
    ([3000, 17], 4, 128, 16),
]


@pytest.mark.parametrize("lens,s_q,heads,page_size", GRID, ids=lambda x: str(x)[:20])
def test_mla_decode_grid(rng, lens, s_q, heads, page_size):
    run_check(rng, lens, s_q, heads, page_size)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mla_decode_sink_scale_dtype(rng, dtype):
    run_check(rng, [700, 0, 65], 2, 16, 16, dtype=dtype, sink=True, scale=0.1)


@pytest.mark.parametrize("lens,s_q,heads", [([3000, 0, 33], 2, 16), ([700], 1, 128)])
def test_mla_decode_other_tiles(rng, lens, s_q, heads):
    run_check(rng, lens, s_q, heads, 16, block_n=32, num_kv_stages=4, sink=True)


TMA_GRID = GRID + [([700, 64, 3], 1, 16, 128), ([333, 64], 2, 16, 32), ([100, 8], 1, 8, 8)]


@pytest.mark.parametrize("lens,s_q,heads,page_size", TMA_GRID, ids=lambda x: str(x)[:20])
def test_mla_decode_tma(rng, lens, s_q, heads, page_size):
    """Full tiles by tensor copies (page sizes 8..128), tails and pages of 1 or 48 tokens by cp.async; NaN in unused
    slots and garbage table entries past each row's end, as for the cp.async kernel."""
    run_check(rng, lens, s_q, heads, page_size, tma=True)


@pytest.mark.parametrize("dtype,block_n,schedule", [("float16", 64, "split"), ("bfloat16", 32, "split"),
                                                    ("bfloat16", 64, "alternate")])
def test_mla_decode_tma_variants(rng, dtype, block_n, schedule):
    kw = {"num_kv_stages": 4} if block_n == 32 else {}
    run_check(rng, [3000, 0, 65], 2, 16, 64, dtype=dtype, sink=True, tma=True, block_n=block_n, schedule=schedule,
              **kw)


NARROW_GRID = [  # (lens, s_q, heads, page_size): s_q x heads <= 32
    ([4096, 1, 0, 77, 140, 20], 1, 32, 64),
    ([140, 20], 2, 3, 48),
    ([5000], 1, 8, 1),
    ([3000, 17, 0], 4, 8, 16),
    ([700, 64, 3], 2, 16, 128),
]


@pytest.mark.parametrize("schedule", ["narrow", "split"])
@pytest.mark.parametrize("lens,s_q,heads,page_size", NARROW_GRID, ids=lambda x: str(x)[:20])
def test_mla_decode_few_rows_both_schedules(rng, schedule, lens, s_q, heads, page_size):
    """Up to 32 query rows both consumers serve: the narrow ones (the default) and the 64-row split ones."""
    run_check(rng, lens, s_q, heads, page_size, sink=True, schedule=schedule)


@pytest.mark.parametrize("schedule", ["narrow", "split"])
def test_mla_decode_few_rows_fp16_chunks(rng, schedule):
    dec, *_ = run_check(rng, [40000, 100, 0], 2, 16, 64, dtype="float16", sink=True, schedule=schedule,
                        plan_kw={"chunk_tiles": 3})
    assert dec.config.schedule == schedule and dec.num_items > 200  # partials merged by the combine kernel


def test_mla_decode_many_chunks(rng):
    """One tile per chunk asked for: 40000 tokens would be 625 chunks, over the combine kernel's 512, so plan
    doubles the chunk; every partial merges through the combine kernel."""
    dec, *_ = run_check(rng, [40000, 100], 1, 16, 64, sink=True, plan_kw={"chunk_tiles": 1})
    assert dec.chunk_tiles == 2


@pytest.mark.slow
@pytest.mark.parametrize("b", [1, 2, 6, 64])
@pytest.mark.parametrize("s_q", [1, 2, 4])
@pytest.mark.parametrize("ctx", [1, 20, 140, 4096, 70000])
@pytest.mark.parametrize("heads", [1, 3, 16, 63, 64, 128])
def test_mla_decode_full_grid(rng, b, s_q, ctx, heads):
    if b * ctx * heads * s_q > 40_000_000:
        pytest.skip("the float64 reference would take minutes")
    lens = [ctx] + list(rng.integers(0, ctx + 1, b - 1))
    run_check(rng, lens, s_q, heads, int(rng.choice([1, 16, 64, 48])), sink=bool(rng.integers(2)))


def make_fp8_problem(rng, lens, s_q, heads, ps, pow2):
    """An FP8 cache (NaN in every unused slot and page) holding the batch's rows in random pages written by
    append_mla, its table (-1 past each row's pages), the bf16 query and the unquantized rows."""
    import cupy as cp

    from cukv.mla_cache import MLAKVCache
    from cukv.ops.mla_append import append_mla

    need = [-(-n // ps) for n in lens]
    num_pages = sum(need) + 2
    perm = rng.permutation(num_pages)
    table = np.full((len(lens), max(need) + 1), -1, np.int32)
    cache = MLAKVCache(num_pages, ps, "fp8_e4m3", fill="nan")
    k, rows_all = 0, []
    for i, n in enumerate(lens):
        table[i, :need[i]] = perm[k:k + need[i]]
        k += need[i]
        rows = rng.standard_normal((n, 576)).astype(np.float32)
        rows_all.append(rows)
        if n:
            pos = np.arange(n)
            slots = table[i, pos // ps].astype(np.int64) * ps + pos % ps
            append_mla(cache, _to_dev(rows[:, :512], "bfloat16"), _to_dev(rows[:, 512:], "bfloat16"),
                       cp.asarray(slots), pow2_scales=pow2)
    q = rng.standard_normal((len(lens), s_q, heads, 576)).astype(np.float32)
    return cache, table, _to_dev(q, "bfloat16"), rows_all


@pytest.mark.parametrize("prefetch_tiles,fp8_rows", [(1, 8), (2, 8), (0, 16), (1, 16), (2, 16)])
def test_mla_decode_fp8_producers_bit_identical(rng, prefetch_tiles, fp8_rows):
    """The FP8 producer's variants (L2 prefetch distance, rows in flight) change no bit of the output or LSE
    against block 64 x 2 without them (the default's own numerics are tested above), uneven lengths, NaN pages."""
    import cupy as cp

    from cukv.ops.mla_decode import BatchMLADecode

    lens, s_q, heads, ps = [1000, 0, 3, 640, 129], 1, 128, 64
    cache, table, qd, _ = make_fp8_problem(rng, lens, s_q, heads, ps, False)
    tab = cp.asarray(table)
    base = BatchMLADecode(heads, kv_dtype="fp8_e4m3", prefetch_tiles=0, fp8_rows=8)
    want, want_lse = base.plan(lens, s_q).run(qd, cache, tab, return_lse=True)
    dec = BatchMLADecode(heads, kv_dtype="fp8_e4m3", prefetch_tiles=prefetch_tiles, fp8_rows=fp8_rows).plan(lens, s_q)
    got, got_lse = dec.run(qd, cache, tab, return_lse=True)
    assert np.array_equal(got.get(), want.get())
    assert np.array_equal(got_lse.get(), want_lse.get(), equal_nan=True)


@pytest.mark.parametrize("pow2,heads,s_q,schedule", [(False, 16, 2, None), (True, 16, 2, None), (True, 16, 1, None),
                                                     (False, 16, 2, "split"), (True, 64, 1, None)])
def test_mla_decode_fp8_cache(rng, pow2, heads, s_q, schedule):
    """FP8 rows written by append_mla: tight against the reference on the dequantized cache (the tiles hold
    bf16(e4m3 * scale), exact for power-of-two scales), loose against the unquantized tokens."""
    import cupy as cp

    from cukv.ops.mla_decode import BatchMLADecode

    lens, ps = [3000, 0, 77, 640], 16
    cache, table, qd, rows_all = make_fp8_problem(rng, lens, s_q, heads, ps, pow2)
    num_pages = cache.num_pages
    dec = BatchMLADecode(heads, kv_dtype="fp8_e4m3", schedule=schedule).plan(lens, s_q)
    out, lse = dec.run(qd, cache, cp.asarray(table), return_lse=True)
    o = _to_host(out, "bfloat16")
    deq = reference.mla_dequantize_fp8(cache.data.get())
    deq = _to_host(_to_dev(deq, "bfloat16"), "bfloat16")  # the kernel's tiles are bf16
    tab = np.maximum(table, 0)
    qv = _to_host(qd, "bfloat16")
    ro, rl = reference.mla_decode(qv, np.nan_to_num(deq), tab, lens)
    np.testing.assert_allclose(o, ro, atol=2e-2, rtol=2e-2)
    fin = np.isfinite(rl)
    np.testing.assert_allclose(lse.get()[fin], rl[fin], atol=2e-3, rtol=1e-4)
    assert np.array_equal(np.isinf(lse.get()), np.isinf(rl))
    exact = np.zeros((num_pages, ps, 576))
    for i, n in enumerate(lens):
        for t in range(n):
            exact[table[i, t // ps], t % ps] = _to_host(_to_dev(rows_all[i][t], "bfloat16"), "bfloat16")
    ro2, _ = reference.mla_decode(qv, exact, tab, lens)
    np.testing.assert_allclose(o, ro2, atol=0.15, rtol=0.15)


@pytest.mark.parametrize("pow2,s_q,ps,chunk", [(True, 1, 16, None), (False, 2, 64, None), (True, 1, 1, 3),
                                                (True, 2, 48, 2)])
def test_mla_decode_fp8_pair(rng, pow2, s_q, ps, chunk):
    """FP8 rows shared by a cluster pair (multicast: each block dequantizes half of every tile into both): against
    the reference on the dequantized cache, and bit-identical to the kernel without the pair."""
    import cupy as cp

    from cukv.ops.mla_decode import BatchMLADecode

    lens, heads = [3000, 0, 77, 640, 65], 128
    cache, table, qd, _ = make_fp8_problem(rng, lens, s_q, heads, ps, pow2)
    plan_kw = {"chunk_tiles": chunk} if chunk else {}
    outs = []
    for mc in (True, False):
        dec = BatchMLADecode(heads, kv_dtype="fp8_e4m3", fp8_rows=8, multicast=mc).plan(lens, s_q, **plan_kw)
        assert dec.config.multicast == mc and dec.config.schedule == "split"
        outs.append(dec.run(qd, cache, cp.asarray(table), return_lse=True))
    (out, lse), (out2, lse2) = outs
    assert cp.array_equal(out, out2) and cp.array_equal(lse, lse2)
    deq = reference.mla_dequantize_fp8(cache.data.get())
    deq = _to_host(_to_dev(deq, "bfloat16"), "bfloat16")
    ro, rl = reference.mla_decode(_to_host(qd, "bfloat16"), np.nan_to_num(deq), np.maximum(table, 0), lens)
    np.testing.assert_allclose(_to_host(out, "bfloat16"), ro, atol=2e-2, rtol=2e-2)
    fin = np.isfinite(rl)
    np.testing.assert_allclose(lse.get()[fin], rl[fin], atol=2e-3, rtol=1e-4)


def test_mla_decode_q_split_and_repeat(rng):
    """q_nope + q_pe give the same bits as q; repeated runs are bit-identical."""
    import cupy as cp

    from cukv.ops.mla_decode import BatchMLADecode

    lens = [3000, 5, 0, 900]
    cache, table, q, *_ = make_problem(rng, lens, 2, 16, 16)
    dec = BatchMLADecode(16).plan(lens, 2)
    a = dec.run(q, cache, table)
    b = dec.run(q_nope=cp.ascontiguousarray(q[..., :512]), q_pe=cp.ascontiguousarray(q[..., 512:]),
                cache=cache, block_table=table)
    c = dec.run(q, cache, table)
    assert cp.array_equal(a, b) and cp.array_equal(a, c)


@pytest.mark.parametrize("schedule", ["split", "alternate"])
def test_mla_decode_cuda_graph_replay(rng, schedule):
    import cupy as cp

    from cukv.ops.mla_decode import BatchMLADecode

    lens1, lens2 = [4000, 30, 0], [100, 5000, 64]
    cache, table, q, qv, vals, table_h = make_problem(rng, [5000, 5000, 100], 1, 16, 64, garbage=False)
    dec = BatchMLADecode(16, schedule=schedule).plan(lens1, 1)
    out = cp.zeros((3, 1, 16, 512), cp.uint16)
    lse = cp.zeros((3, 1, 16), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        dec.run(q, cache, table, out=out, lse=lse)  # load the module outside the capture
        stream.begin_capture()
        dec.run(q, cache, table, out=out, lse=lse, stream=stream)
        graph = stream.end_capture()
    dec.plan(lens2, 1)  # new lengths, same buffers
    replay(graph, stream)
    stream.synchronize()
    ro, rl = reference.mla_decode(qv, np.nan_to_num(vals), table_h, lens2)
    np.testing.assert_allclose(_to_host(out, "bfloat16"), ro, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(lse.get(), rl, atol=2e-3)


@pytest.mark.parametrize("heads", [16, 128])
def test_mla_decode_graph_captured_without_splits_replays_splits(rng, heads):
    """A plan with nothing to merge launches no combine kernel outside a capture; a captured run launches it all the
    same, so a later plan that splits sequences replays correctly (and the other way round)."""
    import cupy as cp

    from cukv.ops.mla_decode import BatchMLADecode

    short, long = [64, 30, 0], [5000, 4000, 100]
    cache, table, q, qv, vals, table_h = make_problem(rng, [5000, 5000, 100], 1, heads, 64, garbage=False)
    dec = BatchMLADecode(heads).plan(short, 1)
    assert dec.combine_row_blocks == 0
    out = cp.zeros((3, 1, heads, 512), cp.uint16)
    lse = cp.zeros((3, 1, heads), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        dec.run(q, cache, table, out=out, lse=lse)
        stream.begin_capture()
        dec.run(q, cache, table, out=out, lse=lse, stream=stream)
        graph = stream.end_capture()
    for lens in (long, short, long):
        dec.plan(lens, 1)
        assert (dec.combine_row_blocks > 0) == (lens is long)
        out.fill(0x7FC0)  # NaN: every row must be written again
        replay(graph, stream)
        stream.synchronize()
        ro, rl = reference.mla_decode(qv, np.nan_to_num(vals), table_h, lens)
        np.testing.assert_allclose(_to_host(out, "bfloat16"), ro, atol=2e-2, rtol=2e-2)
        np.testing.assert_allclose(lse.get(), rl, atol=2e-3)
        direct = dec.run(q, cache, table)  # outside the capture: the combine only where the plan split
        np.testing.assert_array_equal(direct.get(), out.get())


def test_mla_decode_bad_input_writes_nothing(rng):
    import cupy as cp

    from cukv.ops.mla_decode import BatchMLADecode

    cache, table, q, *_ = make_problem(rng, [100, 7], 1, 16, 16)
    dec = BatchMLADecode(16).plan([100, 7], 1)
    out = cp.full((2, 1, 16, 512), 7, cp.uint16)
    with pytest.raises(ValueError, match="q has shape"):
        dec.run(q[:, :, :8], cache, table, out=out)
    with pytest.raises(ValueError, match="q_nope"):
        dec.run(q_nope=q[..., :500], q_pe=q[..., 512:], cache=cache, block_table=table, out=out)
    with pytest.raises(TypeError, match="block_table"):
        dec.run(q, cache, table.astype(cp.int64), out=out)
    with pytest.raises(TypeError, match="float16"):
        dec.run(q.view(cp.float16), cache, table, out=out)
    with pytest.raises(ValueError, match="s_q"):
        BatchMLADecode(16).plan([5], 9)
    with pytest.raises(ValueError, match="num_heads"):
        BatchMLADecode(129)
    assert int((out == 7).all())


# --- the cache -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("pow2", [False, True])
def test_append_fp8_bit_exact(rng, dtype, pow2):
    import cupy as cp

    from cukv.mla_cache import MLAKVCache
    from cukv.ops.mla_append import append_mla

    t = 37
    kv_c = rng.standard_normal((t, 512)).astype(np.float32) * rng.uniform(0.01, 100, (t, 1)).astype(np.float32)
    kv_c[3] = 0  # an all-zero token: the floor scale
    k_pe = rng.standard_normal((t, 64)).astype(np.float32)
    kc, kp = _to_dev(kv_c, dtype), _to_dev(k_pe, dtype)
    cache = MLAKVCache(8, 16, "fp8_e4m3", fill="nan")
    slots = rng.permutation(8 * 16)[:t].astype(np.int64)
    slots[5] = -1
    slots[6] = 8 * 16  # out of range: skipped
    append_mla(cache, kc, kp, cp.asarray(slots), pow2_scales=pow2)
    want = reference.mla_quantize_fp8(_to_host(kc, dtype), _to_host(kp, dtype), pow2_scales=pow2)
    got = cache.data.get().reshape(-1, 656)
    for i, s in enumerate(slots):
        if 0 <= s < 128:
            assert np.array_equal(got[s], want[i]), i
    untouched = np.setdiff1d(np.arange(128), slots)
    assert (got[untouched] == 0xFF).all()
    deq = cache.dequantize().get().reshape(-1, 576)
    np.testing.assert_array_equal(deq[slots[0]], reference.mla_dequantize_fp8(want[0]).astype(np.float32))
    one_page = cache.dequantize(chunk_bytes=16 * 576 * 4).get().reshape(-1, 576)  # a pass per page
    assert np.array_equal(np.isnan(one_page), np.isnan(deq)) and np.array_equal(np.nan_to_num(one_page), np.nan_to_num(deq))


def test_append_16bit_and_from_arrays(rng):
    import cupy as cp

    from cukv.mla_cache import MLAKVCache
    from cukv.ops.mla_append import append_mla

    base = cp.full((6, 2, 16, 1, 576), 0x7FC0, cp.uint16)  # a [blocks, 2, page, 1, 576] buffer: strided pages
    cache = MLAKVCache.from_arrays(base[:, 1], dtype="bfloat16")
    assert cache.page_stride == 2 * 16 * 576 * 2 and cache.row_stride == 1152
    assert cache.ptr == base[:, 1].data.ptr  # no copy
    kv = rng.standard_normal((5, 576)).astype(np.float32)
    slots = cp.asarray([0, 17, -1, 95, 40], cp.int32)
    append_mla(cache, _to_dev(kv[:, :512], "bfloat16"), _to_dev(kv[:, 512:], "bfloat16"), slots)
    h = base.get()[:, 1, :, 0]
    for i, s in enumerate([0, 17, -1, 95, 40]):
        if s >= 0:
            assert np.array_equal(h[s // 16, s % 16], bf16_bits(kv[i]))
    assert (base.get()[:, 0] == 0x7FC0).all()
    with pytest.raises(ValueError, match="656"):
        MLAKVCache.from_arrays(cp.zeros((2, 64, 640), cp.uint8))
    with pytest.raises(TypeError, match="kv_c"):
        append_mla(cache, cp.zeros((5, 512), cp.float16), cp.zeros((5, 64), cp.float16), slots)
