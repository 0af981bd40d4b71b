"""Where the prefill consumers wait: a build with ``CUKV_WAIT_STATS 1`` (templates/prefill.cuh) sums, over the first
warp of every consumer warpgroup, the time spent waiting for K tiles, V tiles and the ring order's named barrier,
beside the time in the tile loop. bf16 (16-bit kernel) and FP8 convert-once on the same shapes, token scales.

    OUT=$OUT PROBE=benchmarks/probe_waits.py SHAPES=4x4096x16x16x256 bash benchmarks/ab_macros.sh "CUKV_WAIT_STATS=1"
"""
import argparse

import cupy as cp
import numpy as np

import cukv
from cukv.bench.prefill import DTYPE, PAGE_SIZE

from probe_lib import probe_cases


def waits(module, run, reps=5):
    """cukv_wait_stats summed over ``reps`` runs (after one warm run)."""
    ptr = module.get_global("cukv_wait_stats")
    run()
    cp.cuda.Device().synchronize()
    ptr.memset(0, 64)
    for _ in range(reps):
        run()
    cp.cuda.Device().synchronize()
    host = np.zeros(8, np.uint64)
    ptr.copy_to_host(host.ctypes.data, 64)
    return host.astype(np.float64) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4x4096x16x16x256")
    ap.add_argument("--gran", default="token")
    ap.add_argument("--rounds", type=int, default=1)  # ab_macros passes it; unused
    ap.add_argument("--once-tile", default="", help="BMxBNxBKxSTAGES for convert-once at this head dim")
    args = ap.parse_args()
    gran = int(args.gran) if args.gran.isdigit() else args.gran
    for shape, (batch, seq_len, hq, hkv, d), data, fcache, out in probe_cases(args.shapes, gran):
        q, k, v, cache, pt, offsets, lengths = data
        if args.once_tile:
            import sys
            sys.modules["cukv.policy.prefill"].ONCE_TILES[d] = tuple(map(int, args.once_tile.split("x")))
        bf = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE).plan(offsets, lengths, mask="causal")
        f8 = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE, kv_dtype="fp8_e4m3",
                               scale_granularity=gran, fp8_prefill="convert_once").plan(offsets, lengths, mask="causal")
        print(f"{shape}: {bf.config.name} / {f8.kernel_config.name}", flush=True)
        rows = {
            "bf16": waits(bf.config.compiled.module(), lambda: bf.run(q, (cache, pt), out=out)),
            "fp8 convert_once": waits(f8.kernel_config.compiled.module(), lambda: f8.run(q, (fcache, pt), out=out)),
        }
        for name, w in rows.items():
            print(f"{shape} {name}: per warpgroup-tile (ns) K wait {w[0] / w[4]:.0f}, V wait {w[1] / w[4]:.0f}, "
                  f"ring barrier {w[2] / w[4]:.0f}, tile loop {w[3] / w[4]:.0f}; shares of the tile loop: K "
                  f"{w[0] / w[3]:.1%}, V {w[1] / w[3]:.1%}, barrier {w[2] / w[3]:.1%}; "
                  f"{w[4]:.0f} warpgroup-tiles, {w[5]:.0f} warpgroup-items", flush=True)
            if w[7]:
                print(f"    items begun in the first 400 us: K wait {w[6] / w[7]:.0f} ns per tile over {w[7]:.0f} "
                      f"warpgroup-tiles; later: {(w[0] - w[6]) / max(w[4] - w[7], 1):.0f}", flush=True)


if __name__ == "__main__":
    main()
