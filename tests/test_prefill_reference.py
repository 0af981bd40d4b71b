"""Properties of the float64 ragged-prefill reference (cukv.reference.prefill_contiguous / prefill_paged).

Every kernel's prefill is tested against this reference, so it is checked here against independent
computations: a written-out loop over (sequence, query, head) with its own mask rule, dense softmax
forms, LSE merging of disjoint key sets, and the identities between masks."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cukv import reference

SEEDS = st.integers(0, 2**32 - 1)


def _batch(rng, q_lens, cache_lens, hq, hkv, d, dv=None):
    q_lens, cache_lens = np.asarray(q_lens), np.asarray(cache_lens)
    kv_lens = q_lens + cache_lens
    q = rng.standard_normal((int(q_lens.sum()), hq, d))
    k = rng.standard_normal((int(kv_lens.sum()), hkv, d))
    v = rng.standard_normal((int(kv_lens.sum()), hkv, dv or d))
    qo = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    ko = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    return q, qo, k, v, ko


def _naive(q, qo, k, v, ko, *, mask="causal", window=None, chunk=None, softcap=None, sink=None, sm_scale=None):
    """One (sequence, query, head) at a time, visibility spelled out from design.md section 3."""
    hq, d = q.shape[1:]
    group = hq // k.shape[1]
    scale = 1 / np.sqrt(d) if sm_scale is None else sm_scale
    out = np.zeros((q.shape[0], hq, v.shape[-1]))
    lse = np.full((q.shape[0], hq), -np.inf)
    for b in range(len(qo) - 1):
        q_len, kv_len = qo[b + 1] - qo[b], ko[b + 1] - ko[b]
        for i in range(q_len):
            p = kv_len - q_len + i  # bottom-right aligned
            keys = [j for j in range(kv_len)
                    if (mask == "none" or j <= p)
                    and (window is None or p - window < j)
                    and (chunk is None or j // chunk == p // chunk)]
            for h in range(hq):
                if not keys:
                    continue
                kk = k[ko[b] + np.array(keys), h // group]
                vv = v[ko[b] + np.array(keys), h // group]
                s = kk @ q[qo[b] + i, h] * scale
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                m = s.max()
                e = np.exp(s - m)
                den = e.sum() + (np.exp(sink[h] - m) if sink is not None else 0.0)
                out[qo[b] + i, h] = e @ vv / den
                lse[qo[b] + i, h] = m + np.log(e.sum())
    return out, lse


def _close(a, b):
    np.testing.assert_allclose(a[0], b[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(a[1], b[1], rtol=1e-10, atol=1e-12)


lens = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 9)), min_size=1, max_size=3)


@given(lens, st.integers(1, 3), st.integers(1, 2), st.sampled_from(["none", "causal"]),
       st.none() | st.integers(1, 10), st.none() | st.integers(1, 8), st.none() | st.floats(0.5, 20.0),
       st.booleans(), st.none() | st.floats(0.05, 2.0), SEEDS)
def test_matches_written_out_loop(qc, group, hkv, mask, window, chunk, softcap, use_sink, sm_scale, seed):
    rng = np.random.default_rng(seed)
    hq = group * hkv
    q, qo, k, v, ko = _batch(rng, [a for a, _ in qc], [c for _, c in qc], hq, hkv, 8, dv=5)
    kw = dict(mask=mask, window=window, chunk=chunk, softcap=softcap, sm_scale=sm_scale,
              sink=rng.standard_normal(hq) * 2 if use_sink else None)
    got = reference.prefill_contiguous(q, qo, k, v, ko, **kw)
    assert got[0].shape == (q.shape[0], hq, 5) and got[1].shape == (q.shape[0], hq)
    assert not np.isnan(got[0]).any() and not np.isnan(got[1]).any()
    _close(got, _naive(q, qo, k, v, ko, **kw))


@given(st.integers(1, 7), st.integers(1, 12), st.integers(1, 4), st.integers(1, 2), SEEDS)
def test_one_sequence_mask_none_is_dense_softmax(q_len, kv_len, group, hkv, seed):
    rng = np.random.default_rng(seed)
    hq, d = group * hkv, 8
    q, k, v = rng.standard_normal((q_len, hq, d)), rng.standard_normal((kv_len, hkv, d)), rng.standard_normal((kv_len, hkv, d))
    out, lse = reference.prefill_contiguous(q, [0, q_len], k, v, [0, kv_len], mask="none")
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("qhd,khd->hqk", q, kk) / np.sqrt(d)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), vv)
    want_lse = (np.log(np.exp(s).sum(-1))).T
    np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-10, atol=1e-12)


@given(st.integers(1, 12), st.integers(1, 3), SEEDS)
def test_causal_square_is_lower_triangular(n, group, seed):
    rng = np.random.default_rng(seed)
    hq, hkv, d = group * 2, 2, 8
    q, k, v = rng.standard_normal((n, hq, d)), rng.standard_normal((n, hkv, d)), rng.standard_normal((n, hkv, d))
    out, lse = reference.prefill_contiguous(q, [0, n], k, v, [0, n], mask="causal")
    for h in range(hq):
        s = q[:, h] @ k[:, h // group].T / np.sqrt(d)
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)  # query i (position i) sees keys 0..i
        p = np.exp(s - s.max(-1, keepdims=True))
        np.testing.assert_allclose(out[:, h], (p / p.sum(-1, keepdims=True)) @ v[:, h // group], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse[:, h], np.log(np.exp(s).sum(-1)), rtol=1e-10, atol=1e-12)


@given(lens.filter(lambda qc: any(a for a, _ in qc)), st.data(), st.booleans(), SEEDS)
def test_prefix_and_suffix_merged_by_lse_equal_the_whole(qc, data, use_sink, seed):
    """Cascade: the keys before a cut c <= cache_len are visible to every query (mask none), the rest is a
    causal prefill of its own; merging the two by LSE gives the causal attention over all keys."""
    rng = np.random.default_rng(seed)
    hq, hkv = 4, 2
    q_lens, cache_lens = [a for a, _ in qc], [c for _, c in qc]
    q, qo, k, v, ko = _batch(rng, q_lens, cache_lens, hq, hkv, 8)
    cuts = [data.draw(st.integers(0, c)) for c in cache_lens]
    pre = np.concatenate([np.arange(ko[b], ko[b] + cuts[b]) for b in range(len(cuts))]).astype(int)
    suf = np.concatenate([np.arange(ko[b] + cuts[b], ko[b + 1]) for b in range(len(cuts))]).astype(int)
    pre_o = np.concatenate([[0], np.cumsum(cuts)])
    suf_o = ko - pre_o
    a = reference.prefill_contiguous(q, qo, k[pre], v[pre], pre_o, mask="none")
    b = reference.prefill_contiguous(q, qo, k[suf], v[suf], suf_o, mask="causal")
    merged = reference.merge_states([a[0], b[0]], [a[1], b[1]])
    sink = rng.standard_normal(hq) * 2 if use_sink else None
    whole = reference.prefill_contiguous(q, qo, k, v, ko, mask="causal", sink=sink)
    np.testing.assert_allclose(merged[1], whole[1], rtol=1e-10, atol=1e-12)
    if sink is None:
        np.testing.assert_allclose(merged[0], whole[0], rtol=1e-10, atol=1e-12)
    else:  # the sink joins the denominator once, after merging: o * S / (S + e^sink) with S = e^lse
        factor = 1.0 / (1.0 + np.exp(sink[None, :] - merged[1]))
        np.testing.assert_allclose(merged[0] * factor[..., None], whole[0], rtol=1e-10, atol=1e-12)


@given(lens, st.sampled_from(["none", "causal"]), st.integers(0, 5), SEEDS)
def test_chunk_or_window_covering_every_key_change_nothing(qc, mask, extra, seed):
    rng = np.random.default_rng(seed)
    q, qo, k, v, ko = _batch(rng, [a for a, _ in qc], [c for _, c in qc], 2, 1, 8)
    longest = max(1, int(np.diff(ko).max()))
    plain = reference.prefill_contiguous(q, qo, k, v, ko, mask=mask)
    _close(reference.prefill_contiguous(q, qo, k, v, ko, mask=mask, chunk=longest + extra), plain)
    _close(reference.prefill_contiguous(q, qo, k, v, ko, mask=mask, window=longest + extra), plain)
    # and a window of 1 with causal leaves each query exactly its own key
    if mask == "causal":
        o, lse = reference.prefill_contiguous(q, qo, k, v, ko, mask="causal", window=1)
        for bq in range(len(qo) - 1):
            ql, kl = qo[bq + 1] - qo[bq], ko[bq + 1] - ko[bq]
            for i in range(ql):
                p = kl - ql + i
                if p >= 0:
                    np.testing.assert_allclose(o[qo[bq] + i, 0], v[ko[bq] + p, 0], rtol=1e-12)


@given(st.integers(1, 30), st.integers(1, 8), SEEDS)
def test_chunked_causal_sees_its_chunk_up_to_itself(n, c, seed):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((n, 2, 8)), rng.standard_normal((n, 1, 8)), rng.standard_normal((n, 1, 8))
    o, lse = reference.prefill_contiguous(q, [0, n], k, v, [0, n], mask="causal", chunk=c)
    for i in (0, n // 2, n - 1):
        start = (i // c) * c  # Llama-4 style: the chunk begins at a multiple of c
        ro, rl = reference.attention(q[i: i + 1], k[start: i + 1], v[start: i + 1], [i - start])
        np.testing.assert_allclose(o[i], ro[0], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse[i], rl[0], rtol=1e-10, atol=1e-12)


@given(lens, st.sampled_from([1, 2, 3, 8]), st.sampled_from(["none", "causal"]), st.none() | st.integers(1, 6), SEEDS)
def test_paged_equals_contiguous(qc, ps, mask, window, seed):
    rng = np.random.default_rng(seed)
    hq, hkv, d = 4, 2, 8
    q, qo, k, v, ko = _batch(rng, [a for a, _ in qc], [c for _, c in qc], hq, hkv, d)
    kv_lens = np.diff(ko)
    pages_per = -(-kv_lens // ps)
    num_pages = int(pages_per.sum()) + 3
    ids = rng.permutation(num_pages)
    k_pages = np.full((num_pages, ps, hkv, d), np.nan)  # unused slots are poison
    v_pages = np.full((num_pages, ps, hkv, d), np.inf)
    table = np.zeros((len(kv_lens), max(1, int(pages_per.max()))), np.int32)
    cur = 0
    for b, n in enumerate(kv_lens):
        table[b, : pages_per[b]] = ids[cur: cur + pages_per[b]]
        cur += pages_per[b]
        pos = np.arange(n)
        k_pages[table[b, pos // ps], pos % ps] = k[ko[b]: ko[b + 1]]
        v_pages[table[b, pos // ps], pos % ps] = v[ko[b]: ko[b + 1]]
    paged = reference.prefill_paged(q, qo, k_pages, v_pages, table, kv_lens, mask=mask, window=window)
    contiguous = reference.prefill_contiguous(q, qo, k, v, ko, mask=mask, window=window)
    np.testing.assert_array_equal(paged[0], contiguous[0])
    np.testing.assert_array_equal(paged[1], contiguous[1])
    np.testing.assert_array_equal(reference.prefill(q, qo, k_pages, v_pages, table, kv_lens, mask=mask,
                                                    window=window)[0], paged[0])
    np.testing.assert_array_equal(reference.prefill(q, qo, k, v, ko, mask=mask, window=window)[0], contiguous[0])


@pytest.mark.parametrize("kw", [{}, {"sink": np.ones(4)}, {"softcap": 2.0}, {"window": 2, "chunk": 3},
                                {"sink": np.full(4, 5.0), "softcap": 1.0, "window": 1}])
def test_fully_masked_rows_are_zero_and_neg_inf(rng, kw):
    """kv_len < q_len under causal masking puts the first queries before every key; kv_len = 0 leaves
    nothing to see under either mask."""
    q, qo, k, v, ko = _batch(rng, [5, 3, 2], [0, 0, 0], 4, 2, 8)
    keep = np.concatenate([np.arange(0, 2), np.arange(5, 8)])  # sequence 0 keeps 2 of 5 keys, 1 keeps 3, 2 none
    ko2 = np.array([0, 2, 5, 5])
    with np.errstate(all="raise"):
        o, lse = reference.prefill_contiguous(q, qo, k[keep], v[keep], ko2, mask="causal", **kw)
        on, lsen = reference.prefill_contiguous(q, qo, k[keep], v[keep], ko2, mask="none",
                                                **{a: b for a, b in kw.items() if a not in ("window", "chunk")})
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    empty = np.array([1, 1, 1, 0, 0, 0, 0, 0, 1, 1], bool)  # seq 0: queries at -3..1; seq 1: 0..2; seq 2: no keys
    assert (o[empty] == 0).all() and np.isneginf(lse[empty]).all()
    assert np.isfinite(lse[~empty]).all()
    assert (on[8:] == 0).all() and np.isneginf(lsen[8:]).all()
    assert np.isfinite(lsen[:8]).all()


def test_zero_length_queries_and_empty_batch(rng):
    q, qo, k, v, ko = _batch(rng, [0, 3, 0], [4, 0, 2], 2, 1, 8)
    o, lse = reference.prefill_contiguous(q, qo, k, v, ko)
    _close((o, lse), _naive(q, qo, k, v, ko))
    o, lse = reference.prefill_contiguous(np.zeros((0, 2, 8)), [0], np.zeros((0, 1, 8)), np.zeros((0, 1, 8)), [0])
    assert o.shape == (0, 2, 8) and lse.shape == (0, 2)


def test_attention_chunk_keyword_and_default():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((3, 2, 8)), rng.standard_normal((10, 1, 8)), rng.standard_normal((10, 1, 8))
    pos = [3, 4, 9]
    _close(reference.attention(q, k, v, pos, chunk=None), reference.attention(q, k, v, pos))
    o, lse = reference.attention(q, k, v, pos, chunk=4)
    for t, p in enumerate(pos):
        keep = np.zeros(10, bool)
        keep[(p // 4) * 4: p + 1] = True
        _close(reference.attention(q[t: t + 1], k, v, [p], key_valid=keep), (o[t: t + 1], lse[t: t + 1]))
    # without causal, the chunk reaches forward to its end
    o, lse = reference.attention(q, k, v, pos, causal=False, chunk=4)
    keep = np.zeros(10, bool)
    keep[4:8] = True
    _close(reference.attention(q[1:2], k, v, [4], key_valid=keep, causal=False), (o[1:2], lse[1:2]))


@pytest.mark.parametrize("call,match", [
    (dict(mask="sliding"), r"mask='sliding' is not valid; accepted: 'none', 'causal'"),
    (dict(mask=None), r"mask=None is not valid"),
    (dict(window=0), r"window=0 is not valid; accepted: None or a positive integer"),
    (dict(chunk=-4), r"chunk=-4 is not valid"),
    (dict(chunk=2.0), r"chunk=2.0 is not valid"),
    (dict(sink=np.zeros(3)), r"sink has shape \(3,\); expected \(4,\)"),
    (dict(q_offsets=[0, 2, 4]), r"q_offsets\[-1\]=4 but there are 5 query tokens"),
    (dict(q_offsets=[1, 5]), r"q_offsets=\[1, 5\] must start at 0"),
    (dict(q_offsets=[0, 3, 2, 5]), r"never decrease"),
    (dict(kv_offsets=[0, 7]), r"kv_offsets\[-1\]=7 but there are 6 key tokens"),
    (dict(kv_offsets=[0, 2, 6], q_offsets=[0, 5]), r"kv_offsets has 3 entries, q_offsets 2"),
    (dict(q_offsets=np.array([0.0, 5.0])), r"q_offsets must be a 1-D integer array"),
    (dict(hkv=3), r"num_qo_heads=4 must be a multiple of num_kv_heads=3"),
])
def test_invalid_arguments(rng, call, match):
    hkv = call.pop("hkv", 2)
    q, k, v = rng.standard_normal((5, 4, 8)), rng.standard_normal((6, hkv, 8)), rng.standard_normal((6, hkv, 8))
    qo, ko = call.pop("q_offsets", [0, 5]), call.pop("kv_offsets", [0, 6])
    with pytest.raises(ValueError, match=match):
        reference.prefill_contiguous(q, qo, k, v, ko, **call)


def test_paged_invalid_lengths(rng):
    q = rng.standard_normal((3, 2, 8))
    pages = rng.standard_normal((2, 4, 1, 8))
    with pytest.raises(ValueError, match=r"kv_lengths=\[-1\] must be 1 non-negative integers"):
        reference.prefill_paged(q, [0, 3], pages, pages, np.array([[0, 1]]), [-1])
    with pytest.raises(TypeError, match="prefill takes"):
        reference.prefill(q, [0, 3], pages, pages)


@pytest.mark.gpu
def test_random_prefill_case_reads_back_what_it_appended(rng):
    """The testing helper: q/offsets/table agree, and the reference over the slots the table reaches equals the
    reference over the appended tokens (so the helper's cache holds exactly those)."""
    from cukv.testing import random_prefill_case, reference_prefill

    case = random_prefill_case(rng, q_lens=[5, 0, 17, 1], cache_lens=[0, 9, 40, 3], num_qo_heads=8, num_kv_heads=2,
                               head_dim=64, page_size=16)
    assert case["q"].shape == (23, 8, 64) and case["q_host"].shape == (23, 8, 64)
    assert case["q_offsets"].tolist() == [0, 5, 5, 22, 23] and case["q_offsets"].dtype == np.int32
    assert case["q_offsets_device"].get().tolist() == case["q_offsets"].tolist()
    assert case["table"].lengths.get().tolist() == [5, 9, 57, 4]
    assert case["k"].shape == (75, 2, 64) and case["kv_offsets"].tolist() == [0, 5, 14, 71, 75]
    for kw in ({}, {"mask": "none"}, {"window": 7, "softcap": 3.0}):
        got = reference_prefill(case, **kw)
        want = reference.prefill_contiguous(case["q_host"], case["q_offsets"], case["k_new"], case["v_new"],
                                            case["kv_offsets"], **kw)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
