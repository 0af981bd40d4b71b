"""Host side of the paged cache: the page allocator, page-table adapters and their validation, the cache
constructor's argument checks, and the element-offset rule every layout must satisfy."""
import re
import sys
import types

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cukv import PageAllocator, PagedKVCache, PageTable
from cukv.arrays import elem_strides
from cukv.kvcache import LAYOUTS, SequenceTable, check_table
from cukv.operand import KV_PARAMS

# ----------------------------------------------------------------------------------------------
# PageAllocator


def test_allocator_hands_out_every_page_once():
    a = PageAllocator(10)
    assert a.num_free == 10
    got = a.alloc(4) + a.alloc(6)
    assert sorted(got) == list(range(10))
    assert a.num_free == 0
    assert a.alloc(0) == []


def test_allocator_memory_error_leaves_state_alone():
    a = PageAllocator(3)
    a.alloc(2)
    with pytest.raises(MemoryError, match=r"asked for 2 pages, 1 of 3 are free"):
        a.alloc(2)
    assert a.num_free == 1
    assert a.alloc(1) is not None and a.num_free == 0
    with pytest.raises(MemoryError):
        a.alloc(1)


def test_allocator_free_and_reuse():
    a = PageAllocator(4)
    p = a.alloc(4)
    a.free(p[1:3])
    assert a.num_free == 2
    assert sorted(a.alloc(2)) == sorted(p[1:3])


def test_allocator_double_free_and_foreign_pages():
    a = PageAllocator(4)
    p = a.alloc(2)
    a.free([p[0]])
    with pytest.raises(ValueError, match=rf"page {p[0]} is not allocated"):
        a.free([p[0]])
    free_page = next(i for i in range(4) if i not in p)
    with pytest.raises(ValueError, match=rf"page {free_page} is not allocated"):
        a.free([free_page])  # never handed out
    for bad in (-1, 4, 1000):
        with pytest.raises(ValueError, match=rf"page {bad} is not allocated \(valid: allocated ids in 0\.\.3\)"):
            a.free([bad])
    assert a.num_free == 3  # none of the failed frees changed anything


def test_allocator_orders():
    assert PageAllocator(6).alloc(6) == [0, 1, 2, 3, 4, 5]
    a, b = PageAllocator(64, order="random", seed=3), PageAllocator(64, order="random", seed=3)
    got = a.alloc(64)
    assert got == b.alloc(64) and sorted(got) == list(range(64)) and got != list(range(64))
    a.free([got[5]])
    assert a.alloc(1) == [got[5]]  # freed pages come back first
    with pytest.raises(ValueError, match="order='shuffled'"):
        PageAllocator(4, order="shuffled")
    with pytest.raises(ValueError, match="seed=1 applies to order='random'"):
        PageAllocator(4, seed=1)


@pytest.mark.parametrize("n", [0, -1])
def test_allocator_needs_a_page(n):
    with pytest.raises(ValueError, match=rf"num_pages={n}"):
        PageAllocator(n)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=40))
def test_allocator_random_ops(ops):
    a = PageAllocator(12)
    held = []
    for do_alloc, n in ops:
        if do_alloc:
            if n > a.num_free:
                with pytest.raises(MemoryError):
                    a.alloc(n)
            else:
                held += a.alloc(n)
        elif held:
            k = min(n, len(held))
            a.free(held[:k])
            held = held[k:]
        assert len(set(held)) == len(held)
        assert a.num_free + len(held) == 12
        assert all(0 <= p < 12 for p in held)


def test_sequence_table_slots_and_release():
    cache = _fake_cache(num_pages=8, page_size=4)
    seqs = SequenceTable(cache, max_batch=2, max_pages_per_seq=3)
    slots = seqs.extend([6, 1])
    assert slots.dtype == np.int64 and slots.shape == (7,)
    bt = seqs.block_table()
    pos = np.arange(6)
    np.testing.assert_array_equal(slots[:6], bt[0, pos // 4].astype(np.int64) * 4 + pos % 4)
    assert slots[6] == bt[1, 0] * 4
    assert seqs.lengths.tolist() == [6, 1]
    more = seqs.extend([0, 3])  # sequence 1 grows into a second page
    assert more.tolist() == [bt[1, 0] * 4 + 1, bt[1, 0] * 4 + 2, bt[1, 0] * 4 + 3]
    with pytest.raises(ValueError, match=r"sequence 0 would need 4 pages; max_pages_per_seq=3"):
        seqs.extend([7, 0])
    with pytest.raises(ValueError, match="non-negative"):
        seqs.extend([-1, 0])
    free_before = seqs.allocator.num_free
    seqs.release(0)
    assert seqs.allocator.num_free == free_before + 2 and seqs.lengths[0] == 0


def _fake_cache(num_pages, page_size):
    return types.SimpleNamespace(num_pages=num_pages, page_size=page_size)


# ----------------------------------------------------------------------------------------------
# PageTable adapters: host-side validation (successful construction uploads, so needs a GPU)


@pytest.mark.parametrize("indptr,indices,last,match", [
    ([1, 2], [0, 1], [1], r"indptr must be 1-D, start at 0 and never decrease"),
    ([0, 2, 1], [0, 1], [1, 1], r"never decrease"),
    ([[0, 1]], [0], [1], r"1-D"),
    ([], [], [], r"1-D"),
    ([0, 1, 2], [0, 1], [1], r"last_page_len has shape \(1,\); expected \(2,\)"),
    ([0, 3], [0, 1], [1], r"indptr\[-1\]=3 exceeds len\(indices\)=2"),
    ([0, 1, 2], [0, 1], [16, 17], r"last_page_len\[1\]=17 must be in 1\.\.16"),
    ([0, 1, 2], [0, 1], [0, 4], r"last_page_len\[0\]=0 must be in 1\.\.16"),
])
def test_from_flashinfer_rejects(indptr, indices, last, match):
    with pytest.raises(ValueError, match=match):
        PageTable.from_flashinfer(np.array(indptr), np.array(indices), np.array(last), page_size=16)


def test_from_flashinfer_rejects_narrow_max_pages():
    with pytest.raises(ValueError, match="max_pages"):
        PageTable.from_flashinfer(np.array([0, 3]), np.array([4, 5, 6]), np.array([2]), page_size=16, max_pages=2)


@pytest.mark.parametrize("bt,lens,match", [
    (np.zeros(4, np.int32), [1], r"block_table must be 2-D; got shape \(4,\)"),
    (np.zeros((2, 4), np.int32), [1], r"seq_lens has shape \(1,\); expected \(2,\)"),
    (np.zeros((2, 4), np.int32), [64, 65], r"seq_lens\[1\]=65 needs 5 pages; block_table has 4 columns"),
])
def test_from_vllm_rejects(bt, lens, match):
    with pytest.raises(ValueError, match=match):
        PageTable.from_vllm(bt, np.array(lens), page_size=16)


def test_from_vllm_rejects_negative_lengths():
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=-5"):
        PageTable.from_vllm(np.zeros((1, 4), np.int32), np.array([-5]), page_size=16)


@pytest.mark.gpu
def test_from_flashinfer_builds_table():
    t = PageTable.from_flashinfer(np.array([0, 3, 3, 4]), np.array([7, 2, 9, 5]), np.array([5, 1, 16]), 16)
    assert t.block_table.get().tolist() == [[7, 2, 9], [0, 0, 0], [5, 0, 0]]
    assert t.lengths.get().tolist() == [2 * 16 + 5, 0, 16]
    assert t.page_size == 16 and t.batch_size == 3 and t.max_pages == 3


@pytest.mark.gpu
def test_from_vllm_builds_table():
    t = PageTable.from_vllm(np.array([[3, 1, 0], [2, 0, 0]]), np.array([40, 5]), 16)
    assert t.block_table.get().tolist() == [[3, 1, 0], [2, 0, 0]]
    assert t.lengths.get().tolist() == [40, 5]
    assert t.block_table.dtype == np.int32 and t.lengths.dtype == np.int32


@pytest.mark.gpu
def test_page_table_validate():
    cache = PagedKVCache(4, 16, 1, 64, dtype="float16")
    PageTable.from_vllm(np.array([[3, 1]]), np.array([20]), 16).validate(cache)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\]=4"):
        PageTable.from_vllm(np.array([[3, 4]]), np.array([20]), 16).validate(cache)


# ----------------------------------------------------------------------------------------------
# check_table


def test_check_table_accepts_valid_and_ignores_padding():
    bt = np.array([[3, 1, -7], [0, 99, 99]], np.int32)  # entries past each length are padding
    check_table(bt, np.array([20, 16]), page_size=16, num_pages=4)
    check_table(bt, np.array([0, 0]), page_size=16, num_pages=4)


@pytest.mark.parametrize("bt,lens,match", [
    ([[3, 1, 0], [0, 4, 0]], [20, 17], r"block_table\[1, 1\]=4 is not a page of the cache \(0\.\.3\)"),
    ([[3, -1, 0], [0, 1, 0]], [20, 17], r"block_table\[0, 1\]=-1 is not a page"),
    ([[3, 1, 0], [0, 1, 0]], [20, 49], r"lengths\[1\]=49 needs 4 pages; block_table has 3"),
    ([[3, 1, 0], [0, 1, 0]], [-1, 5], r"lengths\[0\]=-1 is negative"),
])
def test_check_table_errors(bt, lens, match):
    with pytest.raises(ValueError, match=match):
        check_table(np.array(bt, np.int32), np.array(lens), page_size=16, num_pages=4)


@given(st.integers(1, 6), st.integers(1, 5), st.integers(1, 8), st.data())
def test_check_table_names_first_bad_entry(batch, width, page_size, data):
    num_pages = 10
    lens = np.array(data.draw(st.lists(st.integers(0, width * page_size), min_size=batch, max_size=batch)))
    bt = np.array(data.draw(st.lists(st.lists(st.integers(-2, 12), min_size=width, max_size=width),
                                     min_size=batch, max_size=batch)), np.int32)
    need = -(-lens // page_size)
    bad = [(b, j) for b in range(batch) for j in range(need[b]) if not 0 <= bt[b, j] < num_pages]
    if bad:
        b, j = bad[0]
        with pytest.raises(ValueError, match=re.escape(f"block_table[{b}, {j}]={bt[b, j]}")):
            check_table(bt, lens, page_size, num_pages)
    else:
        check_table(bt, lens, page_size, num_pages)


# ----------------------------------------------------------------------------------------------
# PagedKVCache constructor: argument errors are raised before anything is allocated


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_pages=0), r"num_pages=0 must be a positive integer"),
    (dict(num_pages=-3), r"num_pages=-3"),
    (dict(num_pages=4.0), r"num_pages=4\.0"),
    (dict(page_size=0), r"page_size=0"),
    (dict(num_kv_heads=0), r"num_kv_heads=0"),
    (dict(head_dim=0), r"head_dim=0"),
    (dict(head_dim=100), r"head_dim=100 must be a multiple of 8"),
    (dict(head_dim=12), r"head_dim=12 must be a multiple of 8"),
    (dict(layout="interleaved"), r"layout='interleaved'; accepted: separate, combined, layers"),
    (dict(layout="layers", num_layers=0), r"num_layers=0"),
    (dict(layout="layers", num_layers=2, layer=2), r"layer=2 must be in 0\.\.1"),
    (dict(layout="layers", num_layers=2, layer=-1), r"layer=-1 must be in 0\.\.1"),
])
def test_cache_constructor_value_errors(kwargs, match):
    args = dict(num_pages=4, page_size=16, num_kv_heads=2, head_dim=64, dtype="float16")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        PagedKVCache(**args)


@pytest.mark.parametrize("dtype", ["float32", "int8", np.float32])
def test_cache_constructor_bad_dtype(dtype):
    with pytest.raises(TypeError, match=r"dtype=.* is not supported"):
        PagedKVCache(4, 16, 2, 64, dtype=dtype)


# ----------------------------------------------------------------------------------------------
# element offsets: K/V element (page, tok, head, dim) lives at base + dot(strides, index)


def _views(layout, P, ps, H, D, L=3, layer=1):
    """Storage and K/V views exactly as cukv/kvcache.py builds them, over a NumPy array whose values are their
    own flat element offsets."""
    if layout == "separate":
        n = P * ps * H * D
        ks = np.arange(n, dtype=np.int64).reshape(P, ps, H, D)
        vs = np.arange(n, 2 * n, dtype=np.int64).reshape(P, ps, H, D)
        return (ks, vs), ks, vs
    shape = (P, 2, ps, H, D) if layout == "combined" else (P, 2, L, ps, H, D)
    st_ = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    if layout == "combined":
        return st_, st_[:, 0], st_[:, 1]
    return st_, st_[:, 0, layer], st_[:, 1, layer]


def _base(view, storage):
    return (view.__array_interface__["data"][0] - storage.__array_interface__["data"][0]) // view.itemsize


@pytest.mark.parametrize("layout", LAYOUTS)
@given(P=st.integers(1, 6), ps=st.integers(1, 5), H=st.integers(1, 3), D=st.sampled_from([8, 16, 24]),
       data=st.data())
def test_element_offsets_per_layout(layout, P, ps, H, D, data):
    storage, k, v = _views(layout, P, ps, H, D)
    for view, stor in ((k, storage[0] if layout == "separate" else storage),
                       (v, storage[1] if layout == "separate" else storage)):
        s = elem_strides(view)
        assert len(s) == 4 and s[3] == 1
        base = _base(view, stor)
        flat = stor.reshape(-1)
        for _ in range(5):
            idx = tuple(data.draw(st.integers(0, n - 1)) for n in (P, ps, H, D))
            off = base + int(np.dot(s, idx))
            assert flat[off] == view[idx]
            assert view[idx] == stor.reshape(-1)[0] + off  # the values are their own offsets


def test_layout_strides_match_cache_py_rule():
    P, ps, H, D, L = 5, 16, 8, 128, 4
    _, k, v = _views("combined", P, ps, H, D)
    assert elem_strides(k) == elem_strides(v) == (2 * ps * H * D, H * D, D, 1)
    st_, k, v = _views("layers", P, ps, H, D, L=L, layer=2)
    assert elem_strides(k) == (2 * L * ps * H * D, H * D, D, 1)
    assert _base(k, st_) == 2 * ps * H * D and _base(v, st_) == (L + 2) * ps * H * D
    _, k, v = _views("separate", P, ps, H, D)
    assert elem_strides(k) == (ps * H * D, H * D, D, 1)


def test_large_page_ids_need_64_bit_offsets():
    """A real combined layout with H=8, D=128, ps=16: page 100_000 sits past 2**31 elements, so offsets
    computed in 32 bits would wrap. The kernel argument carries 64-bit strides."""
    ps, H, D = 16, 8, 128
    _, k, v = _views("combined", 2, ps, H, D)  # tiny storage: only its strides are used
    ks, vs = elem_strides(k), elem_strides(v)
    v_base = _base(v, _views("combined", 2, ps, H, D)[0])
    page, tok, head, dim = 100_000, ps - 1, H - 1, D - 1
    off_k = sum(a * b for a, b in zip(ks, (page, tok, head, dim)))  # Python ints: exact
    off_v = v_base + sum(a * b for a, b in zip(vs, (page, tok, head, dim)))
    assert off_k == page * 2 * ps * H * D + tok * H * D + head * D + dim
    assert off_k > 2**31 and off_v > 2**31
    with np.errstate(over="ignore"):
        wrapped = int(np.dot(np.array(ks, np.int32), np.array((page, tok, head, dim), np.int32)))
    assert wrapped != off_k  # 32-bit arithmetic is wrong here
    assert int(np.dot(np.array(ks, np.int64), np.array((page, tok, head, dim), np.int64))) == off_k
    assert KV_PARAMS["k_stride"].base == np.dtype("i8") and KV_PARAMS["v_stride"].base == np.dtype("i8")
    assert KV_PARAMS["num_pages"] == np.dtype("i8")


class _HostCupy(types.ModuleType):
    """Just enough of `cupy` for PagedKVCache's constructor to run on NumPy arrays."""

    def __init__(self):
        super().__init__("cupy")
        self.empty = np.empty


@pytest.mark.parametrize("layout", LAYOUTS)
def test_paged_kv_cache_views_follow_the_rule(layout, monkeypatch):
    """PagedKVCache itself (with NumPy standing in for CuPy): its k/v views and k_strides/v_strides are
    what the kernels are given, and they must address the element the view does."""
    monkeypatch.setitem(sys.modules, "cupy", _HostCupy())
    P, ps, H, D, L = 3, 4, 2, 16, 3
    c = PagedKVCache(P, ps, H, D, dtype="bf16", layout=layout, num_layers=L, layer=L - 1, fill=0)
    assert c.dtype == "bfloat16" and c.k.dtype == np.uint16 and c.num_slots == P * ps
    assert c.k.shape == c.v.shape == (P, ps, H, D)
    stor = c.storage if not isinstance(c.storage, tuple) else None
    rng = np.random.default_rng(0)
    for name, view, strides in (("k", c.k, c.k_strides), ("v", c.v, c.v_strides)):
        base_arr = stor if stor is not None else c.storage[0 if name == "k" else 1]
        base = _base(view, base_arr)
        flat = base_arr.reshape(-1)
        assert strides[3] == 1
        for _ in range(20):
            idx = tuple(int(rng.integers(0, n)) for n in (P, ps, H, D))
            marker = np.uint16(rng.integers(1, 60000))
            view[idx] = marker
            assert flat[base + int(np.dot(strides, idx))] == marker
            view[idx] = 0
    if layout != "separate":  # K and V never overlap
        c.k[...] = 1
        assert not c.v.any()
    c.fill("nan")
    assert (c.k == 0x7FC0).all() and (c.v == 0x7FC0).all()
