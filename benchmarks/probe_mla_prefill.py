"""Tile probe for the MLA prefill: times ``MLAPrefillConfig`` variants on the ``bench mla-prefill`` shapes in
interleaved rounds (the first config is the baseline) and prints one line per shape, then each config's geomean.

    python benchmarks/probe_mla_prefill.py --configs 128x64x4,128x128x2:pvw,128x96x4:pp [--shapes 4x16x4096,...]

A config is ``BMxBNxSTAGES`` with optional ``:pp`` (pingpong), ``:pvw`` (pv_wait), ``:pers`` (persistent grid),
``:tma`` (tensor copies) and ``:st`` (the output through shared memory by TMA, ``tma_store``) flags, and ``:D=NAME``
compiles that variant with the preprocessor define NAME (an experiment switch, e.g. ``:D=CUKV_WAIT_STATS``),
``:T=N`` plans it with ``tail_heads=N`` (0: all heads; without it, the policy's);
``--unchecked`` skips the measured domain rules (ptxas and the static_asserts still
apply)."""
from __future__ import annotations

import argparse

import numpy as np

from probe_lib import add_unchecked_option, probe_report


def parse(text: str, page: int):
    from cukv.configs.mla_prefill import MLAPrefillConfig

    out = {}
    for entry in text.split(","):
        dims, *flags = entry.split(":")
        bm, bn, st = map(int, dims.split("x"))
        DEFINES[entry] = " ".join(f[2:] for f in flags if f.startswith("D="))
        TAIL_HEADS[entry] = next((int(f[2:]) for f in flags if f.startswith("T=")), None)
        out[entry] = MLAPrefillConfig("bfloat16", BM=bm, BN=bn, stages=st, page_size=page, pingpong="pp" in flags,
                                      pv_wait="pvw" in flags, persistent="pers" in flags, tma="tma" in flags,
                                      tma_store="st" in flags)
    return out


DEFINES = {}  # variant -> CUKV_DEFINES it compiles with
TAIL_HEADS = {}  # variant -> plan(tail_heads=...) (None: the policy's)


def _group(g, heads):
    """``:T=N`` capped at the shape's head count (N 0: all heads)."""
    return None if g is None else min(g or heads, heads)


def _compile(cfg, defines=""):
    import os

    os.environ["CUKV_DEFINES"] = defines  # read at compile time; a config object keeps the module it compiled
    try:
        f = cfg.compiled.functions[cfg.name]
        return f"spills {f.spills} bytes" if f.spills else None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:200]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", required=True)
    ap.add_argument("--shapes", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    add_unchecked_option(ap)
    args = ap.parse_args()
    if args.unchecked:
        from cukv.configs import mla_prefill

        mla_prefill.check_rule = lambda *a, **k: None
    import cupy as cp

    from cukv.bench.mla_prefill import PAGE, SHAPES, _problem
    from cukv.bench.timing import Timer
    from cukv.ops.mla_prefill import BatchMLAPrefill

    cfgs = parse(args.configs, PAGE)
    import concurrent.futures as cf
    import os

    with cf.ProcessPoolExecutor(min(len(cfgs), os.cpu_count() or 1)) as ex:  # compile every variant up front
        for key, err in zip(cfgs, ex.map(_compile, cfgs.values(), [DEFINES[k] for k in cfgs])):
            if err:
                print(f"{key}: {err}")
    for key, cfg in cfgs.items():  # each variant's module, loaded here under its defines (from the disk cache)
        _compile(cfg, DEFINES[key])
    os.environ["CUKV_DEFINES"] = ""
    timer = Timer()
    ratios = {k: [] for k in cfgs}
    for name, batch, heads, q_len, prefix, mask in SHAPES:
        if args.shapes and name.split(" ")[0] not in args.shapes.split(","):
            continue
        q, k_nope, v, cache, table, qo, kl = _problem(batch, heads, q_len, prefix)
        fns, outs = {}, {}
        for key, cfg in cfgs.items():
            try:
                pf = BatchMLAPrefill(heads, PAGE, config=cfg).plan(qo, kl, mask=mask,
                                                                 tail_heads=_group(TAIL_HEADS[key], heads))
            except Exception as e:  # noqa: BLE001 - a config that does not build is reported
                print(f"{key}: {type(e).__name__}: {str(e)[:150]}")
                continue
            outs[key] = cp.empty((q.shape[0], heads, 128), cp.uint16)
            fns[key] = (lambda pf=pf, o=outs[key]: pf.run(q, k_nope, v, cache=cache, block_table=table, out=o))
            fns[key]()
        base = next(iter(outs.values()))
        # bf16 bits -> float32 (the high half of a float32); tiles of another BN round differently, so the baseline's
        # magnitude sets the scale: 0 means bitwise the same
        val = lambda o: (o.astype(cp.uint32) << 16).view(cp.float32)  # noqa: E731
        diffs = {k: float(cp.abs(val(o) - val(base)).max()) for k, o in outs.items()}
        med = probe_report(name, timer, fns, args.rounds, diffs, reps=args.reps)
        b0 = next(iter(med.values()))
        for k, m in med.items():
            ratios[k].append(b0 / m)
        q = k_nope = v = cache = None
        cp.get_default_memory_pool().free_all_blocks()
    for k, r in ratios.items():
        if r:
            print(f"{k:<20} geomean speedup over the first {np.exp(np.mean(np.log(r))):.3f}")


if __name__ == "__main__":
    main()
