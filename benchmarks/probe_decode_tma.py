"""Decode ring strips by TMA tensor copies (``BatchDecode(tma=True)``, ``DecodeConfig.tma``) beside the cp.async ring
on the bench decode cells (bf16, 32 query / 8 KV heads, d128, page 16 in random order), in one process: each cell's
variants are timed in interleaved rounds with an L2 flush before every call (``cukv.bench.timing``). Prints one line
per cell (plan, medians, TB/s, % of the read ceiling, cp.async/tma) and the geomean of cp.async/tma over the cells
where the ring runs; also checks that both give bitwise the same output (same slot contents, same math).

    PYTHONPATH=. python3 benchmarks/probe_decode_tma.py                       # the bench grid and its extra cells
    PYTHONPATH=. python3 benchmarks/probe_decode_tma.py --cells 64x4096,16x32768 --stages plan,2,4
"""
import argparse

import cupy as cp

import cukv
from cukv.bench.decode import EXTRA, GRID_BATCH, GRID_CTX, _build
from cukv.bench.timing import Timer, geomean, interleaved_medians, read_ceiling

CELLS = ",".join(f"{b}x{c}" for b in GRID_BATCH for c in GRID_CTX) + "," + ",".join(f"{b}x{c}" for b, c in EXTRA)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default=CELLS, help="batch x ctx, comma-separated (default: bench decode's full grid)")
    ap.add_argument("--stages", default="plan", help="ring depths, comma-separated: 'plan' (plan's choice) or 2..8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30, help="timed calls per variant, over all rounds")
    ap.add_argument("--no-ceiling", action="store_true", help="skip measuring the read ceiling")
    args = ap.parse_args()
    hq, hkv, d, ps = 32, 8, 128, 16
    timer = Timer()
    ceiling = None if args.no_ceiling else read_ceiling(timer)[0]
    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    print(f"# {dev}; read ceiling {ceiling:.2f} TB/s" if ceiling else f"# {dev}", flush=True)
    stages_list = [None if s == "plan" else int(s) for s in args.stages.split(",") if s] or [None]
    ratios = {st: [] for st in stages_list}
    for cell in args.cells.split(","):
        batch, ctx = map(int, cell.split("x"))
        cache, pt, q, _ = _build(batch, ctx, hq, hkv, d, ps)
        nbytes = 2 * batch * ctx * hkv * d * 2
        fns, outs, plans = {}, {}, {}
        for st in stages_list:
            for tma in (False, True):
                try:
                    dec = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16", stages=st, tma=tma).plan(batch, ctx)
                except ValueError as e:  # a forced depth that does not fit
                    print(f"   {cell} stages={st} tma={tma}: {e}", flush=True)
                    continue
                key = f"{'tma' if tma else 'cpa'}{'' if st is None else f'_r{st}'}"
                out = outs[key] = cp.full_like(q, 0x7FC0)  # NaN bits: every row must be written
                fns[key] = (lambda dec=dec, out=out, q=q, cache=cache, pt=pt: dec.run(q, cache, pt, out=out))
                fns[key]()
                plans[key] = (dec.config.name, dec.num_splits)
        cp.cuda.Device().synchronize()
        med = interleaved_medians(timer, fns, reps=args.reps, rounds=args.rounds)
        parts = []
        for st in stages_list:
            a, b = f"cpa{'' if st is None else f'_r{st}'}", f"tma{'' if st is None else f'_r{st}'}"
            if a not in med or b not in med:
                continue
            same = bool(cp.array_equal(outs[a], outs[b]))
            ring = plans[b][0] != plans[a][0]  # the register kernel (small steps) has no tensor copies
            if ring:
                ratios[st].append(med[a] / med[b])
            tbs = [nbytes / med[k] / 1e9 for k in (a, b)]
            pct = f" ({100 * tbs[0] / ceiling:.1f}% / {100 * tbs[1] / ceiling:.1f}%)" if ceiling else ""
            parts.append(f"{plans[b][0].replace('cukv_decode_', '')} s{plans[b][1]}: cp.async {med[a] * 1e3:.1f} us "
                         f"tma {med[b] * 1e3:.1f} us  {tbs[0]:.2f} / {tbs[1]:.2f} TB/s{pct}  cp.async/tma "
                         f"{med[a] / med[b]:.3f}{'' if ring else ' (same kernel: registers)'}  bitwise {same}")
        print(f"{batch:>4} x {ctx:<6} " + " | ".join(parts), flush=True)
        del fns, outs, cache, pt, q
        cp.get_default_memory_pool().free_all_blocks()
    for st, r in ratios.items():
        if r:
            print(f"geomean cp.async/tma (stages {st or 'plan'}) over {len(r)} ring cells: {geomean(r):.3f} "
                  f"(min {min(r):.3f}, max {max(r):.3f})", flush=True)


if __name__ == "__main__":
    main()
