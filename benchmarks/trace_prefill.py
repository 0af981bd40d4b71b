"""Per-iteration pipeline timeline of the prefill kernel (bf16 default beside the FP8 default) on one shape.

    PYTHONPATH=. python3 benchmarks/trace_prefill.py --shape 4x4096x32x8x128 --out $OUT

Compiles with the define CUKV_TRACE=1 (templates/debug.cuh; CUKV_DEFINES, part of the cache key), so
the timestamps never reach the shipped kernels. For the heaviest blocks of head 0 it prints, per role, the
median cycles of each phase over the steady-state iterations (the first and last four dropped):
producer warp 0 (FP8: issue the next tile, its K ring slot wait included / wait for this tile's raw codes /
wait for V's ring slot / convert V and hand it over; bf16: wait K slot / copy K / wait V slot / copy V) and
each consumer warpgroup's first warp (wait K / S wgmma / softmax / wait V / PV issue / rest), plus, for FP8,
the V hand-over slack (cycles between the producer's V arrive and the consumer reaching its V wait; negative:
the consumer waited), and the warpgroups' spread at their V waits (0: in lock-step). Timestamps, JSON and the
raw arrays ([block, warp, iteration, event] clock64) go to --out.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np


def traced_build() -> None:
    """Compile every later kernel of this process with CUKV_TRACE=1 (a compile define, part of the cache key)."""
    import os

    os.environ["CUKV_DEFINES"] = (os.environ.get("CUKV_DEFINES", "") + " CUKV_TRACE=1").strip()


# cukv_trace's shape: kTraceBlocks, kTraceWarps, kTraceIters, kTraceEvents in templates/debug.cuh
TRACE_SHAPE = (8, 16, 128, 8)

# (phase, from event, to event) per role; the events are the trace_mark calls in templates/prefill.cuh
PHASES = {
    "fp8_producer": [("issue next", 0, 1), ("wait raw", 1, 2), ("wait slot", 2, 3), ("convert", 3, 4)],
    "bf16_producer": [("wait K slot", 0, 1), ("copy K", 1, 2), ("wait V slot", 2, 3), ("copy V", 3, 4)],
    "consumer": [("wait K", 0, 1), ("S wgmma", 1, 2), ("softmax", 2, 3), ("wait V", 3, 4), ("PV issue", 4, 5)],
}


def summarize(tr, n_iters, fp8, wgs):
    """tr: [blocks, warps, iters, events] clock64 (0 = not written)."""
    out = {}
    for blk in range(tr.shape[0]):
        n = int((tr[blk, 0, :, 0] != 0).sum())
        if n < 12:
            continue
        lo, hi = 4, min(n, n_iters) - 4
        rows = {}
        p = tr[blk, 0, lo:hi + 1].astype(np.float64)
        names = PHASES["fp8_producer" if fp8 else "bf16_producer"]
        rows["producer"] = {"period": float(np.median(np.diff(p[:, 0])))}
        for nm, e0, e1 in names:
            rows["producer"][nm] = float(np.median(p[:-1, e1] - p[:-1, e0]))
        for wg in range(wgs):
            c = tr[blk, 4 + 4 * wg, lo:hi + 1].astype(np.float64)
            r = {"period": float(np.median(np.diff(c[:, 0])))}
            for nm, e0, e1 in PHASES["consumer"]:
                r[nm] = float(np.median(c[:-1, e1] - c[:-1, e0]))
            r["rest"] = float(np.median(c[1:, 0] - c[:-1, 5]))
            # V(t) handed over (producer ev 4 of iteration t) vs consumer reaching its V wait (ev 3)
            if fp8:  # (the bf16 producer's event 4 is its copies' issue, not their landing)
                r["V slack"] = float(np.median(c[:-1, 3] - p[:-1, 4]))
            rows[f"wg{wg}"] = r
        # spread of the warpgroups: how far apart they reach their V waits (0: in lock-step)
        v = np.stack([tr[blk, 4 + 4 * wg, lo:hi, 3] for wg in range(wgs)]).astype(np.float64)
        rows["producer"]["WG spread"] = float(np.median(v.max(0) - v.min(0)))
        out[blk] = {"tiles": n, "roles": rows}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4x4096x32x8x128", help="batch x L x hq x hkv x d")
    ap.add_argument("--gran", default="token", choices=["token", "tensor", "32", "64", "128"])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    traced_build()
    import cupy as cp

    import cukv
    from cukv.bench.prefill import DTYPE, PAGE_SIZE, _build, fp8_cache_like

    batch, seq_len, hq, hkv, d = map(int, args.shape.split("x"))
    data = _build(batch, seq_len, hq, hkv, d)
    q, _, _, cache, pt, offsets, lengths = data
    fcache = fp8_cache_like(data, args.gran if args.gran in ("token", "tensor") else int(args.gran))
    out = cp.empty_like(q)
    result = {"shape": args.shape}
    for label, kv_dtype in (("bf16", "bfloat16"), ("fp8", "fp8_e4m3")):
        if kv_dtype == "bfloat16":
            pf = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE)
            run = lambda: pf.run(q, (cache, pt), out=out)
        else:
            pf = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE, kv_dtype=kv_dtype,
                                   scale_granularity=fcache.scale_granularity)
            run = lambda: pf.run(q, (fcache, pt), out=out)
        pf.plan(offsets, lengths, mask="causal")
        cfg = pf.config
        buf = cfg.compiled.module().get_global("cukv_trace")
        arr = cp.ndarray(TRACE_SHAPE, cp.int64, buf)
        for _ in range(3):
            run()
        arr.fill(0)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        run()
        stop.record()
        stop.synchronize()
        ms = cp.cuda.get_elapsed_time(start, stop)
        tr = arr.get()
        np.save(Path(args.out) / f"trace_{label}.npy", tr)
        summ = summarize(tr, TRACE_SHAPE[2], label == "fp8", cfg.BM // 64)
        result[label] = {"config": cfg.name, "ms": ms, "blocks": summ}
        print(f"== {label} {cfg.name}: {ms:.3f} ms (traced)")
        for blk, b in list(summ.items())[:3]:
            print(f" block y={blk} tiles={b['tiles']}")
            for role, r in b["roles"].items():
                print(f"   {role:9s} " + "  ".join(f"{k} {v:.0f}" for k, v in r.items()))
    (Path(args.out) / "trace_prefill.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
