"""Digests and times of the prefill kernels on the bench shapes: bf16, and FP8 'auto' and 'fused' with token and
per-tensor scales. A change that should not move a single output bit (descriptor arithmetic, say) prints the same
digests under benchmarks/ab_macros.sh for both trees; the interleaved timings beside them say what it bought.

    OUT=$OUT PROBE=benchmarks/probe_digest.py bash benchmarks/ab_macros.sh @.ab_base ""
"""
import argparse
import hashlib

import cupy as cp

import cukv
from cukv.bench.prefill import DTYPE, PAGE_SIZE, fp8_cache_like
from cukv.bench.timing import Timer

from probe_lib import probe_cases, probe_report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4x4096x16x16x256")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    timer = Timer()
    for shape, (batch, seq_len, hq, hkv, d), data, fcache, out in probe_cases(args.shapes, "token"):
        q, k, v, cache, pt, offsets, lengths = data
        tcache = fp8_cache_like(data, "tensor")
        runs = {"bf16": (cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE), cache)}
        for gran, fc in (("token", fcache), ("tensor", tcache)):
            for strategy in ("auto", "fused"):
                runs[f"{gran} {strategy}"] = (
                    cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE, kv_dtype="fp8_e4m3",
                                      scale_granularity=gran, fp8_prefill=strategy), fc)
        fns, digests = {}, []
        for name, (pf, c) in runs.items():
            pf.plan(offsets, lengths, mask="causal")
            o = cp.full_like(q, 0x7FC0)  # NaN bits: every row must be written
            pf.run(q, (c, pt), out=o)
            cp.cuda.Device().synchronize()
            digests.append(f"{name} {hashlib.sha1(o.get().tobytes()).hexdigest()[:12]}")
            fns[name] = lambda pf=pf, c=c, o=o: pf.run(q, (c, pt), out=o)
        print(f"{shape} digests: " + ", ".join(digests), flush=True)
        probe_report(shape, timer, {n: fns[n] for n in ("bf16", "token auto", "tensor auto")}, args.rounds, digits=3)


if __name__ == "__main__":
    main()
