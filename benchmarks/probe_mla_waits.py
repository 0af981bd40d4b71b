"""Where the absorbed MLA decode's slice consumers (the alternating schedule with per-slice barriers) wait: a build
with ``CUKV_MLA_WAIT_STATS`` sums, per consumer warpgroup (its first thread), the clocks spent waiting on the K
slices' full barriers, on the other warpgroup's P, and in consume() in all; printed per item and per tile. With
``--no-load`` also the same counts when the ring runs on the tiles already in it (``CUKV_MLA_NO_LOAD``).

    PYTHONPATH=. python3 benchmarks/probe_mla_waits.py [--dense "h128 ctx8192"] [--no-load] [--define NAME]
"""
from __future__ import annotations

import argparse

import numpy as np

NAMES = ("wg0 QK rope+0-3", "wg0 QK 4-7", "wg1 QK", "V waits", "wg0 P1 wait", "wg1 P0 wait", "consume", "items")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dense", default="h128 ctx8192,h128 ctx32768")
    ap.add_argument("--no-load", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--define", default="", help="more defines for every build (space-separated)")
    args = ap.parse_args()
    import cupy as cp

    from probe_lib import mla_op_with_defines

    from cukv.bench import mla_decode as bd

    for name, batch, heads, s_q, ctx in bd.SHAPES:
        if not any(w in name for w in args.dense.split(",")):
            continue
        lens = bd._lengths(batch, ctx)
        cache, table, q = bd._problem(batch, heads, s_q, lens)
        base = f"CUKV_MLA_WAIT_STATS {args.define}".strip()
        for define in [base] + ([f"{base} CUKV_MLA_NO_LOAD"] if args.no_load else []):
            dec, mod = mla_op_with_defines(heads, lens, s_q, define)
            out = cp.empty((batch, s_q, heads, 512), cp.uint16)
            dec.run(q, cache, table, out=out)
            ptr = mod.get_global("cukv_mla_wait_stats")
            cp.cuda.Device().synchronize()
            ptr.memset(0, 64)
            ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
            ev0.record()
            for _ in range(args.reps):
                dec.run(q, cache, table, out=out)
            ev1.record()
            ev1.synchronize()
            ms = cp.cuda.get_elapsed_time(ev0, ev1) / args.reps
            host = np.zeros(8, np.uint64)
            ptr.copy_to_host(host.ctypes.data, 64)
            h = host.astype(np.float64) / args.reps
            items = h[7]
            tiles_per_item = float(np.sum(-(-lens // 64))) * dec.row_blocks / (items / 2)
            print(f"{name} [{define}] {ms * 1e3:.1f} us, {items / 2:.0f} items, {tiles_per_item:.1f} tiles/item; "
                  "clocks per item (and per pair of tiles):", flush=True)
            for i in range(7):
                per_item = h[i] / (items / 2)
                print(f"   {NAMES[i]:<18} {per_item:10.0f} ({per_item / (tiles_per_item / 2):7.0f})")
        cache = table = q = None
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
