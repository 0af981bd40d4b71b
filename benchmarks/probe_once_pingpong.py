"""The 16-bit prefill and convert-once (token scales), each with S issued in warpgroup ring order
(``PrefillConfig.pingpong``) and without, in interleaved rounds on causal bench shapes (batch x L x hq x hkv x d).
It backs the d256 ring-order default (``cukv.policy.prefill.PINGPONG_16BIT``; docs/tuning.md).

    PYTHONPATH=. python3 benchmarks/probe_once_pingpong.py 4x4096x16x16x256,8x2048x32x32x128 15
"""
import dataclasses
import sys

import cupy as cp

import cukv
from cukv.bench.prefill import DTYPE, PAGE_SIZE
from cukv.bench.timing import Timer
from cukv.policy.prefill import default_config, once_config

from probe_lib import probe_cases, probe_report


def main(shapes: str, rounds: int) -> None:
    timer = Timer()
    for shape, (batch, seq_len, hq, hkv, d), data, fcache, out in probe_cases(shapes, "token"):
        q, k, v, cache, pt, offsets, lengths = data
        fns = {}
        for name, pp in (("bf16", False), ("bf16_pp", True)):
            cfg = dataclasses.replace(default_config(DTYPE, d, PAGE_SIZE), pingpong=pp)
            bf = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE, config=cfg).plan(offsets, lengths,
                                                                                                   mask="causal")
            bf.run(q, (cache, pt), out=out)
            fns[name] = lambda bf=bf: bf.run(q, (cache, pt), out=out)
        for name, pp in (("once", False), ("once_pp", True)):
            cfg = dataclasses.replace(once_config(DTYPE, d, PAGE_SIZE, "fp8_e4m3", d), pingpong=pp)
            pf = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE, kv_dtype="fp8_e4m3",
                                   scale_granularity="token", config=cfg,
                                   fp8_prefill="convert_once").plan(offsets, lengths, mask="causal")
            pf.run(q, (fcache, pt), out=out)
            fns[name] = lambda pf=pf: pf.run(q, (fcache, pt), out=out)
        cp.cuda.Device().synchronize()
        probe_report(shape, timer, fns, rounds, digits=3)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "4x4096x16x16x256,2x8192x16x16x256",
         int(sys.argv[2]) if len(sys.argv) > 2 else 9)
