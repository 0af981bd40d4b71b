"""Decode ring strips by TMA tensor copies (``BatchDecode(tma=True)``, ``DecodeConfig.tma``) beside the cp.async ring
on the bench decode cells (bf16, 32 query / 8 KV heads, d128, page 16 in random order), in one process: each cell's
variants are timed in interleaved rounds with an L2 flush before every call (``cukv.bench.timing``). Prints one line
per cell (plan, medians, TB/s, % of the read ceiling, cp.async/tma) and the geomean of cp.async/tma over the cells
where the ring runs; also checks that both give bitwise the same output (same slot contents, same math).

    PYTHONPATH=. python3 benchmarks/probe_decode_tma.py                       # the bench grid and its extra cells
    PYTHONPATH=. python3 benchmarks/probe_decode_tma.py --cells 64x4096,16x32768 --stages plan,2,4

``--kv-dtype fp8_e4m3`` times the FP8 ring instead (an FP8 cache of the same geometry, ``--scale-granularity``, random
finite codes): FP8 by cp.async (plan's choice) against FP8 by tensor copies at each ring depth of ``--fp8-stages`` (plan's
2, and 3) and each of ``--fp8-min-blocks`` (1, the shipped bound, and 3, which caps registers at 168 for a third block
per SM), beside bf16 by tensor copies on the same cell, and prints bf16-tma / FP8 (the FP8 speedup; the issue's bar is
1.8 at 64 x 4096 and 16 x 32768):

    PYTHONPATH=. python3 benchmarks/probe_decode_tma.py --kv-dtype fp8_e4m3 --cells 64x4096,16x32768,128x8192,128x32768
"""
import argparse
import dataclasses

import cupy as cp

import cukv
from cukv.bench.decode import EXTRA, GRID_BATCH, GRID_CTX, _build, _fp8_cache, fp8_bytes
from cukv.bench.timing import Timer, geomean, interleaved_medians, read_ceiling

CELLS = ",".join(f"{b}x{c}" for b in GRID_BATCH for c in GRID_CTX) + "," + ",".join(f"{b}x{c}" for b, c in EXTRA)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default=CELLS, help="batch x ctx, comma-separated (default: bench decode's full grid)")
    ap.add_argument("--stages", default="plan", help="ring depths, comma-separated: 'plan' (plan's choice) or 2..8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30, help="timed calls per variant, over all rounds")
    ap.add_argument("--no-ceiling", action="store_true", help="skip measuring the read ceiling")
    ap.add_argument("--kv-dtype", default="bfloat16", choices=("bfloat16", "fp8_e4m3"),
                    help="fp8_e4m3: FP8 cp.async vs FP8 tma, beside bf16 tma (--stages is then ignored: --fp8-stages)")
    ap.add_argument("--scale-granularity", default="token", help="FP8: token, tensor, 32, 64 or 128")
    ap.add_argument("--fp8-min-blocks", default="1,3", help="FP8 tma: __launch_bounds__ min blocks to time, comma-separated")
    ap.add_argument("--fp8-stages", default="plan,3", help="FP8 tma: ring depths to time, comma-separated ('plan': 2)")
    args = ap.parse_args()
    hq, hkv, d, ps = 32, 8, 128, 16
    timer = Timer()
    ceiling = None if args.no_ceiling else read_ceiling(timer)[0]
    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    print(f"# {dev}; read ceiling {ceiling:.2f} TB/s" if ceiling else f"# {dev}", flush=True)
    if args.kv_dtype == "fp8_e4m3":
        gran = args.scale_granularity if args.scale_granularity in ("token", "tensor") else int(args.scale_granularity)
        fp8_cells(args, timer, ceiling, hq, hkv, d, ps, gran)
        return
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


def fp8_cells(args, timer, ceiling, hq, hkv, d, ps, gran):
    """Per cell: bf16 tma, FP8 cp.async (plan's choice) and FP8 tma at each ring depth of ``--fp8-stages`` and each
    ``--fp8-min-blocks``, interleaved; one line each with plans, medians, FP8 TB/s (codes and scales) and % of the
    ceiling, cp.async/tma and bf16-tma/FP8 (FP8's speedup), and whether FP8 cp.async and tma gave the same bits (where
    both run the same ring depth); then geomeans of cp.async/tma over the cells where plan runs the ring."""
    from cukv.fp8 import scale_block

    min_blocks = [int(m) for m in args.fp8_min_blocks.split(",") if m]
    stages_list = [None if st == "plan" else int(st) for st in args.fp8_stages.split(",") if st]
    variants = [(st, mb) for st in stages_list for mb in min_blocks]
    ratios = {v: [] for v in variants}
    fp8 = dict(kv_dtype="fp8_e4m3", scale_granularity=gran)
    for cell in args.cells.split(","):
        batch, ctx = map(int, cell.split("x"))
        cache, pt, q, _ = _build(batch, ctx, hq, hkv, d, ps)
        fcache = _fp8_cache(batch, ctx, hkv, d, ps, gran)
        fbytes = fp8_bytes(batch, ctx, hkv, d, scale_block(gran, d))
        fns, outs, plans = {}, {}, {}

        def add(key, dec, c):
            out = outs[key] = cp.full_like(q, 0x7FC0)  # NaN bits: every row must be written
            fns[key] = (lambda dec=dec, out=out, c=c: dec.run(q, c, pt, out=out))
            fns[key]()
            plans[key] = (dec.config.name.replace("cukv_decode_", ""), dec.num_splits, dec.config.stages)

        add("bf16_tma", cukv.BatchDecode(hq, hkv, d, ps, "bfloat16", tma=True).plan(batch, ctx), cache)
        add("fp8_cpa", cukv.BatchDecode(hq, hkv, d, ps, "bfloat16", tma=False, **fp8).plan(batch, ctx), fcache)
        keys = {}
        for st, mb in variants:
            dec = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16", stages=st, tma=True, **fp8)
            # the ring config at this launch bound (a config field; BatchDecode itself keeps min_blocks 1)
            try:
                dec._configs = tuple(dataclasses.replace(c, min_blocks=mb) if c.stages else c for c in dec._configs)
                add(keys.setdefault((st, mb), f"fp8_tma_r{st or 'plan'}_b{mb}"), dec.plan(batch, ctx), fcache)
            except ValueError as e:  # a register cap or a ring depth this kernel does not fit
                print(f"   {cell} fp8 tma stages={st} min_blocks={mb}: {e}", flush=True)
                keys.pop((st, mb), None)
        cp.cuda.Device().synchronize()
        med = interleaved_medians(timer, fns, reps=args.reps, rounds=args.rounds)
        tbs = {k: fbytes / med[k] / 1e9 for k in med if k.startswith("fp8")}
        pct = {k: f" ({100 * v / ceiling:.1f}%)" if ceiling else "" for k, v in tbs.items()}
        cpa_ring = plans["fp8_cpa"][2] > 0
        parts = [f"bf16 tma {plans['bf16_tma'][0]} s{plans['bf16_tma'][1]} {med['bf16_tma'] * 1e3:.1f} us",
                 f"fp8 cp.async {plans['fp8_cpa'][0]} s{plans['fp8_cpa'][1]} {med['fp8_cpa'] * 1e3:.1f} us "
                 f"{tbs['fp8_cpa']:.2f} TB/s{pct['fp8_cpa']} bf16/fp8 {med['bf16_tma'] / med['fp8_cpa']:.3f}"]
        for v, k in keys.items():
            ring = plans[k][2] > 0  # plan's register kernel (small steps) has no tensor copies
            if ring and cpa_ring:
                ratios[v].append(med["fp8_cpa"] / med[k])
            same = (f" bitwise {bool(cp.array_equal(outs['fp8_cpa'], outs[k]))}"
                    if plans[k][2] == plans["fp8_cpa"][2] else "")
            parts.append(f"fp8 tma {plans[k][0]} s{plans[k][1]} {med[k] * 1e3:.1f} us {tbs[k]:.2f} TB/s{pct[k]} "
                         f"cp.async/tma {med['fp8_cpa'] / med[k]:.3f} bf16/fp8 {med['bf16_tma'] / med[k]:.3f}"
                         f"{'' if ring else ' (registers: no tensor copies)'}{same}")
        print(f"{batch:>4} x {ctx:<6} " + " | ".join(parts), flush=True)
        del fns, outs, cache, fcache, pt, q
        cp.get_default_memory_pool().free_all_blocks()
    for (st, mb), r in ratios.items():
        if r:
            print(f"geomean FP8 cp.async/tma (stages {st or 'plan'}, min_blocks {mb}) over {len(r)} ring cells: "
                  f"{geomean(r):.3f} (min {min(r):.3f}, max {max(r):.3f})", flush=True)


if __name__ == "__main__":
    main()
