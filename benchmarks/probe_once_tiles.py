"""Convert-once and bf16 prefill over other tiles than the head dim's default (BN x stages), interleaved rounds
(medians), bf16/FP8 ratios against the shipped bf16 default.

    PYTHONPATH=. python3 benchmarks/probe_once_tiles.py --shapes 4x4096x16x16x256 --tiles 64x4,80x3,80x3:nopp \
        --bf16-tiles 80x4
"""
import argparse
import sys

import cupy as cp

import cukv
from cukv.bench.prefill import DTYPE, PAGE_SIZE, _as_float
from cukv.bench.timing import Timer
from cukv.policy.prefill import DEFAULTS, tile_config

from probe_lib import add_unchecked_option, apply_unchecked, probe_cases, probe_report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4x4096x16x16x256,2x8192x16x16x256")
    ap.add_argument("--gran", default="token")
    ap.add_argument("--tiles", default="64x4,80x3,80x2,48x5,64x3",
                    help="convert-once BN x stages (BM, BK: default), optionally :pp / :nopp")
    ap.add_argument("--bf16-tiles", default="80x4,64x5", help="bf16 BN x stages beside the default")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--fused", action="store_true", help="also time fp8_prefill='fused'")
    add_unchecked_option(ap)
    args = ap.parse_args()
    apply_unchecked(args)
    args.gran = int(args.gran) if args.gran.isdigit() else args.gran
    P = sys.modules["cukv.policy.prefill"]  # its tables, swapped per candidate tile
    timer = Timer()
    for shape, (batch, seq_len, hq, hkv, d), data, fcache, out in probe_cases(args.shapes, args.gran):
        q, k, v, cache, pt, offsets, lengths = data
        bm, _, bk, _ = DEFAULTS[d]

        def fp8(**kw):
            p = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE, kv_dtype="fp8_e4m3",
                                  scale_granularity=args.gran, **kw).plan(offsets, lengths)
            return lambda: p.run(q, (fcache, pt), out=out)

        bf = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE).plan(offsets, lengths, mask="causal")
        fns = {"bf16": lambda: bf.run(q, (cache, pt), out=out)}
        for t in filter(None, args.bf16_tiles.split(",")):
            bn, st = map(int, t.split("x"))
            p = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE,
                                  config=tile_config(DTYPE, d, PAGE_SIZE, bm, bn, bk, st)).plan(offsets, lengths)
            fns[f"bf16_{t}"] = lambda p=p: p.run(q, (cache, pt), out=out)
        if args.fused:
            fns["fused"] = fp8(fp8_prefill="fused")
        for t in filter(None, args.tiles.split(",")):
            # "80x3" takes the shipped ring order (pingpong_16bit); "80x3:pp" / "80x3:nopp" force it on / off
            bn, st = map(int, t.split(":")[0].split("x"))
            tiles, ring = P.ONCE_TILES, P.pingpong_16bit
            P.ONCE_TILES = {d: (bm, bn, bk, st)}
            if ":" in t:
                P.pingpong_16bit = lambda *a, on=t.endswith(":pp"): on
            fns[f"once_{t}"] = fp8(fp8_prefill="convert_once")
            P.ONCE_TILES, P.pingpong_16bit = tiles, ring
        ref = _as_float(bf.run(q, (cache, pt)))
        diffs = {}
        for n, f in fns.items():  # compiles; a broken tile shows in its largest difference from the bf16 default
            out.fill(0x7FC0)
            f()
            diffs[n] = float(cp.nan_to_num(cp.abs(_as_float(out) - ref), nan=cp.inf).max())
        cp.cuda.Device().synchronize()
        probe_report(f"{shape} {args.gran}", timer, fns, args.rounds, diffs, digits=3)


if __name__ == "__main__":
    main()
