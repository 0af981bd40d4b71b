"""Where an MLA decode run's time goes around its tiles: a build with ``CUKV_MLA_TIMELINE`` stamps the global timer per
block (entry, after the barrier set-up, the query block landed, warpgroup 0's last tile done, each consumer's epilogue
done, exit) and its SM; printed as medians and percentiles over the blocks of one run, with the gaps between blocks on
each SM. The stamps cost little but are not free: time with the bench, not with this.

    PYTHONPATH=. python3 benchmarks/probe_mla_timeline.py "ctx4096,s_q2,skewed" ["CUKV_X CUKV_Y=1"]

The argument picks ``bench mla-decode`` shapes by words in their names (and "b128 h128 ctx512"); a second one adds
defines (the ``CUKV_DEFINES`` form) to the timeline build. Stamps 5 and 6 come
from the per-slice consumers (h128) only.
"""
import sys

import cupy as cp
import numpy as np
from probe_lib import mla_op_with_defines

from cukv.bench import mla_decode as bd

words = sys.argv[1].split(",")
extra = sys.argv[2] if len(sys.argv) > 2 else ""
for name, batch, heads, s_q, ctx in bd.SHAPES + [("b128 h128 ctx512", 128, 128, 1, 512)]:
    if not any(w in name for w in words):
        continue
    lens = bd._lengths(batch, ctx)
    cache, table, q = bd._problem(batch, heads, s_q, lens)
    dec, mod = mla_op_with_defines(heads, lens, s_q, f"CUKV_MLA_TIMELINE {extra}".strip())
    out = cp.empty((batch, s_q, heads, 512), cp.uint16)
    for _ in range(3):
        dec.run(q, cache, table, out=out)
    g = mod.get_global("cukv_mla_timeline")
    cp.cuda.Device().synchronize()
    g.memset(0, 16384 * 8 * 8)
    dec.run(q, cache, table, out=out)
    cp.cuda.Device().synchronize()
    h = np.zeros(16384 * 8, np.uint64)
    g.copy_to_host(h.ctypes.data, h.nbytes)
    n = dec.num_items
    t = h.reshape(-1, 8)[:n].astype(np.int64)
    t0 = t[:, 0].min()
    rel = (t[:, :7] - t0) / 1e3  # us
    sm = t[:, 7]
    items = dec._items.get()[:n]
    tiles = -(-(items[:, 3] - items[:, 2]) // 64)
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
    per_tile = d(5, 6) / np.maximum(tiles, 1)
    print(f"   loop per tile median {np.median(per_tile):.2f} us")
    cache = table = q = out = dec = None
    cp.get_default_memory_pool().free_all_blocks()
