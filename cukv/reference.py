"""Float64 NumPy definitions of every cukv operation. Kernels are tested against these, never against
each other. Inputs are host float arrays (use :mod:`cukv.dtypes` to read bf16 bit patterns).

Conventions (design.md section 3): scores ``s = (q . k) * sm_scale``; with a soft-cap
``s = cap * tanh(s / cap)``; a sink logit joins the denominator only; LSE is the natural log of
``sum_j exp(s_j)`` without the sink; a row with no visible key gives output 0 and LSE -inf.

Examples
--------
>>> import numpy as np
>>> from cukv import reference
>>> rng = np.random.default_rng(0)
>>> q = rng.standard_normal((2, 4, 64))                          # 2 queries, 4 heads (GQA over 1 KV head)
>>> k, v = rng.standard_normal((10, 1, 64)), rng.standard_normal((10, 1, 64))
>>> out, lse = reference.attention(q, k, v, q_pos=[8, 9])        # causal: the query at 8 sees keys 0..8
>>> out.shape, lse.shape
((2, 4, 64), (2, 4))

Attention over two disjoint key sets, merged by LSE, is attention over their union (cascade attention):

>>> a = reference.attention(q, k[:6], v[:6], [9, 9], causal=False)
>>> b = reference.attention(q, k[6:], v[6:], [9, 9], causal=False)
>>> o, s = reference.merge_states([a[0], b[0]], [a[1], b[1]])
>>> full, full_lse = reference.attention(q, k, v, [9, 9], causal=False)
>>> bool(np.allclose(o, full) and np.allclose(s, full_lse))
True

A ragged prefill: sequence 0 has a cached prefix of 3 keys, so its 2 queries sit at positions 3 and 4:

>>> q_offsets, kv_offsets = [0, 2, 5], [0, 5, 8]
>>> out, lse = reference.prefill_contiguous(q[[0, 1, 0, 1, 0]], q_offsets, k[:8], v[:8], kv_offsets)
>>> bool(np.allclose(out[1], reference.attention(q[1:2], k[:5], v[:5], [4])[0][0]))
True
"""
from __future__ import annotations

import numpy as np


def attention(q, k, v, q_pos, key_valid=None, *, sm_scale=None, causal=True, window=None, softcap=None,
              sink=None, chunk=None):
    """Dense reference. ``q[Tq, Hq, D]``, ``k[L, Hkv, D]``, ``v[L, Hkv, Dv]``, ``q_pos[Tq]`` absolute positions
    (key j sits at position j). Returns ``out[Tq, Hq, Dv]`` and ``lse[Tq, Hq]``.

    Masks combine: ``causal`` keeps keys ``<= p``; ``window=W`` keeps keys ``> p - W`` (with causal: the
    window ``(p - W, p]``); ``chunk=C`` keeps keys in the query's chunk of C positions (``k // C == p // C``;
    with causal: the chunk's keys up to ``p``); ``key_valid[L]`` drops keys."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    tq, hq, d = q.shape
    n, hkv, _ = k.shape
    group = hq // hkv
    scale = 1.0 / np.sqrt(d) if sm_scale is None else sm_scale
    kk = np.repeat(k, group, axis=1)  # [L, Hq, D]
    vv = np.repeat(v, group, axis=1)
    s = np.einsum("thd,lhd->htl", q, kk) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    pos = np.asarray(q_pos)[:, None]
    key = np.arange(n)[None, :]
    vis = np.ones((tq, n), bool)
    if causal:
        vis &= key <= pos
    if window:
        vis &= key > pos - window
    if chunk:
        vis &= key // chunk == pos // chunk
    if key_valid is not None:
        vis &= np.asarray(key_valid, bool)[None, :]
    s = np.where(vis[None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.where(vis[None], np.exp(s - m_safe), 0.0)
    denom = p.sum(-1, keepdims=True)
    lse = np.where(denom[..., 0] > 0, np.log(np.where(denom[..., 0] > 0, denom[..., 0], 1.0)) + m_safe[..., 0], -np.inf)
    if sink is not None:
        denom = denom + np.exp(np.asarray(sink, np.float64)[:, None, None] - m_safe)
    o = np.einsum("htl,lhd->thd", p / np.where(denom > 0, denom, 1.0), vv)
    return o, lse.T


def gather(pages, block_table_row, length):
    """Tokens ``0 .. length-1`` of one sequence from ``pages[num_pages, page_size, H, D]``."""
    ps = pages.shape[1]
    pos = np.arange(length)
    return pages[np.asarray(block_table_row)[pos // ps], pos % ps]


def decode(q, k_pages, v_pages, block_table, lengths, **kw):
    """Paged decode: ``q[B, Hq, D]``; the query of sequence b sits at position ``lengths[b] - 1``."""
    q = np.asarray(q, np.float64)
    outs, lses = [], []
    for b in range(q.shape[0]):
        n = int(lengths[b])
        k = gather(k_pages, block_table[b], n)
        v = gather(v_pages, block_table[b], n)
        if n == 0:
            outs.append(np.zeros((q.shape[1], v_pages.shape[-1])))
            lses.append(np.full(q.shape[1], -np.inf))
            continue
        o, lse = attention(q[b: b + 1], k, v, [n - 1], **kw)
        outs.append(o[0])
        lses.append(lse[0])
    return np.stack(outs), np.stack(lses)


def append(k_pages, v_pages, k_new, v_new, slots):
    """In place: token t goes to slot ``slots[t]`` (page ``slot // page_size``, offset ``slot % page_size``);
    slots outside the cache (-1 for padding) are skipped."""
    ps = k_pages.shape[1]
    total = k_pages.shape[0] * ps
    for t, s in enumerate(np.asarray(slots)):
        if 0 <= s < total:
            k_pages[s // ps, s % ps] = k_new[t]
            v_pages[s // ps, s % ps] = v_new[t]


def merge_states(outs, lses):
    """Combine partial attentions ``outs[i][..., D]`` with natural-log ``lses[i][...]`` over disjoint key sets."""
    lses = np.stack([np.asarray(x, np.float64) for x in lses])
    outs = np.stack([np.asarray(x, np.float64) for x in outs])
    m = lses.max(0)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w = np.where(np.isfinite(lses), np.exp(lses - m_safe), 0.0)
    tot = w.sum(0)
    o = (w[..., None] * np.where(np.isfinite(lses)[..., None], outs, 0.0)).sum(0) / np.where(tot > 0, tot, 1.0)[..., None]
    lse = np.where(tot > 0, m_safe + np.log(np.where(tot > 0, tot, 1.0)), -np.inf)
    return o, lse


# ----------------------------------------------------------------------------------------------
# ragged prefill

MASKS = ("none", "causal")


def _offsets(x, name: str, total: int | None = None, what: str = "tokens") -> np.ndarray:
    o = np.asarray(x)
    if o.ndim != 1 or o.size < 1 or not np.issubdtype(o.dtype, np.integer):
        raise ValueError(f"{name} must be a 1-D integer array [batch + 1]; got {o.dtype} with shape {o.shape}")
    o = o.astype(np.int64)
    if o[0] != 0 or np.any(np.diff(o) < 0):
        raise ValueError(f"{name}={o.tolist()} must start at 0 and never decrease")
    if total is not None and o[-1] != total:
        raise ValueError(f"{name}[-1]={o[-1]} but there are {total} {what}")
    return o


def _prefill_options(hq: int, mask, window, chunk, sink):
    if mask not in MASKS:
        raise ValueError(f"mask={mask!r} is not valid; accepted: {', '.join(map(repr, MASKS))}")
    for name, val in (("window", window), ("chunk", chunk)):
        if val is not None and (not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < 1):
            raise ValueError(f"{name}={val!r} is not valid; accepted: None or a positive integer")
    if sink is not None and np.shape(sink) != (hq,):
        raise ValueError(f"sink has shape {np.shape(sink)}; expected ({hq},), one logit per query head")


def _prefill_one(q, k, v, hq: int, dv: int, *, mask, window, chunk, sm_scale, softcap, sink):
    """One sequence: ``q[q_len, Hq, D]`` against ``k/v[kv_len, Hkv, *]``, queries bottom-right aligned."""
    q_len, kv_len = q.shape[0], k.shape[0]
    if q_len == 0:
        return np.zeros((0, hq, dv)), np.zeros((0, hq))
    if kv_len == 0:
        return np.zeros((q_len, hq, dv)), np.full((q_len, hq), -np.inf)
    pos = kv_len - q_len + np.arange(q_len)
    return attention(q, k, v, pos, causal=(mask == "causal"), window=window, chunk=chunk, sm_scale=sm_scale,
                     softcap=softcap, sink=sink)


def _check_heads(q, k, v):
    if q.ndim != 3:
        raise ValueError(f"q has shape {q.shape}; expected [total_q, num_qo_heads, head_dim]")
    if k.ndim != 3:
        raise ValueError(f"k has shape {k.shape}; expected [total_kv, num_kv_heads, head_dim]")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"num_qo_heads={hq} must be a multiple of num_kv_heads={hkv}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k head_dim {k.shape[-1]} != q head_dim {q.shape[-1]}")
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v has shape {v.shape}; expected {k.shape[:-1]} + (head_dim_v,)")


def prefill_contiguous(q, q_offsets, k, v, kv_offsets, *, mask="causal", window=None, chunk=None, softcap=None,
                       sink=None, sm_scale=None):
    """Ragged prefill over contiguous K/V.

    ``q[total_q, Hq, D]`` with ``q_offsets[B+1]``; ``k[total_kv, Hkv, D]``, ``v[total_kv, Hkv, Dv]`` with
    ``kv_offsets[B+1]``. Sequence b has ``q_len = q_offsets[b+1] - q_offsets[b]`` queries and ``kv_len`` keys;
    query i sits at absolute position ``p = kv_len - q_len + i`` (bottom-right aligned: the last query is the
    last key) and key j at position j.

    ``mask='causal'`` keeps keys ``<= p``, ``'none'`` every key; ``window=W`` also keeps only keys ``> p - W``
    (with causal: ``(p - W, p]``); ``chunk=C`` keeps keys in the query's chunk (``j // C == p // C``).
    Returns ``out[total_q, Hq, Dv]`` and the natural-log ``lse[total_q, Hq]`` (without the sink); a query
    that sees no key gets 0 and -inf.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    _check_heads(q, k, v)
    qo = _offsets(q_offsets, "q_offsets", q.shape[0], "query tokens")
    ko = _offsets(kv_offsets, "kv_offsets", k.shape[0], "key tokens")
    if ko.size != qo.size:
        raise ValueError(f"kv_offsets has {ko.size} entries, q_offsets {qo.size}: both must be [batch + 1]")
    hq, dv = q.shape[1], v.shape[-1]
    _prefill_options(hq, mask, window, chunk, sink)
    kw = dict(mask=mask, window=window, chunk=chunk, sm_scale=sm_scale, softcap=softcap, sink=sink)
    out, lse = np.zeros((q.shape[0], hq, dv)), np.full((q.shape[0], hq), -np.inf)
    for b in range(qo.size - 1):
        o, s = _prefill_one(q[qo[b]: qo[b + 1]], k[ko[b]: ko[b + 1]], v[ko[b]: ko[b + 1]], hq, dv, **kw)
        out[qo[b]: qo[b + 1]], lse[qo[b]: qo[b + 1]] = o, s
    return out, lse


def prefill_paged(q, q_offsets, k_pages, v_pages, block_table, kv_lengths, **kw):
    """Ragged prefill over a paged cache: ``k_pages[P, page_size, Hkv, D]``, ``v_pages[P, page_size, Hkv, Dv]``,
    ``block_table[B, max_pages]`` and ``kv_lengths[B]`` (tokens to attend to, the new ones included:
    ``cache_len + q_len``). Only the slots the table reaches are read. Same masks and results as
    :func:`prefill_contiguous`."""
    q = np.asarray(q, np.float64)
    k_pages, v_pages = np.asarray(k_pages), np.asarray(v_pages)
    if k_pages.ndim != 4 or v_pages.shape[:-1] != k_pages.shape[:-1]:
        raise ValueError(f"k_pages/v_pages have shapes {k_pages.shape}/{v_pages.shape}; expected "
                         "[pages, page_size, num_kv_heads, head_dim]")
    lengths = np.asarray(kv_lengths, np.int64)
    qo = _offsets(q_offsets, "q_offsets", q.shape[0], "query tokens")
    if lengths.shape != (qo.size - 1,) or np.any(lengths < 0):
        raise ValueError(f"kv_lengths={lengths.tolist()} must be {qo.size - 1} non-negative integers")
    block_table = np.asarray(block_table)
    ks = [gather(k_pages, block_table[b], int(n)) for b, n in enumerate(lengths)]
    vs = [gather(v_pages, block_table[b], int(n)) for b, n in enumerate(lengths)]
    k = np.concatenate(ks) if ks else k_pages[:0, 0]
    v = np.concatenate(vs) if vs else v_pages[:0, 0]
    return prefill_contiguous(q, qo, k, v, np.concatenate([[0], np.cumsum(lengths)]), **kw)


def prefill(q, q_offsets, k, v, *kv_layout, **kw):
    """``prefill(q, q_offsets, k, v, kv_offsets)`` is :func:`prefill_contiguous`;
    ``prefill(q, q_offsets, k_pages, v_pages, block_table, kv_lengths)`` is :func:`prefill_paged`."""
    if len(kv_layout) == 1:
        return prefill_contiguous(q, q_offsets, k, v, *kv_layout, **kw)
    if len(kv_layout) == 2:
        return prefill_paged(q, q_offsets, k, v, *kv_layout, **kw)
    raise TypeError("prefill takes (q, q_offsets, k, v, kv_offsets) or "
                    "(q, q_offsets, k_pages, v_pages, block_table, kv_lengths)")


# ---------------------------------------------------------------------------------------------------------
# MLA (absorbed form): one shared 576-wide KV row per token, 512 latent ("nope") + 64 rope; V = the first 512.

MLA_NOPE, MLA_ROPE, MLA_DIM = 512, 64, 576
MLA_FP8_ROW_BYTES = 656  # 512 e4m3 codes, 4 float32 scales (one per 128 latent values), 64 bf16 rope values


def mla_decode(q, pages, block_table, seq_lens, *, softmax_scale=None, sink=None):
    """Absorbed MLA decode. ``q[B, s_q, H, 576]``, ``pages[num_pages, page_size, 576]`` (float values: a
    16-bit cache, or an FP8 cache after :func:`mla_dequantize_fp8`), ``block_table[B, max_pages]``,
    ``seq_lens[B]`` (tokens in the cache, the new ones included). Query ``i`` of ``s_q`` sees keys
    ``< len - (s_q - 1 - i)`` (bottom-right causal). Returns ``out[B, s_q, H, 512]`` and ``lse[B, s_q, H]``
    (natural log, without the sink); a query with no visible key gives 0 and -inf."""
    q = np.asarray(q, np.float64)
    pages = np.asarray(pages, np.float64)
    b, s_q, h, d = q.shape
    scale = 1.0 / np.sqrt(MLA_DIM) if softmax_scale is None else float(softmax_scale)
    out = np.zeros((b, s_q, h, MLA_NOPE))
    lse = np.full((b, s_q, h), -np.inf)
    ps = pages.shape[1]
    for i in range(b):
        n = int(seq_lens[i])
        if n <= 0:
            continue
        pos = np.arange(n)
        rows = pages[np.asarray(block_table[i])[pos // ps], pos % ps]  # [n, 576]
        s = np.einsum("thd,nd->thn", q[i], rows) * scale
        vis = pos[None, :] < (n - (s_q - 1 - np.arange(s_q)))[:, None]  # [s_q, n]
        s = np.where(vis[:, None, :], s, -np.inf)
        m = s.max(-1, keepdims=True)
        m_safe = np.where(np.isfinite(m), m, 0.0)
        p = np.where(vis[:, None, :], np.exp(s - m_safe), 0.0)
        den = p.sum(-1, keepdims=True)
        lse[i] = np.where(den[..., 0] > 0, np.log(np.where(den[..., 0] > 0, den[..., 0], 1.0)) + m_safe[..., 0],
                          -np.inf)
        if sink is not None:
            den = den + np.exp(np.asarray(sink, np.float64)[None, :, None] - m_safe)
        out[i] = np.einsum("thn,nd->thd", p / np.where(den > 0, den, 1.0), rows[:, :MLA_NOPE])
    return out, lse


def sparse_mla(q, rows, indices, topk_lengths=None, sink=None, softmax_scale=None):
    """Sparse MLA (absorbed, DeepSeek-V3.2 DSA): query token ``t`` attends to the cache rows ``indices[t, j]``.
    ``q[T, H, d]`` (d = 576, or 512 for a no-rope variant: the first d columns of each row), ``rows[N, 576]``
    (float values: the cache viewed as ``[num_pages * page_size]`` rows, an FP8 cache dequantized), ``indices[T,
    topk]`` (``page * page_size + offset``), ``topk_lengths[T]`` (None: topk), ``sink[H]`` (joins the denominator
    only). Key ``j`` of token ``t`` is valid when ``0 <= indices[t, j] < N`` and ``j < topk_lengths[t]``; others
    are never read (a repeated valid index counts as often as it appears). Returns ``out[T, H, 512]`` (V = the
    first 512 columns), ``lse[T, H]`` (natural log, without the sink) and ``max_logits[T, H]`` (the largest
    ``q . k * softmax_scale`` over valid keys); a token with no valid key gives 0, -inf and -inf.

    Examples
    --------
    >>> import numpy as np
    >>> from cukv import reference
    >>> rng = np.random.default_rng(0)
    >>> rows, q = rng.standard_normal((10, 576)), rng.standard_normal((2, 3, 576))
    >>> out, lse, mx = reference.sparse_mla(q, rows, [[4, -1, 9], [10, 2, 3]], topk_lengths=[3, 1])
    >>> want, _ = reference.mla_decode(q[:1, None], rows[None, [4, 9]], [[0, 1]], [2])   # token 0: rows 4 and 9
    >>> bool(np.allclose(out[0], want[0, 0])), bool(np.isinf(lse[1]).all() and (out[1] == 0).all())
    (True, True)
    """
    q = np.asarray(q, np.float64)
    rows = np.asarray(rows, np.float64)
    idx = np.asarray(indices, np.int64)
    t_n, h, d = q.shape
    n_rows, topk = rows.shape[0], idx.shape[1]
    scale = 1.0 / np.sqrt(MLA_DIM) if softmax_scale is None else float(softmax_scale)
    lens = np.full(t_n, topk) if topk_lengths is None else np.asarray(topk_lengths, np.int64).reshape(t_n)
    out = np.zeros((t_n, h, MLA_NOPE))
    lse = np.full((t_n, h), -np.inf)
    mx = np.full((t_n, h), -np.inf)
    for t in range(t_n):
        j = np.arange(topk)
        ok = (idx[t] >= 0) & (idx[t] < n_rows) & (j < lens[t])
        if not ok.any():
            continue
        kv = rows[idx[t][ok]]  # [n, 576]
        s = q[t] @ kv[:, :d].T * scale  # [H, n]
        m = s.max(-1)
        p = np.exp(s - m[:, None])
        den = p.sum(-1)
        lse[t], mx[t] = np.log(den) + m, m
        if sink is not None:
            den = den + np.exp(np.asarray(sink, np.float64) - m)
        out[t] = (p / den[:, None]) @ kv[:, :MLA_NOPE]
    return out, lse, mx


def _e4m3_round(x):
    """float32 -> nearest e4m3 value (ties to even, saturating to +-448) as float64."""
    x = np.asarray(x, np.float32).astype(np.float64)
    a = np.abs(x)
    _, e = np.frexp(np.where(a > 0, a, 1.0))
    spacing = np.exp2(np.maximum(e - 1, -6) - 3.0)
    return np.copysign(np.minimum(np.round(a / spacing) * spacing, 448.0), x)


def _e4m3_values():
    c = np.arange(256)
    exp, man = (c >> 3) & 0xF, c & 7
    v = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    v = np.where(c & 0x80, -v, v)
    v[(c & 0x7F) == 0x7F] = np.nan
    return v


def _e4m3_encode(v):
    table = _e4m3_values()
    pos = table[:0x7F]
    code = np.searchsorted(pos, np.abs(v)).astype(np.uint8)
    return (code | np.where(np.signbit(v), np.uint8(0x80), np.uint8(0))).astype(np.uint8)


def _bf16_bits(x):
    """float32 -> bf16 bit patterns, round to nearest even (NaN kept quiet)."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(np.asarray(x, np.float32)), np.uint16(0x7FC0), r)


def mla_quantize_fp8(kv_c, k_pe, *, pow2_scales=False, scale_floor=2.0 ** -32):
    """The FP8 MLA row quantizer the append kernel implements bit for bit: ``kv_c[T, 512]``, ``k_pe[T, 64]``
    (read as float32) -> ``uint8[T, 656]``. Per 128 latent values ``scale = max(amax, 448 * floor) / 448``
    (float32); with ``pow2_scales`` the scale is rounded up to a power of two (FlashMLA's quantizer:
    ``2^ceil(log2(amax / 448))``). Codes are ``e4m3_rn_satfinite(x / scale)`` (float32 division); the rope
    part is stored as bf16 (round to nearest even)."""
    x = np.asarray(kv_c, np.float32)
    t = x.shape[0]
    g = x.reshape(t, 4, 128)
    amax = np.abs(g).max(-1)
    scale = (np.maximum(amax, np.float32(448.0 * scale_floor)) / np.float32(448.0)).astype(np.float32)
    if pow2_scales:
        m, e = np.frexp(scale.astype(np.float64))  # scale = m * 2^e, m in [0.5, 1)
        scale = np.where(m == 0.5, scale, np.ldexp(1.0, e)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = (g / scale[..., None]).astype(np.float32)
    codes = _e4m3_encode(_e4m3_round(ratio)).reshape(t, 512)
    out = np.zeros((t, MLA_FP8_ROW_BYTES), np.uint8)
    out[:, :512] = codes
    out[:, 512:528] = scale.astype("<f4").view(np.uint8).reshape(t, 16)
    out[:, 528:] = _bf16_bits(np.asarray(k_pe, np.float32)).astype("<u2").view(np.uint8).reshape(t, 128)
    return out


def mla_dequantize_fp8(rows):
    """``uint8[..., 656]`` FP8 MLA rows -> float64 ``[..., 576]``: ``e4m3(code) * scale`` then the bf16 rope."""
    r = np.asarray(rows, np.uint8)
    lead = r.shape[:-1]
    r = r.reshape(-1, MLA_FP8_ROW_BYTES)
    vals = _e4m3_values()[r[:, :512]].reshape(-1, 4, 128)
    scale = np.ascontiguousarray(r[:, 512:528]).view("<f4").astype(np.float64)
    rope_bits = np.ascontiguousarray(r[:, 528:]).view("<u2").astype(np.uint32) << 16
    rope = rope_bits.astype(np.uint32).view(np.float32).astype(np.float64)
    out = np.concatenate([(vals * scale[..., None]).reshape(-1, 512), rope], axis=1)
    return out.reshape(lead + (MLA_DIM,))


# ---------------------------------------------------------------------------------------------------------
# MLA prefill (non-absorbed form): per head 192 = 128 nope + 64 rope query/key dims, 128 value dims; the
# rope part of K (64 values per token) is shared by every head and read from the latent cache.

MLA_QK_NOPE, MLA_V = 128, 128
MLA_QK = MLA_QK_NOPE + MLA_ROPE  # 192


def mla_rope_rows(pages, block_table, kv_lengths):
    """The ``k_rope[Tk, 64]`` rows of a ragged batch, gathered from an MLA latent cache through its page table.

    ``pages`` is the cache's host copy (``MLAKVCache.data.get()``): ``[num_pages, page_size, 576]`` values of a
    16-bit cache (float16 or float values; ``uint16`` is read as bf16 bit patterns, as cukv stores bf16), or
    ``uint8[num_pages, page_size, 656]`` FP8 rows (only their bf16 rope part, bytes 528..655, is read). ``block_table[B, max_pages]``, ``kv_lengths[B]``:
    tokens ``0 .. kv_lengths[b] - 1`` of sequence b, in order. Returns float64 ``[sum(kv_lengths), 64]``,
    sequence after sequence (the layout ``kv_offsets = [0, cumsum(kv_lengths)]`` describes)."""
    pages = np.asarray(pages)
    if pages.ndim != 3 or pages.shape[-1] not in (MLA_DIM, MLA_FP8_ROW_BYTES):
        raise ValueError(f"pages has shape {pages.shape}; expected [num_pages, page_size, {MLA_DIM}] values or "
                         f"[num_pages, page_size, {MLA_FP8_ROW_BYTES}] FP8 bytes")
    if pages.shape[-1] == MLA_FP8_ROW_BYTES:
        if pages.dtype != np.uint8:
            raise ValueError(f"pages with {MLA_FP8_ROW_BYTES}-wide rows must be uint8 FP8 rows; got {pages.dtype}")
        bits = np.ascontiguousarray(pages[..., 528:]).view("<u2").astype(np.uint32) << 16
        rope = bits.view(np.float32).astype(np.float64)
    elif pages.dtype == np.uint16:
        rope = (pages[..., MLA_NOPE:].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    else:
        rope = pages[..., MLA_NOPE:].astype(np.float64)
    ps = pages.shape[1]
    table = np.asarray(block_table)
    rows = []
    for b, n in enumerate(np.asarray(kv_lengths, np.int64)):
        pos = np.arange(int(n))
        rows.append(rope[table[b][pos // ps], pos % ps])
    return np.concatenate(rows) if rows else np.zeros((0, MLA_ROPE))


def mla_prefill(q, q_offsets, k_nope, v, k_rope, kv_offsets, *, mask="causal", sink=None, softmax_scale=None):
    """Non-absorbed MLA prefill over a ragged batch.

    ``q[T, H, 192]`` (128 nope then 64 rope dims per head) with ``q_offsets[B+1]``; ``k_nope[Tk, H, 128]`` and
    ``v[Tk, H, 128]`` (the caller's up-projection of the latent rows) with ``kv_offsets[B+1]``; ``k_rope[Tk, 64]``
    shared by every head (:func:`mla_rope_rows` gathers it from a cache). Key j of sequence b is
    ``[k_nope[j, h] | k_rope[j]]``. ``mask='causal'`` is bottom-right aligned: query i of sequence b sits at
    position ``kv_len - q_len + i`` and sees keys ``<=`` it (so a cached prefix counts in ``kv_len``);
    ``'none'`` sees every key. ``sink[H]`` joins the denominator only; ``softmax_scale`` defaults to
    ``1/sqrt(192)``. Returns ``out[T, H, 128]`` and the natural-log ``lse[T, H]`` (without the sink); a query
    that sees no key gets 0 and -inf.

    >>> import numpy as np
    >>> from cukv import reference
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((3, 2, 192))
    >>> k_nope, v, k_rope = rng.standard_normal((5, 2, 128)), rng.standard_normal((5, 2, 128)), rng.standard_normal((5, 64))
    >>> out, lse = reference.mla_prefill(q, [0, 3], k_nope, v, k_rope, [0, 5])   # 2 cached keys, then 3 new
    >>> k = np.concatenate([k_nope, np.broadcast_to(k_rope[:, None], (5, 2, 64))], axis=-1)
    >>> want, want_lse = reference.prefill_contiguous(q, [0, 3], k, v, [0, 5], sm_scale=192 ** -0.5)
    >>> bool(np.allclose(out, want) and np.allclose(lse, want_lse))
    True
    """
    q, k_nope, v, k_rope = (np.asarray(x, np.float64) for x in (q, k_nope, v, k_rope))
    if q.ndim != 3 or q.shape[-1] != MLA_QK:
        raise ValueError(f"q has shape {q.shape}; expected [tokens, heads, {MLA_QK}]")
    h = q.shape[1]
    for name, x in (("k_nope", k_nope), ("v", v)):
        if x.ndim != 3 or x.shape[1:] != (h, MLA_QK_NOPE if name == "k_nope" else MLA_V):
            raise ValueError(f"{name} has shape {x.shape}; expected [kv_tokens, {h}, 128]")
    if v.shape[0] != k_nope.shape[0] or k_rope.shape != (k_nope.shape[0], MLA_ROPE):
        raise ValueError(f"k_nope {k_nope.shape}, v {v.shape} and k_rope {k_rope.shape} must share their "
                         f"kv_tokens; k_rope is [kv_tokens, {MLA_ROPE}]")
    qo = _offsets(q_offsets, "q_offsets", q.shape[0], "query tokens")
    ko = _offsets(kv_offsets, "kv_offsets", k_nope.shape[0], "key tokens")
    if ko.size != qo.size:
        raise ValueError(f"kv_offsets has {ko.size} entries, q_offsets {qo.size}: both must be [batch + 1]")
    _prefill_options(h, mask, None, None, sink)
    scale = MLA_QK ** -0.5 if softmax_scale is None else float(softmax_scale)
    out, lse = np.zeros((q.shape[0], h, MLA_V)), np.full((q.shape[0], h), -np.inf)
    for b in range(qo.size - 1):
        qb = q[qo[b]: qo[b + 1]]
        kn, vb, kr = k_nope[ko[b]: ko[b + 1]], v[ko[b]: ko[b + 1]], k_rope[ko[b]: ko[b + 1]]
        if qb.shape[0] == 0 or kn.shape[0] == 0:
            continue
        # the shared rope part scores once per (query, head): no per-head copy of k_rope
        s = (np.einsum("thd,lhd->htl", qb[..., :MLA_QK_NOPE], kn) + np.einsum("thd,ld->htl", qb[..., MLA_QK_NOPE:], kr))
        pos = kn.shape[0] - qb.shape[0] + np.arange(qb.shape[0])
        vis = np.arange(kn.shape[0])[None, :] <= pos[:, None] if mask == "causal" else np.ones((qb.shape[0], kn.shape[0]), bool)
        s = np.where(vis[None], s * scale, -np.inf)
        m = s.max(-1, keepdims=True)
        m_safe = np.where(np.isfinite(m), m, 0.0)
        p = np.where(vis[None], np.exp(s - m_safe), 0.0)
        den = p.sum(-1, keepdims=True)
        lse[qo[b]: qo[b + 1]] = np.where(den[..., 0] > 0, np.log(np.where(den[..., 0] > 0, den[..., 0], 1.0))
                                         + m_safe[..., 0], -np.inf).T
        if sink is not None:
            den = den + np.exp(np.asarray(sink, np.float64)[:, None, None] - m_safe)
        out[qo[b]: qo[b + 1]] = np.einsum("htl,lhd->thd", p / np.where(den > 0, den, 1.0), vb)
    return out, lse
