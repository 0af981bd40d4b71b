"""fp8_prefill='convert_once' beside the bf16 default and the other FP8 strategies, interleaved rounds (medians),
on the bench shapes (batch x L x hq x hkv x d, causal prompts).

    PYTHONPATH=. python3 benchmarks/probe_prefill_once.py --shapes 8x2048x32x32x128 --gran token
"""
import argparse

import cupy as cp

import cukv
from cukv.bench.prefill import DTYPE, PAGE_SIZE, _as_float
from cukv.bench.timing import Timer

from probe_lib import once_variant, probe_cases, probe_report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4x4096x32x8x128,1x16384x32x8x128,8x2048x32x32x128,4x4096x16x16x256,"
                    "8x2048x32x8x64")
    ap.add_argument("--gran", default="token", help="token, tensor or a scale block (32, 64, 128)")
    ap.add_argument("--strategies", default="convert_once", help="comma-separated fp8_prefill values")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stats", action="store_true", help="print the visit counts of a CUKV_ONCE_STATS=1 build")
    args = ap.parse_args()
    args.gran = int(args.gran) if args.gran.isdigit() else args.gran  # 32, 64, 128: block scales
    timer = Timer()
    for shape, (batch, seq_len, hq, hkv, d), data, fcache, out in probe_cases(args.shapes, args.gran):
        q, k, v, cache, pt, offsets, lengths = data
        bf = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE).plan(offsets, lengths, mask="causal")
        fns = {"bf16": lambda bf=bf: bf.run(q, (cache, pt), out=out)}
        ref = _as_float(bf.run(q, (cache, pt)))  # each strategy's first output against it: a broken variant shows
        diffs = {}
        for s in args.strategies.split(","):
            fp8_prefill, once_persistent, max_blocks = once_variant(s)
            pf = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE, kv_dtype="fp8_e4m3",
                                   scale_granularity=args.gran, fp8_prefill=fp8_prefill, once_persistent=once_persistent,
                                   max_blocks=max_blocks).plan(offsets, lengths, mask="causal")
            # compiles; and fills a convert-once workspace (CUKV_ONCE_UB reads it)
            diffs[s] = float(cp.nan_to_num(cp.abs(_as_float(pf.run(q, (fcache, pt))) - ref), nan=cp.inf).max())
            fns[s] = lambda pf=pf: pf.run(q, (fcache, pt), out=out)
            if args.stats and s.startswith("convert_once"):
                pf.run(q, (fcache, pt), out=out)  # warm: the stats of a second run
                st = pf._plan.flags[:32].get()
                print(f"{shape} stats {list(st)}", flush=True)
                u = st.view("u8")  # [10..15] as three u64: ~start, end, ~first end (ns)
                start, end, first_end = ~int(u[5]) & (2**64 - 1), int(u[6]), ~int(u[7]) & (2**64 - 1)
                if end:
                    from cukv.device import sm_count
                    blocks = sm_count()
                    print(f"{shape} first-item waits: mean {st[7] * 64 / 1e3 / blocks:.1f} us per block, longest "
                          f"{st[8] * 64 / 1e3:.1f} us; all waits {st[5] * 64 / 1e3 / blocks:.1f} us per block; kernel "
                          f"{(end - start) / 1e3:.1f} us, tail (first block done -> last) {(end - first_end) / 1e3:.1f}"
                          f" us; the consumers' query waits at item boundaries {st[16] * 64 / 1e3 / blocks:.1f} us per "
                          f"block (its first warpgroup)", flush=True)
        cp.cuda.Device().synchronize()
        probe_report(f"{shape} {args.gran}", timer, fns, args.rounds, diffs)


if __name__ == "__main__":
    main()
