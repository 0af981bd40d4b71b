"""convert_once on the persistent grid against the launch-per-item kernel, bit for bit over six runs each, and its
workspace against the cache's dequantized values, at every scale granularity and with edge values (K scales past 2^8
on some tokens, a NaN code in V).
PYTHONPATH=. python3 benchmarks/check_once_workspace.py [head_dim [granularity]]"""
import sys

import cupy as cp
import numpy as np

import cukv
from cukv.testing import random_prefill_case


def _nan(x):  # bf16 bits that are a NaN (the dequantize pass and the converters may spell it differently)
    x = x.view(np.uint16)
    return ((x & 0x7F80) == 0x7F80) & ((x & 0x7F) != 0)


rng = np.random.default_rng(1)
D = int(sys.argv[1]) if len(sys.argv) > 1 else 128
GRAN = sys.argv[2] if len(sys.argv) > 2 else "token"
GRAN = int(GRAN) if GRAN.isdigit() else GRAN
for grid in (None, 5):
    case = random_prefill_case(rng, q_lens=[1500, 1, 700, 33, 129], cache_lens=[0, 0, 300, 0, 70], num_qo_heads=16,
                               num_kv_heads=16, head_dim=D, page_size=16, dtype="bfloat16", kv_dtype="fp8_e4m3",
                               scale_granularity=GRAN)
    c, bt = case["cache"], case["block_table"]
    # edge values on live tokens: scales whose product with 2^120 overflows float32, and one NaN code
    for b, j in ((0, 3), (0, 1000), (2, 50), (4, 198)) if GRAN != "tensor" else ():
        c.k_scales[int(bt[b, j // 16]), j % 16] *= 2.0 ** 17  # token scales ~0.007: past 2^8
    c.v[int(bt[0, 7 // 16]), 7 % 16, 3, 5] = 0x7F
    kv = (case["cache"], case["table"])
    outs = {}
    for pers in (False, True):
        try:
            pf = cukv.BatchPrefill(16, 16, D, 16, kv_dtype="fp8_e4m3", scale_granularity=GRAN,
                                   fp8_prefill="convert_once", once_persistent=pers,
                                   max_blocks=grid).plan(case["q_offsets"], case["kv_lens"])
        except ValueError as e:  # 32- and 64-dim blocks at d256 fit the persistent kernel only
            print(f"persistent {pers}: {e}")
            continue
        runs = []
        for r in range(6):
            out = cp.full(case["q"].shape, 0x7FC0, case["q"].dtype)
            pf.run(case["q"], kv, out=out)
            runs.append(out.get())
        outs[pers] = (pf, runs)
    ref = outs[min(outs)][1][0]
    for pers in outs:
        for r, o in enumerate(outs[pers][1]):
            bad = np.argwhere(o.view(np.uint16) != ref.view(np.uint16))
            print(f"grid {grid} persistent {pers} run {r}: {len(bad)} differ", bad[:6].tolist(), flush=True)
    # the persistent workspace against the cache's dequantized values
    pf = outs[True][0]
    if GRAN == "tensor":  # per-tensor scales: the workspace holds the codes' exact values
        c.set_tensor_scales(1.0, 1.0)
    dk, dv = case["cache"].dequantize()
    dk, dv = dk.get(), dv.get()
    bt = case["block_table"]
    plan = pf._plan  # the ConvertOncePlan: its workspace
    offs = plan.offsets.get()
    for name, ws, dq in (("k", plan.k.get(), dk), ("v", plan.v.get(), dv)):
        nbad = 0
        for b, L in enumerate(case["kv_lens"]):
            j = np.arange(L)
            want = dq[bt[b, j // 16], j % 16]
            got = ws[offs[b]:offs[b] + L]
            bad = np.argwhere((got.view(np.uint16) != want.view(np.uint16)) & ~(_nan(got) & _nan(want)))
            pad = ws[offs[b] + L:offs[b + 1]]
            nbad += len(bad)
            if len(bad) or np.any(pad != 0):
                print(f"  ws {name} seq {b}: {len(bad)} differ {bad[:4].tolist()}, pad nonzero {int(np.sum(pad != 0))}")
        print(f"grid {grid} workspace {name}: {nbad} differ", flush=True)
