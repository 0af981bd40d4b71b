"""Where an MLA decode run's time goes around its tiles: a build with ``CUKV_MLA_TIMELINE`` stamps the global timer per
block (entry, after the barrier set-up, the query block landed, warpgroup 0's last tile done, each consumer's epilogue
done, exit) and its SM; printed as medians and percentiles over the blocks of one run, with the gaps between blocks on
each SM. The stamps cost little but are not free: time with the bench, not with this.

    PYTHONPATH=. python3 benchmarks/probe_mla_timeline.py "ctx4096,s_q2,skewed" ["CUKV_X CUKV_Y=1"]
    PYTHONPATH=. python3 benchmarks/probe_mla_timeline.py "prefill h128 s_kv32K,decode fp8 b128"
    PYTHONPATH=. python3 benchmarks/probe_mla_timeline.py "prefill h128 s_kv32K" "" persistent=true

The argument picks ``bench mla-decode`` and ``bench sparse-mla`` shapes by words in their names (and "b128 h128
ctx512"); a second one adds defines (the ``CUKV_DEFINES`` form) to the timeline build. Stamps 5 and 6 come
from the per-slice consumers (h128; sparse: 16-bit rows from 64 heads) only.
"""
import itertools
import sys

import cupy as cp
import numpy as np
from probe_lib import compiled_with, field_value, mla_op_with_defines

from cukv.bench import mla_decode as bd
from cukv.bench import sparse_mla as bs


def stamps(mod, n, run):
    """The timeline of ``n`` blocks of one ``run()`` after three warm-ups: [n, 8] int64 (slot 7: the SM)."""
    for _ in range(3):
        run()
    g = mod.get_global("cukv_mla_timeline")
    cp.cuda.Device().synchronize()
    g.memset(0, 16384 * 8 * 8)
    run()
    cp.cuda.Device().synchronize()
    h = np.zeros(16384 * 8, np.uint64)
    g.copy_to_host(h.ctypes.data, h.nbytes)
    return h.reshape(-1, 8)[:n].astype(np.int64)


def sparse_runs(words, define, fields):
    """(name, op, module, run, tiles per item) for the ``bench sparse-mla`` shapes named by ``words``."""
    from cukv.ops.sparse_mla import SparseMLA

    for name, kind, n, s_q, heads, topk, s_kv in bs.SHAPES:
        if not any(w in name for w in words):
            continue
        tokens = n * s_q
        target, kvd, q, idx, sink = bs.problem(kind, n, s_q, heads, topk, s_kv)
        att = SparseMLA(heads, kv_dtype=kvd)
        att.config, mod = compiled_with(att.config, define, **fields)
        att.plan(tokens, topk)
        out = cp.empty((tokens, heads, 512), cp.uint16)
        items = att._items.get()[:att.num_items]
        yield (name, att, mod, lambda: att.run(q, target, idx, sink=sink, out=out),
               -(-(items[:, 3] - items[:, 2]) // att.config.block_n))


def dense_runs(words, define):
    for name, batch, heads, s_q, ctx in bd.SHAPES + [("b128 h128 ctx512", 128, 128, 1, 512)]:
        if not any(w in name for w in words):
            continue
        lens = bd._lengths(batch, ctx)
        cache, table, q = bd._problem(batch, heads, s_q, lens)
        dec, mod = mla_op_with_defines(heads, lens, s_q, define)
        out = cp.empty((batch, s_q, heads, 512), cp.uint16)
        items = dec._items.get()[:dec.num_items]
        yield (name, dec, mod, lambda: dec.run(q, cache, table, out=out), -(-(items[:, 3] - items[:, 2]) // 64))


words = sys.argv[1].split(",")
define = f"CUKV_MLA_TIMELINE {sys.argv[2] if len(sys.argv) > 2 else ''}".strip()
fields = {k: field_value(v) for k, v in (f.split("=", 1) for f in sys.argv[3].split(","))} if len(sys.argv) > 3 else {}
for name, op, mod, run, tiles in itertools.chain(dense_runs(words, define), sparse_runs(words, define, fields)):
    if getattr(op.config, "persistent", False) and hasattr(op, "_grid") and op.config.gathers:
        # persistent sparse blocks: rows per (token, row block) = item; stamps 2, 5, 6 per item
        n, grid = op.num_items, op._grid
        t = stamps(mod, n, run)
        rel = (t[:, :7] - t[:, 5].min()) / 1e3
        loop = (rel[:, 6] - rel[:, 5]) / np.maximum(tiles, 1)
        epi = rel[:, 2] - rel[:, 6]
        gap = rel[grid:, 5] - rel[:-grid, 2]  # the block's next item's query landed after this item's epilogue
        print(f"== {name} (persistent, grid {grid}): {n} items, span {rel[:, 2].max():.1f} us; per item medians: "
              f"loop {np.median(rel[:, 6] - rel[:, 5]):.2f} us ({np.median(loop):.3f} a tile, p10 "
              f"{np.percentile(loop, 10):.3f} p90 {np.percentile(loop, 90):.3f}), epilogue {np.median(epi):.2f}, "
              f"epilogue -> next item's query landed {np.median(gap):.2f} (p90 {np.percentile(gap, 90):.2f}); "
              f"first item's loop {np.median((rel[:grid, 6] - rel[:grid, 5]) / np.maximum(tiles[:grid], 1)):.3f} a tile",
              flush=True)
        op = run = None
        cp.get_default_memory_pool().free_all_blocks()
        continue
    n = getattr(op, "_grid", op.num_items)  # (persistent blocks: one stamp row per block)
    t = stamps(mod, n, run)
    t0 = t[:, 0].min()
    rel = (t[:, :7] - t0) / 1e3  # us
    sm = t[:, 7]
    print(f"== {name}: {n} items, tiles/item {np.median(tiles):.0f}, kernel span {rel[:, 4].max():.1f} us", flush=True)
    d = lambda a, b: rel[:, b] - rel[:, a]
    for lab, a, b in (("setup 0->1", 0, 1), ("Q land 1->5", 1, 5), ("loop 5->6", 5, 6), ("epilogue 6->2", 6, 2), ("wg2 after wg1 2->3", 2, 3), ("exit wait 3->4", 3, 4), ("total 0->4", 0, 4)):
        x = d(a, b)
        print(f"   {lab:<20} median {np.median(x):7.2f} us  p10 {np.percentile(x, 10):7.2f}  p90 {np.percentile(x, 90):7.2f}")
    # per SM: gaps between one block's exit and the next block's entry
    gaps, starts = [], []
    for s_ in np.unique(sm):
        idx = np.where(sm == s_)[0]
        idx = idx[np.argsort(rel[idx, 0])]
        starts.append(rel[idx[0], 0])
        for i0, i1 in zip(idx, idx[1:]):
            gaps.append(rel[i1, 0] - rel[i0, 4])
    gaps = np.array(gaps)
    print(f"   first entry per SM: median {np.median(starts):.2f} max {np.max(starts):.2f} us; SMs used {len(np.unique(sm))}; "
          f"exit->next entry gap median {np.median(gaps) if len(gaps) else 0:.2f} p90 {np.percentile(gaps, 90) if len(gaps) else 0:.2f} us; "
          f"last exit {rel[:, 4].max():.1f} first-wave last exit {np.sort(rel[:, 4])[len(np.unique(sm)) - 1]:.1f}")
    if n >= 2:  # a token's (a chunk's) two row blocks at even / odd rows: how far apart their last items start
        lag = np.abs(rel[0:n - 1:2, 5] - rel[1:n:2, 5])
        print(f"   row-block pairs' query landed apart: median {np.median(lag):.2f} p90 {np.percentile(lag, 90):.2f} us")
    per_tile = d(5, 6) / np.maximum(tiles[:n], 1)  # (persistent: each block's last item, about the same tiles)
    print(f"   loop per tile median {np.median(per_tile):.2f} us")
    op = run = None
    cp.get_default_memory_pool().free_all_blocks()
