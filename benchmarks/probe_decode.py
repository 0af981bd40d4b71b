"""Repeatability probe for decode: a few cells, several (stages, splits) variants, timed in interleaved rounds
so that clock or placement drift shows up as round-to-round spread instead of as a variant's advantage.

    PYTHONPATH=. python3 benchmarks/probe_decode.py [--rounds 3] [--cells 64x4096,32x8192]
"""
import argparse

import cupy as cp

import cukv
from cukv.bench.decode import _build
from cukv.bench.timing import Timer

VARIANTS = [(3, 1), (3, 2), (3, 4), (2, 1), (2, 2), (4, 1), (0, 1), (0, 2)]  # (stages, num_splits)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cells", default="64x4096,32x8192,128x2048,16x32768")
    ap.add_argument("--peers", action="store_true", help="time the SDPA peers too")
    ap.add_argument("--variants", default=None, help="stages:splits,... (default: a built-in list)")
    args = ap.parse_args()
    timer = Timer()
    hq, hkv, d, ps = 32, 8, 128, 16
    for cell in args.cells.split(","):
        batch, ctx = map(int, cell.split("x"))
        cache, pt, q, table = _build(batch, ctx, hq, hkv, d, ps)
        out = cp.empty_like(q)
        nbytes = 2 * batch * ctx * hkv * d * 2
        decs = {}
        variants = [tuple(map(int, v.split(":"))) for v in args.variants.split(",")] if args.variants else VARIANTS
        for st, sp in variants:
            try:
                decs[(st, sp)] = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16", stages=st).plan(batch, ctx, num_splits=sp)
            except ValueError:
                pass
        auto = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16").plan(batch, ctx)
        decs["auto"] = auto
        # the same values in a head-major page layout ([pages, 2, H, page_size, D]: a head's page rows contiguous)
        hnd = cp.empty((cache.num_pages, 2, hkv, ps, d), cp.uint16)
        hnd[:, 0] = cache.k.transpose(0, 2, 1, 3)
        hnd[:, 1] = cache.v.transpose(0, 2, 1, 3)
        hcache = cukv.PagedKVCache.from_arrays(hnd[:, 0].transpose(0, 2, 1, 3), hnd[:, 1].transpose(0, 2, 1, 3), "bfloat16")
        fns = {k: (lambda dec=dec: dec.run(q, cache, pt, out=out)) for k, dec in decs.items()}
        fns["auto_hnd"] = lambda: auto.run(q, hcache, pt, out=out)
        if args.peers:
            from cukv.bench.decode import _peer_fns, _torch
            fns.update(_peer_fns(_torch(), cache, table, q, out, batch, ctx, hq, d, {}))
        res = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                res[k].append(timer.median_ms(fn, reps=15, warmup_ms=20))
        print(f"{batch} x {ctx}: auto = stages {auto.config.stages} splits {auto.num_splits}")
        for k, v in res.items():
            best = min(v)
            print(f"   {str(k):>8}: " + " ".join(f"{x * 1e3:7.1f}" for x in v) + f" us   best {nbytes / best / 1e9:.2f} TB/s")
        del cache, pt, q, out, decs, auto, hcache, hnd, fns
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
