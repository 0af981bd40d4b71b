"""Sparse MLA without a GPU: the shipped specializations compile for sm_90a without spills, the config domain,
the reference's properties, the index helper, and named errors."""
import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cukv import compiler, reference
from cukv.configs.sparse_mla import SparseMLAConfig
from cukv.policy.mla_decode import sparse_shipped as shipped
from cukv.ops.sparse_mla import SparseMLA, plan_work, sparse_indices

ARCH = "sm_90a"

pytestmark = pytest.mark.usefixtures("fresh_kernel_cache")


@pytest.mark.compile_ahead(build=lambda cfg: cfg, arch=ARCH)
@pytest.mark.parametrize("cfg", shipped(), ids=lambda c: c.name)
def test_shipped_sparse_compiles_without_spills(cfg):
    mod = compiler.compile_source(cfg.name, cfg.render(), arch=ARCH)
    for r in mod.functions.values():
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0, r
    assert {cfg.name, cfg.name + "_combine"} <= set(mod.functions)


def _pair():
    return SparseMLA(128, schedule="alternate", multicast=True).config


@pytest.mark.compile_ahead(build=_pair, arch=ARCH)
def test_per_slice_pair_compiles_without_spills():
    """The opt-in cluster pair of the per-slice consumers (each block gathers half of every slice)."""
    cfg = _pair()
    assert cfg.multicast and cfg.slice_release and cfg.name.endswith("_alt_slices_nq_mc_lr")
    r = compiler.compile_source(cfg.name, cfg.render(), arch=ARCH).functions[cfg.name]
    assert r.spill_stores == 0 and r.stack_frame == 0
    assert "__cluster_dims__(2, 1, 1)" in cfg.render()
    assert not SparseMLA(128).config.multicast  # off by default (SPARSE_SLICES_MULTICAST)
    with pytest.raises(ValueError, match="row blocks"):
        SparseMLA(64, schedule="alternate", multicast=True)


def _persistent():
    return SparseMLA(128, persistent=True).config


@pytest.mark.compile_ahead(build=_persistent, arch=ARCH)
def test_persistent_blocks_opt_in():
    """The opt-in persistent blocks of the per-slice gathers (not shipped: slower, docs/history/sparse-mla.md): the
    producer's item loop spills 8 bytes in its 56 registers (the consumers spill at 216, so they keep 224)."""
    cfg = _persistent()
    assert cfg.persistent and cfg.slice_release and cfg.name.endswith("_alt_slices_ps_lr") and cfg.regs == (56, 224)
    r = compiler.compile_source(cfg.name, cfg.render(), arch=ARCH).functions[cfg.name]
    assert r.spill_stores <= 8 and r.stack_frame <= 8, r
    assert "#define CUKV_MLA_PERSISTENT 1" in cfg.render()
    assert not SparseMLA(128).config.persistent  # off by default (SPARSE_PERSISTENT)
    for kw in (dict(num_heads=16), dict(num_heads=128, kv_dtype="fp8_e4m3"), dict(num_heads=128, multicast=True)):
        with pytest.raises(ValueError, match="persistent=True runs the per-slice gathers"):
            SparseMLA(**kw, persistent=True)
    with pytest.raises(ValueError, match=r"SparseMLAConfig\.persistent=True is not valid: .*multicast=False"):
        dataclasses.replace(SparseMLA(128, multicast=True).config, persistent=True)


@pytest.mark.compile_ahead(build=lambda: SparseMLAConfig("bfloat16", 32, 4, "fp8_e4m3"), arch=ARCH)
def test_block_n_32_compiles_without_spills():
    cfg = SparseMLAConfig("bfloat16", 32, 4, "fp8_e4m3")
    r = compiler.compile_source(cfg.name, cfg.render(), arch=ARCH).functions[cfg.name]
    assert r.spills == 0 and r.stack_frame == 0


@given(dtype=st.sampled_from(["bfloat16", "float16", "float32"]), block_n=st.sampled_from([16, 32, 64]),
       stages=st.integers(1, 9), fp8=st.booleans(), schedule=st.sampled_from(["split", "alternate"]),
       slices=st.booleans())
def test_config_domain(dtype, block_n, stages, fp8, schedule, slices):
    kvd = "fp8_e4m3" if fp8 else None
    barriers = 8 * (2 + 2 * stages * (9 if slices else 1))
    smem = 64 * 576 * 2 + stages * block_n * 576 * 2 + block_n * 128 + 2048 + (barriers + 63) // 64 * 64 \
        + (16 * stages + 63) // 64 * 64
    # "split", or the alternating consumers over per-slice barriers (16-bit rows, 64-token tiles)
    form = (schedule == "split" and not slices) or (schedule == "alternate" and slices and block_n == 64 and not fp8)
    valid = (dtype != "float32" and block_n in (32, 64) and 2 <= stages <= 8 and form
             and (not fp8 or dtype == "bfloat16") and smem <= 227 * 1024)
    if not valid:
        with pytest.raises(ValueError, match=r"(SparseMLA|MLADecode)Config\.(dtype|block_n|num_kv_stages|kv_dtype|"
                                             r"schedule|slice_release)"):
            SparseMLAConfig(dtype, block_n, stages, kvd, schedule, slice_release=slices)
        return
    cfg = SparseMLAConfig(dtype, block_n, stages, kvd, schedule, slice_release=slices)
    assert cfg.smem_bytes == smem
    assert f"static_assert(Pipe::smem_bytes == {cfg.smem_bytes}" in cfg.render()


def test_reference_properties():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((40, 576))
    rows[30:] = np.nan  # never indexed validly below
    q = rng.standard_normal((4, 3, 576))
    idx = np.array([[1, 5, 7, 9], [-1, 2 ** 31 - 1, 40, -2 ** 31], [3, 3, 8, 30], [2, 4, 6, 31]])
    lens = np.array([4, 4, 2, 3])
    sink = np.array([0.5, -np.inf, np.inf])
    out, lse, mx = reference.sparse_mla(q, rows, idx, lens, sink)
    assert np.isfinite(out).all()
    # token 1: nothing valid; token 2: the duplicate row 3 twice (row 30 behind the cut is never read)
    assert (out[1] == 0).all() and np.isneginf(lse[1]).all() and np.isneginf(mx[1]).all()
    s = q[2] @ rows[[3, 3]].T / np.sqrt(576)
    np.testing.assert_allclose(lse[2], np.log(np.exp(s).sum(1)))
    np.testing.assert_allclose(mx[0], (q[0] @ rows[[1, 5, 7, 9]].T / np.sqrt(576)).max(1))
    # a sink of -inf changes nothing, +inf zeroes the output; LSE never includes it
    plain, plain_lse, _ = reference.sparse_mla(q, rows, idx, lens)
    np.testing.assert_allclose(out[:, 1], plain[:, 1])
    assert (out[:, 2] == 0).all()
    np.testing.assert_allclose(lse, plain_lse)
    # one token's keys merged: sparse = the MLA decode of those rows
    want, want_lse = reference.mla_decode(q[:1, None], rows[None, [1, 5, 7, 9]], [[0, 1, 2, 3]], [4])
    np.testing.assert_allclose(plain[0], want[0, 0])
    np.testing.assert_allclose(plain_lse[0], want_lse[0, 0])


def test_sparse_indices_through_a_page_table():
    table = np.array([[4, 1, 7], [2, 0, -1]], np.int32)
    pos = np.array([[[0, 5, 9, 12]], [[3, 8, 11, -4]]])  # [B, s_q, topk]
    got = sparse_indices(pos, table, 4)
    assert got.dtype == np.int32 and got.shape == pos.shape
    assert got.tolist() == [[[16, 5, 29, -1]], [[11, -1, -1, -1]]]
    req = np.array([1, 0])
    assert sparse_indices(pos[:, 0], table, 4, request=req).tolist() == [[8, 1, -1, -1], [19, 28, 31, -1]]
    with pytest.raises(ValueError, match="request"):
        sparse_indices(pos[:, 0], table, 4, request=np.array([1]))
    with pytest.raises(ValueError, match="page_size"):
        sparse_indices(pos, table, 0)


def test_named_errors_before_any_gpu_work():
    with pytest.raises(ValueError, match="num_heads"):
        SparseMLA(0)
    with pytest.raises(ValueError, match="num_heads"):
        SparseMLA(129)
    with pytest.raises(TypeError, match="kv_dtype"):
        SparseMLA(16, "float16", kv_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="block_n"):
        SparseMLA(16, block_n=128)
    with pytest.raises(TypeError, match="dtype"):
        SparseMLA(16, "float32")


@given(tokens=st.integers(1, 300), topk=st.integers(1, 16384), nrb=st.integers(1, 2), sms=st.sampled_from([8, 132]),
       block_n=st.sampled_from([32, 64]))
def test_plan_work_covers_every_list_once(tokens, topk, nrb, sms, block_n):
    items, indptr, slots, c = plan_work(tokens, topk, nrb, block_n, sms)
    spans = {}
    for b, rb, begin, end, part in items[:, :5].tolist():
        spans.setdefault((b, rb), []).append((begin, end, part))
    assert set(spans) == {(b, rb) for b in range(tokens) for rb in range(nrb)}
    for (b, rb), sp in spans.items():
        sp.sort()
        assert sp[0][0] == 0 and sp[-1][1] == topk and all(x[1] == y[0] for x, y in zip(sp, sp[1:]))
        assert all(s[0] % block_n == 0 for s in sp)
        k = b * nrb + rb
        if len(sp) == 1:  # written directly: no partial, nothing for the combine
            assert sp[0][2] == -1 and indptr[k + 1] == indptr[k]
        else:
            assert sorted(slots[indptr[k]:indptr[k + 1]].tolist()) == sorted(s[2] for s in sp)
    assert sorted(slots.tolist()) == list(range(len(slots)))  # compact partial slots, each once
    assert indptr[-1] == len(slots) and (np.diff(indptr) >= 0).all()


@pytest.mark.parametrize("tokens,row_blocks,sms", [(66, 2, 66), (132, 2, 132), (500, 1, 132), (4096, 2, 132)])
def test_plan_work_whole_lists_shortcut_matches_the_search(tokens, row_blocks, sms):
    """With at least two (token, row block)s per SM the plan keeps whole lists; the shortcut gives the search's items."""
    from cukv.policy.mla_decode import plan_items

    items, indptr, slots, c = plan_work(tokens, 1000, row_blocks, 64, sms)
    searched, _ = plan_items(np.full(tokens, 1000), row_blocks, 64, sms, None)
    assert slots.size == 0 and c == 16
    assert items[:, :4].tolist() == [list(x[:4]) for x in searched]


def test_combine_list_names_the_split_row_blocks():
    from cukv.ops.mla_decode import combine_list
    items, indptr, slots, c = plan_work(num_tokens=3, topk=4096, row_blocks=2, block_n=64, num_sms=132)
    listed = combine_list(indptr)
    split = sorted({int(b) * 2 + int(rb) for b, rb, _, _, part in items[:, :5] if part >= 0})
    assert listed.dtype == np.int32 and listed[:, 0].tolist() == split and len(split) == 6
    for k, first, n, _ in listed:  # each row block's partial slots, as rb_slots holds them
        assert (first, n) == (indptr[k], indptr[k + 1] - indptr[k])
    # one chunk: written directly, not listed
    assert combine_list(np.array([0, 0, 1, 3, 3, 5])).tolist() == [[2, 1, 2, 0], [4, 3, 2, 0]]
