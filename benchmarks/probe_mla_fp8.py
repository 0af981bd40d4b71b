"""MLA decode over an FP8 cache: producer variants (L2 prefetch distance, FP8 rows in flight) beside bf16.

    PYTHONPATH=. python3 benchmarks/probe_mla_fp8.py --shapes 128x16x8192,128x128x8192,1x128x32768 \
        --variants bf16:0:8,bf16:1:8,fp8:0:8,fp8:1:8,fp8:2:8,fp8:1:16

A variant is ``cache:prefetch_tiles:fp8_rows[:split|:slices][:mc|:nomc]`` (``MLADecodeConfig`` fields on the
policy's config for the shape; ``split``: the 64-row "split" consumers where the policy picks "narrow"; ``slices``:
the alternating consumers over per-slice barriers, 16-bit caches; ``mc`` / ``nomc``: ``multicast`` on / off, the
cluster pairs that share a tile's copies or an FP8 tile's dequantization); a shape is
``BxHxCTX`` (s_q 1, page 64, the bench's data). Every FP8 variant's output is compared with the first FP8
variant's (the producer changes must not change a bit). Times are medians over interleaved rounds, L2 flushed;
compare them only within one call. ``CUKV_DEFINES=CUKV_MLA_FP8_NO_LOAD`` times the FP8 kernels without their code
loads (the floor the rest of the kernel sets).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import cupy as cp

from cukv.bench.mla_decode import _fp8_copy, _lengths, _problem
from cukv.bench.timing import Timer, interleaved_medians, read_ceiling_tbs
from cukv.ops.mla_decode import BatchMLADecode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128x16x8192,128x128x8192,1x128x32768")
    ap.add_argument("--variants", default="bf16:0:8,fp8:0:8,fp8:1:8")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    variants = []
    for v in args.variants.split(","):
        kind, pf, fr, *flags = v.split(":")
        variants.append((kind, int(pf), int(fr), "split" if "split" in flags else "slices" if "slices" in flags
                         else None, True if "mc" in flags else False if "nomc" in flags else None))
    timer = Timer()
    ceiling = read_ceiling_tbs(timer)
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; read ceiling {ceiling:.2f} TB/s; "
          f"CUKV_DEFINES={os.environ.get('CUKV_DEFINES', '')!r}", flush=True)
    rows = []
    for shape in args.shapes.split(","):
        b, h, ctx = (int(x) for x in shape.split("x"))
        lens = _lengths(b, ctx)
        cache, table, q = _problem(b, h, 1, lens)
        fcache = _fp8_copy(cache) if any(v[0] == "fp8" for v in variants) else None
        fns, outs, decs = {}, {}, {}
        for kind, pf, fr, split, mc in variants:
            label = f"{kind}_pf{pf}_r{fr}" + (f"_{split}" if split else "") + {None: "", True: "_mc", False: "_nomc"}[mc]
            kw = dict(slice_release=True) if split == "slices" else dict(schedule=split)
            dec = BatchMLADecode(h, kv_dtype="fp8_e4m3" if kind == "fp8" else None, **kw)
            fields = {} if mc is None else {"multicast": mc}
            dec.config = dataclasses.replace(dec.config, prefetch_tiles=pf, fp8_rows=fr, **fields)
            dec.plan(lens, 1)
            c = fcache if kind == "fp8" else cache
            out = cp.empty((b, 1, h, 512), cp.uint16)
            decs[label] = dec
            outs[label] = dec.run(q, c, table).copy()
            fns[label] = lambda dec=dec, c=c, out=out: dec.run(q, c, table, out=out)
        ms = interleaved_medians(timer, fns, args.reps, args.rounds)
        first_fp8 = next((k for k in outs if k.startswith("fp8")), None)
        nbytes = {"bf16": 1152, "fp8": 656}
        line = f"b{b} h{h} ctx{ctx}:"
        r = {"shape": shape}
        base = next((k for k in ms if k.startswith("bf16")), None)
        for k, t in ms.items():
            tbs = float(lens.sum()) * nbytes[k.split("_")[0]] / (t * 1e-3) / 1e12
            same = "" if not (k.startswith("fp8") and first_fp8) else \
                (" =" if bool((outs[k] == outs[first_fp8]).all()) else " DIFF")
            ratio = f" x{ms[base] / t:.2f}" if base and k != base else ""
            line += f" | {k} {t:.3f} ms {tbs:.2f} TB/s ({100 * tbs / ceiling:.0f}%){ratio}{same}"
            r[k] = {"ms": t, "tbs": tbs, "same_as_first_fp8": same.strip() != "DIFF"}
        rows.append(r)
        print(line, flush=True)
        fns = outs = decs = cache = fcache = table = q = None
        cp.get_default_memory_pool().free_all_blocks()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"read_ceiling_tbs": ceiling, "defines": os.environ.get("CUKV_DEFINES", ""), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
