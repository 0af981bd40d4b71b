"""Sparse MLA on the GPU against the float64 reference (cukv.reference.sparse_mla): FlashMLA's sparse grids and
more (heads 1..128, invalid indices of every kind, cut lists with NaN rows behind the cut, sinks, FP8 rows)."""
import numpy as np
import pytest

from cukv.testing import capture, replay
from cukv import reference
from cukv.dtypes import bf16_bits, bf16_to_float

pytestmark = pytest.mark.gpu

PAGE = 64
INVALID = (-1, -2 ** 31, None, 2 ** 31 - 1)  # None: num_rows, the first row past the cache


def _to_dev(x, dtype):
    import cupy as cp

    return cp.asarray(bf16_bits(x) if dtype == "bfloat16" else np.asarray(x, np.float16))


def _to_host(x, dtype):
    h = x.get()
    return (bf16_to_float(h) if dtype == "bfloat16" else h.astype(np.float32)).astype(np.float64)


def make_kv(rng, s_kv, dtype, kind):
    """``s_kv`` written rows, then NaN rows to the end of the cache (one spare page): ``(kv argument, the rows as
    the kernel sees them [num_rows, 576] with NaN where unwritten, num_rows)``."""
    import cupy as cp

    from cukv.mla_cache import MLAKVCache
    from cukv.ops.mla_append import append_mla

    num_pages = -(-s_kv // PAGE) + 1
    num_rows = num_pages * PAGE
    rows = rng.standard_normal((s_kv, 576)).astype(np.float32)
    if dtype == "fp8_e4m3":
        cache = MLAKVCache(num_pages, PAGE, "fp8_e4m3", fill="nan")
        append_mla(cache, _to_dev(rows[:, :512], "bfloat16"), _to_dev(rows[:, 512:], "bfloat16"),
                   cp.arange(s_kv), pow2_scales=True)
        deq = reference.mla_dequantize_fp8(cache.data.get()).reshape(num_rows, 576)
        return cache, _to_host(_to_dev(deq, "bfloat16"), "bfloat16"), num_rows  # the tiles are bf16
    full = np.full((num_rows, 576), np.nan, np.float32)
    full[:s_kv] = rows
    dev = _to_dev(full, dtype)
    vals = _to_host(dev, dtype)
    if kind == "array":
        return dev, vals, num_rows
    cache = MLAKVCache(num_pages, PAGE, dtype)
    cache.data[...] = dev.reshape(num_pages, PAGE, 576).view(cache.data.dtype)
    return cache, vals, num_rows


def make_indices(rng, t_n, topk, s_kv, num_rows, cut):
    """Valid rows (repeats allowed where topk > s_kv), ~15% invalid of every kind, one all-invalid token; with
    ``cut``, lengths below topk and in-range NaN rows behind each cut."""
    idx = rng.integers(0, s_kv, (t_n, topk)).astype(np.int64)
    bad = rng.random((t_n, topk)) < 0.15
    kinds = np.array([num_rows if v is None else v for v in INVALID], np.int64)
    idx[bad] = rng.choice(kinds, int(bad.sum()))
    if t_n > 1:
        idx[1] = rng.choice(kinds, topk)
    lens = None
    if cut:
        lens = rng.integers(0, topk + 1, t_n).astype(np.int32)
        lens[0] = max(1, topk // 3)
        if t_n > 2:
            lens[2] = topk + 5  # past topk reads as topk
        for t in range(t_n):
            n = min(int(lens[t]), topk)
            idx[t, n:] = rng.integers(s_kv, num_rows, topk - n)  # NaN rows: must never be read
    return idx.astype(np.int32), lens


def check(rng, heads, s_kv, topk, t_n=3, dtype="bfloat16", kind="cache", cut=False, sink=None, uint=False,
          schedule=None, multicast=None, persistent=None):
    import cupy as cp

    from cukv.ops.sparse_mla import SparseMLA, _kv_dtype

    kv, vals, num_rows = make_kv(rng, s_kv, dtype, kind)
    qdt = "bfloat16" if dtype == "fp8_e4m3" else dtype
    q = rng.standard_normal((t_n, heads, 576)).astype(np.float32)
    qd = _to_dev(q, qdt)
    idx, lens = make_indices(rng, t_n, topk, s_kv, num_rows, cut)
    sk = None
    if sink == "finite":
        sk = rng.standard_normal(heads).astype(np.float32)
    elif sink is not None:
        sk = np.full(heads, float(sink), np.float32)
    ind = cp.asarray(idx.view(np.uint32) if uint else idx)
    att = SparseMLA(heads, qdt, kv_dtype=_kv_dtype(kv), schedule=schedule, multicast=multicast,
                    persistent=persistent).plan(t_n, topk)
    assert multicast is None or att.config.multicast == multicast
    assert persistent is None or att.config.persistent == persistent
    out, lse, mx = att.run(qd, kv, ind, topk_lengths=None if lens is None else cp.asarray(lens),
                           sink=None if sk is None else cp.asarray(sk))
    ro, rl, rm = reference.sparse_mla(_to_host(qd, qdt), vals, idx, lens, sk)
    o = _to_host(out, qdt)
    assert np.isfinite(o).all()
    tol = 2e-2 if qdt == "bfloat16" else 4e-3
    np.testing.assert_allclose(o, ro, atol=tol, rtol=tol)
    for got, want in ((lse.get(), rl), (mx.get(), rm)):
        assert np.array_equal(np.isneginf(got), np.isneginf(want))
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[fin], want[fin], atol=3e-3, rtol=1e-4)
    return out, lse, mx


PAIRS = [(128, 128), (592, 128), (1840, 256), (95, 128), (32, 2048)]


@pytest.mark.parametrize("heads", [1, 16, 64, 128])
@pytest.mark.parametrize("s_kv,topk", PAIRS)
def test_sparse_prefill_grid(rng, heads, s_kv, topk):
    check(rng, heads, s_kv, topk)


@pytest.mark.parametrize("sink", [None, "finite", float("-inf"), float("inf")])
@pytest.mark.parametrize("kind", ["cache", "array"])
def test_sparse_cut_lists_and_sinks(rng, sink, kind):
    out, _, _ = check(rng, 16, 592, 256, t_n=5, kind=kind, cut=True, sink=sink)
    assert float(abs(out[1].astype("float32")).max()) == 0.0  # the all-invalid token


@pytest.mark.parametrize("dtype", ["float16", "fp8_e4m3"])
@pytest.mark.parametrize("heads", [16, 128])
def test_sparse_dtypes(rng, dtype, heads):
    check(rng, heads, 1840, 512, t_n=3, dtype=dtype, cut=True, sink="finite")


@pytest.mark.parametrize("s_kv,topk,t_n,cut", [(1840, 512, 4, True), (5000, 4096, 1, False), (95, 128, 3, True)])
def test_sparse_fp8_pair(rng, s_kv, topk, t_n, cut):
    """FP8 rows at 128 heads as a cluster pair (multicast: each block dequantizes half of every tile into both,
    the validity words of every row its own): invalid indices of every kind, cut lists with NaN rows behind the cut,
    a list split over the SMs and merged by the combine kernel; against the reference and bit-identical to the
    kernel without the pair."""
    import cupy as cp

    seed = int(rng.integers(1 << 30))
    got = [check(np.random.default_rng(seed), 128, s_kv, topk, t_n=t_n, dtype="fp8_e4m3", cut=cut, sink="finite",
                 schedule="split", multicast=mc) for mc in (True, False)]
    for a, b in zip(*got):
        assert cp.array_equal(a, b)


@pytest.mark.parametrize("schedule", ["narrow", "split"])
@pytest.mark.parametrize("heads,dtype", [(1, "bfloat16"), (16, "fp8_e4m3"), (32, "float16"), (32, "fp8_e4m3")])
def test_sparse_schedules_at_few_heads(rng, schedule, heads, dtype):
    """Up to 32 heads both consumers serve: the narrow ones (the default) and the 64-row split ones."""
    check(rng, heads, 1840, 512, t_n=4, dtype=dtype, cut=True, sink="finite", schedule=schedule)
    check(rng, heads, 5000, 4096, t_n=1, dtype=dtype, schedule=schedule)  # split over the SMs, merged by the combine


# the per-slice consumers' lists: every kind of invalid index, cut lists with NaN rows behind the cut and sinks of
# every kind, partial last tiles, a mostly invalid list, one split over the SMs (the combine), 62 tokens
ALT_LISTS = [(592, 128, 3, False, None), (1840, 256, 4, True, "finite"), (95, 128, 3, True, float("-inf")),
             (32, 2048, 2, False, "finite"), (5000, 4096, 1, False, None), (1521, 512, 62, True, float("inf"))]


@pytest.mark.parametrize("heads,dtype", [(64, "bfloat16"), (128, "bfloat16"), (100, "float16"), (128, "float16")])
@pytest.mark.parametrize("s_kv,topk,t_n,cut,sink", ALT_LISTS)
def test_sparse_alternate_schedule(rng, heads, dtype, s_kv, topk, t_n, cut, sink):
    """The alternating consumers over per-slice barriers, each slice gathered as it frees: every kind of invalid
    index, cut lists with NaN rows behind the cut, partial last tiles, lists split over the SMs (the combine)."""
    check(rng, heads, s_kv, topk, t_n=t_n, dtype=dtype, cut=cut, sink=sink, schedule="alternate",
          kind="array" if t_n == 4 else "cache")


@pytest.mark.parametrize("heads,dtype", [(128, "bfloat16"), (100, "float16")])
@pytest.mark.parametrize("s_kv,topk,t_n,cut,sink", ALT_LISTS)
def test_sparse_alternate_pairs(rng, heads, dtype, s_kv, topk, t_n, cut, sink):
    """The per-slice consumers with a token's two row blocks as a cluster pair, each block gathering half of every
    slice and forwarding it into the other's stage."""
    check(rng, heads, s_kv, topk, t_n=t_n, dtype=dtype, cut=cut, sink=sink, schedule="alternate", multicast=True)


@pytest.mark.parametrize("heads,dtype", [(64, "bfloat16"), (128, "bfloat16"), (100, "float16")])
@pytest.mark.parametrize("s_kv,topk,t_n,cut,sink", ALT_LISTS + [(1521, 512, 300, True, "finite"),
                                                                (592, 128, 700, False, None)])
def test_sparse_alternate_persistent(rng, heads, dtype, s_kv, topk, t_n, cut, sink):
    """The per-slice consumers in persistent blocks: a block takes every grid-th token's row block, the ring running
    on across them (cut lists: items of odd and even tile counts, and of none)."""
    check(rng, heads, s_kv, topk, t_n=t_n, dtype=dtype, cut=cut, sink=sink, schedule="alternate", multicast=False,
          persistent=True)


def test_sparse_uint32_indices(rng):
    check(rng, 64, 592, 128, uint=True)


def test_sparse_long_list_split(rng):
    """One token, a long list: the plan splits it over the SMs and the combine merges lse and max_logits."""
    check(rng, 16, 5000, 4096, t_n=1)
    check(rng, 64, 700, 2048, t_n=2, cut=True, sink="finite")


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("fp8", [False, True])
def test_sparse_decode(rng, fp8, heads):
    """Sparse decode through a page table; 128 heads with 16-bit rows run the per-slice consumers."""
    import cupy as cp

    from cukv.ops.sparse_mla import sparse_indices, sparse_mla_decode

    b, s_q, topk, ps = 3, 2, 256, PAGE
    dtype = "fp8_e4m3" if fp8 else "bfloat16"
    kv, vals, num_rows = make_kv(rng, 900, dtype, "cache")
    table = rng.permutation(num_rows // ps)[: 2 * (num_rows // ps // 2)].reshape(2, -1).astype(np.int32)
    table = np.concatenate([table, table[:1]])  # request 2 shares request 0's pages
    width = table.shape[1] * ps
    pos = rng.integers(0, width, (b, s_q, topk))
    pos[rng.random(pos.shape) < 0.1] = -1
    idx = sparse_indices(cp.asarray(pos), cp.asarray(table), ps).get()
    assert ((idx == -1) | ((idx >= 0) & (idx < num_rows))).all()
    written = np.isfinite(vals).all(1)
    idx = np.where((idx >= 0) & written[np.maximum(idx, 0)], idx, -1).astype(np.int32)  # only written rows
    lens = np.array([topk, 100, 0], np.int32)
    q = rng.standard_normal((b, s_q, heads, 576)).astype(np.float32)
    qd = _to_dev(q, "bfloat16")
    out, lse, mx = sparse_mla_decode(qd, kv, cp.asarray(idx), topk_lengths=cp.asarray(lens))
    flat = np.repeat(lens, s_q)
    ro, rl, rm = reference.sparse_mla(_to_host(qd, "bfloat16").reshape(b * s_q, heads, 576), vals,
                                      idx.reshape(b * s_q, topk), flat)
    np.testing.assert_allclose(_to_host(out, "bfloat16").reshape(ro.shape), ro, atol=2e-2, rtol=2e-2)
    for got, want in ((lse.get().reshape(rl.shape), rl), (mx.get().reshape(rm.shape), rm)):
        assert np.array_equal(np.isneginf(got), np.isneginf(want))
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[fin], want[fin], atol=3e-3, rtol=1e-4)


def test_sparse_graph_capture_replays(rng):
    """plan once; run captured in a CUDA graph; new indices in the same buffer replay correctly."""
    import cupy as cp

    from cukv.ops.sparse_mla import SparseMLA

    kv, vals, num_rows = make_kv(rng, 600, "bfloat16", "cache")
    t_n, heads, topk = 2, 64, 1024  # small: the plan splits, so the combine is captured too
    att = SparseMLA(heads).plan(t_n, topk)
    assert att.num_parts > 0
    q = _to_dev(rng.standard_normal((t_n, heads, 576)).astype(np.float32), "bfloat16")
    ind = cp.asarray(rng.integers(0, 600, (t_n, topk)).astype(np.int32))
    out, lse, mx = cp.empty((t_n, heads, 512), cp.uint16), cp.empty((t_n, heads), cp.float32), \
        cp.empty((t_n, heads), cp.float32)
    graph, stream = capture(lambda s: att.run(q, kv, ind, out=out, lse=lse, max_logits=mx, stream=s))
    for _ in range(2):
        idx = rng.integers(-3, 600, (t_n, topk)).astype(np.int32)
        idx[rng.random(idx.shape) < 0.1] = num_rows
        ind.set(idx)
        replay(graph, stream)
        ro, rl, rm = reference.sparse_mla(_to_host(q, "bfloat16"), vals, idx)
        np.testing.assert_allclose(_to_host(out, "bfloat16"), ro, atol=2e-2, rtol=2e-2)
        np.testing.assert_allclose(mx.get(), rm, atol=3e-3, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("heads", [1, 16, 64, 128])
@pytest.mark.parametrize("s_kv,topk", PAIRS + [(1521, 512), (64, 8192)])
@pytest.mark.parametrize("t_n", [1, 62, 213])
@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_sparse_prefill_full_grid(rng, heads, s_kv, topk, t_n, dtype):
    check(rng, heads, s_kv, topk, t_n=t_n, dtype=dtype, cut=bool(t_n % 2 == 0), sink="finite")


def test_named_errors_before_launch(rng):
    import cupy as cp

    from cukv.errors import NotPlannedError
    from cukv.mla_cache import MLAKVCache
    from cukv.ops.sparse_mla import SparseMLA, sparse_mla_decode, sparse_mla_prefill

    kv = cp.zeros((100, 576), cp.uint16)
    q = cp.zeros((3, 16, 576), cp.uint16)
    idx = cp.zeros((3, 64), cp.int32)
    with pytest.raises(NotPlannedError):
        SparseMLA(16).run(q, kv, idx)
    att = SparseMLA(16).plan(3, 64)
    cases = [
        (dict(q=cp.zeros((3, 8, 576), cp.uint16)), ValueError, "q has shape"),
        (dict(q=cp.zeros((3, 16, 576), cp.float32)), TypeError, "q has dtype float32"),
        (dict(q=cp.zeros((3, 16, 576), cp.float16)), TypeError, "q is float16"),
        (dict(indices=cp.zeros((3, 64), cp.int64)), TypeError, "indices has dtype"),
        (dict(indices=cp.zeros((3, 32), cp.int32)), ValueError, "topk=64"),
        (dict(indices=cp.zeros((4, 64), cp.int32)), ValueError, "indices has shape"),
        (dict(topk_lengths=cp.zeros((3,), cp.int64)), TypeError, "topk_lengths"),
        (dict(topk_lengths=cp.zeros((2,), cp.int32)), ValueError, "topk_lengths"),
        (dict(sink=cp.zeros((8,), cp.float32)), ValueError, "sink"),
        (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
        (dict(kv=cp.zeros((100, 576), cp.float16)), TypeError, "kv holds"),
        (dict(kv=MLAKVCache(2, 64, "fp8_e4m3")), TypeError, "kv holds"),
        (dict(out=cp.zeros((3, 16, 256), cp.uint16)), ValueError, "out has shape"),
    ]
    for change, exc, text in cases:
        args = dict(q=q, kv=kv, indices=idx)
        args.update(change)
        with pytest.raises(exc, match=text):
            att.run(args.pop("q"), args.pop("kv"), args.pop("indices"), **args)
    with pytest.raises(ValueError, match="topk_lengths has shape"):
        sparse_mla_decode(q.reshape(3, 1, 16, 576), kv, idx.reshape(3, 1, 64), topk_lengths=cp.zeros((2,), cp.int32))
    with pytest.raises(ValueError, match="indices_stride"):
        sparse_mla_prefill(q, kv, cp.zeros((100,), cp.int32), indices_stride=64)
    out, _, _ = sparse_mla_prefill(q, kv, cp.zeros((200,), cp.int32), indices_stride=64, topk=16)  # a flat buffer
    assert out.shape == (3, 16, 512)
