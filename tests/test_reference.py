"""Properties of the float64 reference every kernel is tested against (cukv.reference)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cukv import reference


def _qkv(rng, tq, hq, hkv, n, d, dv=None, scale=1.0):
    q = rng.standard_normal((tq, hq, d)) * scale
    k = rng.standard_normal((n, hkv, d)) * scale
    v = rng.standard_normal((n, hkv, dv or d))
    return q, k, v


def _naive(q, k, v, *, sm_scale=None, softcap=None, sink=None):
    """One query row per head, written out: softmax over all keys given, kv head h // group."""
    tq, hq, d = q.shape
    group = hq // k.shape[1]
    scale = 1 / np.sqrt(d) if sm_scale is None else sm_scale
    out = np.zeros((tq, hq, v.shape[-1]))
    lse = np.zeros((tq, hq))
    for t in range(tq):
        for h in range(hq):
            s = k[:, h // group] @ q[t, h] * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            m = s.max()
            e = np.exp(s - m)
            den = e.sum() + (np.exp(sink[h] - m) if sink is not None else 0.0)
            out[t, h] = e @ v[:, h // group] / den
            lse[t, h] = m + np.log(e.sum())
    return out, lse


def test_decode_over_one_page_equals_dense(rng):
    ps, hq, hkv, d, n = 16, 8, 2, 32, 11
    k_pages = np.full((4, ps, hkv, d), np.nan)
    v_pages = np.full((4, ps, hkv, d), np.nan)
    q, k, v = _qkv(rng, 1, hq, hkv, n, d)
    k_pages[2, :n], v_pages[2, :n] = k, v
    out, lse = reference.decode(q, k_pages, v_pages, np.array([[2, 0]]), np.array([n]))
    ro, rl = reference.attention(q, k, v, [n - 1])
    np.testing.assert_allclose(out, ro, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, rl, rtol=1e-12, atol=1e-12)
    no, nl = _naive(q, k, v)
    np.testing.assert_allclose(out, no, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, nl, rtol=1e-10, atol=1e-12)


@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 3), st.integers(1, 40), st.sampled_from([1, 2, 3, 8]),
       st.integers(0, 2**32 - 1))
def test_decode_over_shuffled_pages_equals_dense(batch, group, hkv, max_len, ps, seed):
    rng = np.random.default_rng(seed)
    d = 8
    lengths = rng.integers(0, max_len + 1, size=batch)
    pages_per = -(-lengths // ps)
    num_pages = int(pages_per.sum()) + 2
    ids = rng.permutation(num_pages)
    k_pages = np.full((num_pages, ps, hkv, d), np.nan)  # unused slots are poison
    v_pages = np.full((num_pages, ps, hkv, d), np.nan)
    table = np.zeros((batch, max(1, int(pages_per.max()))), np.int64)
    q = rng.standard_normal((batch, group * hkv, d))
    dense, cur = [], 0
    for b in range(batch):
        table[b, :pages_per[b]] = ids[cur: cur + pages_per[b]]
        cur += pages_per[b]
        k = rng.standard_normal((lengths[b], hkv, d))
        v = rng.standard_normal((lengths[b], hkv, d))
        pos = np.arange(lengths[b])
        k_pages[table[b, pos // ps], pos % ps] = k
        v_pages[table[b, pos // ps], pos % ps] = v
        dense.append((k, v))
    out, lse = reference.decode(q, k_pages, v_pages, table, lengths)
    assert out.shape == (batch, group * hkv, d) and lse.shape == (batch, group * hkv)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    for b, (k, v) in enumerate(dense):
        if lengths[b] == 0:
            assert (out[b] == 0).all() and np.isneginf(lse[b]).all()
            continue
        no, nl = _naive(q[b: b + 1], k, v)
        np.testing.assert_allclose(out[b], no[0], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse[b], nl[0], rtol=1e-10, atol=1e-12)


@given(st.integers(2, 30), st.integers(1, 3), st.integers(1, 2), st.integers(0, 2**32 - 1))
def test_split_and_merge_equals_full(n, group, hkv, seed):
    rng = np.random.default_rng(seed)
    q, k, v = _qkv(rng, 2, group * hkv, hkv, n, 8, dv=5, scale=1.5)
    first = rng.random(n) < 0.5
    full_o, full_l = reference.attention(q, k, v, [n - 1, n - 1], causal=False)
    oa, la = reference.attention(q, k, v, [0, 0], key_valid=first, causal=False)
    ob, lb = reference.attention(q, k, v, [0, 0], key_valid=~first, causal=False)
    mo, ml = reference.merge_states([oa, ob], [la, lb])
    np.testing.assert_allclose(mo, full_o, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ml, full_l, rtol=1e-10, atol=1e-12)
    # merging with an empty part (LSE -inf) changes nothing, and the order of parts does not matter
    empty_o, empty_l = reference.attention(q, k, v, [0, 0], key_valid=np.zeros(n, bool), causal=False)
    mo3, ml3 = reference.merge_states([ob, empty_o, oa], [lb, empty_l, la])
    np.testing.assert_allclose(mo3, full_o, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ml3, full_l, rtol=1e-10, atol=1e-12)


def test_merge_of_only_empty_parts():
    o, lse = reference.merge_states([np.full((2, 3), np.nan)] * 2, [np.full(2, -np.inf)] * 2)
    assert (o == 0).all() and np.isneginf(lse).all()


def test_sink_lowers_output_and_keeps_lse(rng):
    hq, hkv, n, d = 4, 2, 9, 16
    q, k, v = _qkv(rng, 1, hq, hkv, n, d)
    o, lse = reference.attention(q, k, v, [n - 1])
    sink = np.array([-1.0, 0.5, 3.0, 20.0])
    os_, lses = reference.attention(q, k, v, [n - 1], sink=sink)
    np.testing.assert_array_equal(lses, lse)  # the sink is not part of the LSE
    assert (np.linalg.norm(os_, axis=-1) < np.linalg.norm(o, axis=-1)).all()
    # exactly: o_sink = o * S / (S + e^sink), S = e^lse
    factor = 1.0 / (1.0 + np.exp(sink[None, :] - lse))
    np.testing.assert_allclose(os_, o * factor[..., None], rtol=1e-12)
    no, _ = _naive(q, k, v, sink=sink)
    np.testing.assert_allclose(os_, no, rtol=1e-10, atol=1e-14)
    assert np.abs(os_[0, 3]).max() < 1e-5  # a huge sink takes (almost) all of the mass


@pytest.mark.parametrize("kw", [
    dict(key_valid=np.zeros(6, bool)),
    dict(key_valid=np.zeros(6, bool), sink=np.zeros(4)),
    dict(key_valid=np.zeros(6, bool), softcap=2.0),
    dict(q_pos=[-1]),                         # causal: no key at or before position -1
    dict(q_pos=[-1], window=3, sink=np.ones(4)),
])
def test_fully_masked_row_is_zero_and_neg_inf(rng, kw):
    q, k, v = _qkv(rng, 1, 4, 2, 6, 8)
    q_pos = kw.pop("q_pos", [5])
    with np.errstate(all="raise"):  # not even an invalid-value warning on the way
        o, lse = reference.attention(q, k, v, q_pos, **kw)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert (o == 0).all()
    assert np.isneginf(lse).all()


def test_decode_of_empty_sequence(rng):
    q = rng.standard_normal((2, 4, 8))
    pages = rng.standard_normal((3, 4, 2, 8))
    o, lse = reference.decode(q, pages, pages, np.array([[0], [1]]), np.array([0, 3]))
    assert (o[0] == 0).all() and np.isneginf(lse[0]).all()
    assert np.isfinite(o[1]).all() and np.isfinite(lse[1]).all()


@given(st.floats(0.1, 50.0), st.floats(0.5, 30.0), st.integers(0, 2**32 - 1))
def test_softcap_bounds_scores(cap, spread, seed):
    rng = np.random.default_rng(seed)
    n, d = 7, 8
    q, k, v = _qkv(rng, 1, 2, 1, n, d, scale=spread)
    raw = np.einsum("hd,ld->hl", q[0], k[:, 0]) / np.sqrt(d)
    for j in range(n):  # with a single visible key, the LSE is that key's score
        one = np.zeros(n, bool)
        one[j] = True
        _, lse = reference.attention(q, k, v, [n - 1], key_valid=one, softcap=cap)
        s = lse[0]
        assert (np.abs(s) <= cap).all()
        np.testing.assert_allclose(s, cap * np.tanh(raw[:, j] / cap), rtol=1e-12, atol=1e-12)
    o, lse = reference.attention(q, k, v, [n - 1], softcap=cap)
    assert (lse <= cap + np.log(n) + 1e-12).all() and (lse >= -cap + np.log(n) - 1e-12).all()
    no, nl = _naive(q, k, v, softcap=cap)
    np.testing.assert_allclose(o, no, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, nl, rtol=1e-10, atol=1e-12)


@given(st.integers(1, 16), st.integers(1, 3), st.integers(1, 12), st.integers(0, 2**32 - 1))
def test_gqa_head_uses_kv_head_h_div_group(group, hkv, n, seed):
    rng = np.random.default_rng(seed)
    hq, d = group * hkv, 8
    q, k, v = _qkv(rng, 1, hq, hkv, n, d)
    o, lse = reference.attention(q, k, v, [n - 1])
    for h in range(hq):
        oh, lh = reference.attention(q[:, h: h + 1], k[:, h // group: h // group + 1], v[:, h // group: h // group + 1],
                                     [n - 1])
        np.testing.assert_allclose(o[:, h], oh[:, 0], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(lse[:, h], lh[:, 0], rtol=1e-12, atol=1e-14)


def test_causal_and_window_masks(rng):
    n = 10
    q, k, v = _qkv(rng, 3, 2, 1, n, 8)
    pos = [2, 6, 9]
    o, lse = reference.attention(q, k, v, pos, window=4)
    for t, p in enumerate(pos):
        keep = (np.arange(n) <= p) & (np.arange(n) > p - 4)
        no, nl = _naive(q[t: t + 1], k[keep], v[keep])
        np.testing.assert_allclose(o[t], no[0], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse[t], nl[0], rtol=1e-10, atol=1e-12)


def test_append_writes_slots_and_skips_padding(rng):
    P, ps, H, D = 3, 4, 2, 8
    k_pages = np.zeros((P, ps, H, D))
    v_pages = np.zeros((P, ps, H, D))
    k_new = rng.standard_normal((6, H, D))
    v_new = rng.standard_normal((6, H, D))
    slots = np.array([5, -1, 11, P * ps, 0, -7])  # -1 padding, past the end, other negatives: skipped
    before_k = k_pages.copy()
    reference.append(k_pages, v_pages, k_new, v_new, slots)
    np.testing.assert_array_equal(k_pages[1, 1], k_new[0])
    np.testing.assert_array_equal(v_pages[1, 1], v_new[0])
    np.testing.assert_array_equal(k_pages[2, 3], k_new[2])
    np.testing.assert_array_equal(k_pages[0, 0], k_new[4])
    written = np.zeros((P, ps), bool)
    written[1, 1] = written[2, 3] = written[0, 0] = True
    np.testing.assert_array_equal(k_pages[~written], before_k[~written])
    np.testing.assert_array_equal(v_pages[~written], 0)
    # the last slot -7 would index page -2 from the end if it were not skipped
    assert not np.isin(k_new[5], k_pages).any() and not np.isin(k_new[3], k_pages).any()


def test_append_then_decode_round_trip(rng):
    P, ps, H, D, n = 6, 4, 2, 8, 13
    k_pages = np.full((P, ps, H, D), np.nan)
    v_pages = np.full((P, ps, H, D), np.nan)
    table = np.array([[4, 0, 5, 2]])
    pos = np.arange(n)
    slots = table[0, pos // ps] * ps + pos % ps
    k, v = rng.standard_normal((n, H, D)), rng.standard_normal((n, H, D))
    reference.append(k_pages, v_pages, k, v, np.concatenate([slots, [-1, -1]]))  # padding has no data
    np.testing.assert_array_equal(reference.gather(k_pages, table[0], n), k)
    q = rng.standard_normal((1, 4, D))
    o, lse = reference.decode(q, k_pages, v_pages, table, [n])
    ro, rl = reference.attention(q, k, v, [n - 1])
    np.testing.assert_allclose(o, ro, rtol=1e-12)
    np.testing.assert_allclose(lse, rl, rtol=1e-12)


@given(st.integers(1, 20), st.sampled_from([1, 4, 16]), st.integers(0, 2**32 - 1))
def test_nan_in_unused_slots_does_not_leak(n, ps, seed):
    rng = np.random.default_rng(seed)
    H, D = 2, 8
    pages = -(-n // ps) + 2
    k_pages = np.full((pages, ps, H, D), np.nan)
    v_pages = np.full((pages, ps, H, D), np.inf)
    table = np.array([rng.permutation(pages)])
    pos = np.arange(n)
    k_pages[table[0, pos // ps], pos % ps] = rng.standard_normal((n, H, D))
    v_pages[table[0, pos // ps], pos % ps] = rng.standard_normal((n, H, D))
    q = rng.standard_normal((1, 4, D))
    o, lse = reference.decode(q, k_pages, v_pages, table, [n], window=max(1, n // 2), softcap=5.0)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
