"""Prefill tile shapes on the bench shapes: for bf16 and the FP8 defaults (token and tensor scales), the default tile
beside other BM x BN tiles with the default's producer (TMA where the pages allow it) and ring, in interleaved rounds
(medians). Each output is checked against its kind's default (no NaN; max |diff| printed).

    PYTHONPATH=. python3 benchmarks/probe_prefill_tiles.py --shapes 4x4096x32x8x128 --tiles 128:128:128,128:96:128
"""
import argparse
import dataclasses

import cupy as cp

import cukv
from cukv.bench.decode import interleaved_medians
from cukv.bench.prefill import DTYPE, PAGE_SIZE, _build, fp8_cache_like
from cukv.bench.timing import Timer
from cukv.configs.prefill import tma_applies
from cukv.policy.prefill import default_config

from probe_lib import add_unchecked_option, apply_unchecked

SHAPES = "4x4096x32x8x128,1x16384x32x8x128,8x2048x32x32x128,4x4096x16x16x256,8x2048x32x8x64"
#: per head dim, BM:BN tiles to try beside the default
TILES = {64: "192:128,128:128,192:64", 128: "128:128,128:96,128:64", 256: ""}


def variants(cfgs, kind, suffix, change):
    """Each (label, config) of ``cfgs`` with the fields ``change(config)`` gives, labelled ``label suffix``; configs
    outside the domain are skipped with the reason."""
    got = []
    for n, c in cfgs:
        try:
            got.append((f"{n} {suffix}", dataclasses.replace(c, **change(c))))
        except ValueError as e:
            print(f"  skip {kind} {n} {suffix}: {str(e)[:160]}")
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES, help="batch x L x hq x hkv x d, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", default="bf16,token,tensor")
    ap.add_argument("--tiles", default=None, help="BM:BN[:BK:stages],... ('none': the default only; default: TILES "
                    "for the head dim; BK and stages default to the kind's default tile's)")
    ap.add_argument("--pingpong", default="", help="also try these kinds with pingpong flipped (e.g. bf16)")
    ap.add_argument("--persistent", default="", help="also try these kinds on the persistent grid (e.g. bf16)")
    ap.add_argument("--pv-wait", default="", help="also try these kinds with pv_wait flipped (e.g. bf16)")
    ap.add_argument("--page", type=int, default=PAGE_SIZE, help="page size of the caches (1: the cp.async producer)")
    add_unchecked_option(ap)
    args = ap.parse_args()
    apply_unchecked(args)
    timer = Timer()
    for shape in args.shapes.split(","):
        batch, seq_len, hq, hkv, d = map(int, shape.split("x"))
        data = _build(batch, seq_len, hq, hkv, d, page_size=args.page)
        q, k, v, cache, pt, offsets, lengths = data
        spec = "" if args.tiles == "none" else (args.tiles or TILES.get(d, ""))
        tiles = [tuple(map(int, t.split(":"))) for t in filter(None, spec.split(","))]
        fns, outs, ref = {}, {}, {}
        for kind in args.kinds.split(","):
            if kind == "bf16":
                base, kv, kw = default_config(DTYPE, d, args.page), (cache, pt), {}
            else:
                fc = fp8_cache_like(data, kind)
                base = default_config(DTYPE, d, args.page, "fp8_e4m3", d if kind == "token" else 0)
                kv, kw = (fc, pt), dict(kv_dtype="fp8_e4m3", scale_granularity=fc.scale_granularity)
            cfgs = [("default", base)]
            for tile in tiles:
                bm, bn = tile[:2]
                bk, st = tile[2:] if len(tile) == 4 else (base.BK, base.stages)
                label = "x".join(map(str, tile))
                try:
                    cfgs.append((label, dataclasses.replace(base, BM=bm, BN=bn, BK=bk, stages=st,
                                                            tma=tma_applies(args.page, bn))))
                except ValueError as e:
                    print(f"  skip {kind} {label}: {str(e)[:160]}")
            if kind in args.pingpong.split(","):
                cfgs += [(n + " pp^", dataclasses.replace(c, pingpong=not c.pingpong)) for n, c in list(cfgs)
                         if c.BM >= 128]
            if kind in args.pv_wait.split(","):
                cfgs += variants(cfgs, kind, "pvw^", lambda c: dict(pv_wait=not c.pv_wait))
            if kind in args.persistent.split(","):
                cfgs += variants(cfgs, kind, "pers", lambda c: dict(persistent=True))
            for label, cfg in cfgs:
                name = f"{kind} {label}"
                pf = cukv.BatchPrefill(hq, hkv, d, page_size=args.page, dtype=DTYPE, config=cfg, **kw)
                pf.plan(offsets, lengths, mask="causal")
                out = outs[name] = cp.full_like(q, 0x7FC0)  # NaN bits: every row must be written
                fns[name] = (lambda pf=pf, out=out, kv=kv: pf.run(q, kv, out=out))
                fns[name]()
                ref.setdefault(kind, out)
        got = interleaved_medians(timer, fns, reps=5 * args.rounds, rounds=args.rounds)
        bf = got.get("bf16 default")
        print(shape, flush=True)
        for name, t in got.items():
            kind = name.split()[0]
            # bf16 outputs are uint16 bit patterns: widen them to float32
            o, r = ((a.astype(cp.uint32) << 16).view(cp.float32) for a in (outs[name], ref[kind]))
            diff = float(cp.abs(o - r).max())
            nan = bool(cp.isnan(o).any())
            td = got[f"{kind} default"]
            print(f"  {name:22s} {t:.3f} ms  x{td / t:.3f} of its default"
                  + (f"  bf16-default/this {bf / t:.3f}" if bf else "") + f"  maxdiff {diff:.2e}{' NaN!' if nan else ''}",
                  flush=True)
        fns.clear()
        outs.clear()
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
