"""Float64 NumPy definitions of every cukv operation. Kernels are tested against these, never against
each other. Inputs are host float arrays (use :mod:`cukv.dtypes` to read bf16 bit patterns).

Conventions (design.md section 3): scores ``s = (q . k) * sm_scale``; with a soft-cap
``s = cap * tanh(s / cap)``; a sink logit joins the denominator only; LSE is the natural log of
``sum_j exp(s_j)`` without the sink; a row with no visible key gives output 0 and LSE -inf.
"""
from __future__ import annotations

import numpy as np


def attention(q, k, v, q_pos, key_valid=None, *, sm_scale=None, causal=True, window=None, softcap=None,
              sink=None):
    """Dense reference. ``q[Tq, Hq, D]``, ``k[L, Hkv, D]``, ``v[L, Hkv, Dv]``, ``q_pos[Tq]`` absolute positions
    (key j sits at position j). Returns ``out[Tq, Hq, Dv]`` and ``lse[Tq, Hq]``."""
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
