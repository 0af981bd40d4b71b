"""Chunked prefill over a long cached prefix: bf16 cache beside the same tokens in FP8 (token and per-tensor scales),
interleaved rounds (medians). A shape is batch x q_len x kv_len x hq x hkv x d; the queries are each sequence's last
q_len positions (causal), so the kernel reads the whole prefix and its work is q_len x kv_len per head.

    PYTHONPATH=. python3 benchmarks/probe_prefill_prefix.py --shapes 8x256x32768x32x8x128

The bench shapes (q_len = kv_len) are compute-bound, where FP8's staging work costs time; here the K/V bytes read
grow with kv_len and the work per byte with q_len, which shows where FP8's halved bytes start to pay.
"""
import argparse

import cupy as cp
import numpy as np

import cukv
from cukv.bench.decode import interleaved_medians
from cukv.bench.prefill import DTYPE, PAGE_SIZE, _bits, _build, fp8_cache_like
from cukv.bench.timing import Timer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x128x32768x32x8x128,8x512x32768x32x8x128,8x2048x32768x32x8x128")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    timer = Timer()
    print("shape: bf16 ms | FP8 token ms (bf16/FP8) | FP8 tensor ms (bf16/FP8)")
    for shape in args.shapes.split(","):
        batch, q_len, kv_len, hq, hkv, d = map(int, shape.split("x"))
        data = _build(batch, kv_len, hq, hkv, d)
        cache, pt, lengths = data[3], data[4], data[6]
        q = _bits(cp.random.RandomState(1), (batch * q_len, hq, d))  # the last q_len positions of each sequence
        offsets = (np.arange(batch + 1) * q_len).astype(np.int32)
        out = cp.empty_like(q)
        fns = {}
        bf = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE).plan(offsets, lengths, mask="causal")
        fns["bf16"] = lambda: bf.run(q, (cache, pt), out=out)
        for gran in ("token", "tensor"):
            fc = fp8_cache_like(data, gran)
            pf = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE, kv_dtype="fp8_e4m3",
                                   scale_granularity=gran).plan(offsets, lengths, mask="causal")
            fns[gran] = (lambda pf=pf, fc=fc: pf.run(q, (fc, pt), out=out))
        got = interleaved_medians(timer, fns, reps=5 * args.rounds, rounds=args.rounds)
        b = got["bf16"]
        print(f"{shape}: {b:.3f} | {got['token']:.3f} ({b / got['token']:.2f}) | "
              f"{got['tensor']:.3f} ({b / got['tensor']:.2f})", flush=True)
        fns.clear()
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
