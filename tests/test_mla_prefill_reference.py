"""cukv.reference.mla_prefill against a direct per-head softmax over the broadcast [k_nope | k_rope] keys, and
mla_rope_rows against the cache rows it gathers (CPU)."""
import numpy as np
import pytest

from cukv import reference


def _batch(rng, q_lens, prefixes, h):
    kv_lens = [q + p for q, p in zip(q_lens, prefixes)]
    qo, ko = np.concatenate([[0], np.cumsum(q_lens)]), np.concatenate([[0], np.cumsum(kv_lens)])
    q = rng.standard_normal((qo[-1], h, 192))
    k_nope, v = rng.standard_normal((ko[-1], h, 128)), rng.standard_normal((ko[-1], h, 128))
    k_rope = rng.standard_normal((ko[-1], 64))
    return q, qo, k_nope, v, k_rope, ko


def _direct(q, qo, k_nope, v, k_rope, ko, mask, sink, scale):
    """One (token, head) at a time: the written-out softmax over the materialized 192-wide keys."""
    t, h, _ = q.shape
    out, lse = np.zeros((t, h, 128)), np.full((t, h), -np.inf)
    for b in range(len(qo) - 1):
        q_len, kv_len = qo[b + 1] - qo[b], ko[b + 1] - ko[b]
        k = np.concatenate([k_nope[ko[b]: ko[b + 1]], np.repeat(k_rope[ko[b]: ko[b + 1], None], h, 1)], -1)
        for i in range(q_len):
            n = kv_len - q_len + i + 1 if mask == "causal" else kv_len
            for hh in range(h):
                if n <= 0:
                    continue
                s = k[:n, hh] @ q[qo[b] + i, hh] * scale
                m = s.max()
                e = np.exp(s - m)
                den = e.sum() + (np.exp(sink[hh] - m) if sink is not None else 0.0)
                out[qo[b] + i, hh] = e @ v[ko[b]: ko[b] + n, hh] / den
                lse[qo[b] + i, hh] = m + np.log(e.sum())
    return out, lse


@pytest.mark.parametrize("mask", ["causal", "none"])
@pytest.mark.parametrize("use_sink", [False, True])
@pytest.mark.parametrize("q_lens,prefixes,h", [([1], [0], 1), ([3, 5, 1], [0, 4, 7], 2), ([4, 0, 2], [2, 3, 0], 3)])
def test_matches_direct_softmax(mask, use_sink, q_lens, prefixes, h):
    rng = np.random.default_rng(len(q_lens) * 10 + h)
    args = _batch(rng, q_lens, prefixes, h)
    sink = rng.standard_normal(h) if use_sink else None
    for scale in (None, 0.07):
        out, lse = reference.mla_prefill(*args, mask=mask, sink=sink, softmax_scale=scale)
        want, want_lse = _direct(*args, mask, sink, 192 ** -0.5 if scale is None else scale)
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12)


def test_equals_mha_prefill_on_materialized_keys():
    rng = np.random.default_rng(1)
    q, qo, k_nope, v, k_rope, ko = _batch(rng, [6, 2], [3, 9], 4)
    k = np.concatenate([k_nope, np.broadcast_to(k_rope[:, None], (k_rope.shape[0], 4, 64))], -1)
    for mask in ("causal", "none"):
        out, lse = reference.mla_prefill(q, qo, k_nope, v, k_rope, ko, mask=mask)
        want, want_lse = reference.prefill_contiguous(q, qo, k, v, ko, mask=mask, sm_scale=192 ** -0.5)
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12)


def test_fully_masked_rows_and_empty_sequences():
    rng = np.random.default_rng(2)
    # sequence 0: 4 queries over 2 keys (causal: the first two see nothing); sequence 1: no keys at all
    q = rng.standard_normal((5, 2, 192))
    k_nope, v, k_rope = rng.standard_normal((2, 2, 128)), rng.standard_normal((2, 2, 128)), rng.standard_normal((2, 64))
    out, lse = reference.mla_prefill(q, [0, 4, 5], k_nope, v, k_rope, [0, 2, 2], sink=np.zeros(2))
    assert (out[:2] == 0).all() and np.isneginf(lse[:2]).all()
    assert (out[4] == 0).all() and np.isneginf(lse[4]).all()
    assert np.isfinite(lse[2:4]).all()


def test_prefix_and_new_tokens_merge_by_lse():
    """One-shot over a cached prefix == the prefix (mask none) and the new keys (causal) merged by LSE."""
    rng = np.random.default_rng(3)
    q, qo, k_nope, v, k_rope, ko = _batch(rng, [5], [7], 2)
    full = reference.mla_prefill(q, qo, k_nope, v, k_rope, ko)
    a = reference.mla_prefill(q, qo, k_nope[:7], v[:7], k_rope[:7], [0, 7], mask="none")
    b = reference.mla_prefill(q, qo, k_nope[7:], v[7:], k_rope[7:], [0, 5])
    o, s = reference.merge_states([a[0], b[0]], [a[1], b[1]])
    np.testing.assert_allclose(o, full[0], rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(s, full[1], rtol=1e-12)


@pytest.mark.parametrize("bad,match", [
    (dict(q=np.zeros((1, 1, 128))), "q has shape"),
    (dict(k_nope=np.zeros((2, 2, 128))), "k_nope has shape"),
    (dict(v=np.zeros((2, 1, 64))), "v has shape"),
    (dict(k_rope=np.zeros((2, 32))), "k_rope"),
    (dict(kv_offsets=[0, 3]), "kv_offsets"),
    (dict(mask="sliding"), "mask="),
])
def test_shape_errors_name_the_argument(bad, match):
    kw = dict(q=np.zeros((1, 1, 192)), q_offsets=[0, 1], k_nope=np.zeros((2, 1, 128)), v=np.zeros((2, 1, 128)),
              k_rope=np.zeros((2, 64)), kv_offsets=[0, 2])
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        reference.mla_prefill(**kw)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_rope_rows_from_16bit_and_fp8_pages(page_size):
    rng = np.random.default_rng(page_size)
    lengths = [5, 0, 9]
    n_pages = sum(-(-n // page_size) for n in lengths) + 2
    perm = rng.permutation(n_pages)
    table, used = np.zeros((3, 16), np.int32), 0
    for b, n in enumerate(lengths):
        for j in range(-(-n // page_size)):
            table[b, j] = perm[used]
            used += 1
    kv_c, k_pe = rng.standard_normal((n_pages * page_size, 512)), rng.standard_normal((n_pages * page_size, 64))
    pages16 = np.concatenate([kv_c, k_pe], 1).reshape(n_pages, page_size, 576)
    pages8 = reference.mla_quantize_fp8(kv_c, k_pe).reshape(n_pages, page_size, 656)
    want = np.concatenate([[pages16[table[b, p // page_size], p % page_size, 512:] for p in range(n)]
                           for b, n in enumerate(lengths) if n] or [np.zeros((0, 64))])
    got16 = reference.mla_rope_rows(pages16, table, lengths)
    np.testing.assert_array_equal(got16, want)
    got8 = reference.mla_rope_rows(pages8, table, lengths)
    np.testing.assert_array_equal(got8, reference.mla_dequantize_fp8(pages8)[..., 512:][
        table[np.repeat([0, 2], [5, 9]), np.r_[np.arange(5), np.arange(9)] // page_size],
        np.r_[np.arange(5), np.arange(9)] % page_size])
    np.testing.assert_allclose(got8, want, rtol=2 ** -8)
    bits = reference._bf16_bits(pages16.astype(np.float32))  # a bf16 cache's host copy: uint16 bit patterns
    np.testing.assert_array_equal(reference.mla_rope_rows(bits, table, lengths), got8)
    assert got16.shape == (14, 64)
    with pytest.raises(ValueError, match="pages has shape"):
        reference.mla_rope_rows(np.zeros((2, 2, 512)), table, lengths)
