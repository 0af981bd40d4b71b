"""A decode loop over a paged KV cache, checked against the float64 reference at every step.

Builds a bf16 cache (pages handed out in shuffled order, every slot poisoned with NaN first), appends
prompts of different lengths, then runs decode steps: append the new token's K/V, attend, compare.
Without a GPU it says so, compiles the kernels to cubins (proving the toolchain) and runs the reference path.
"""
import sys
import time

import numpy as np

import cukv
from cukv import reference
from cukv.device import has_gpu
from cukv.policy.decode import decode_config

B, HQ, HKV, D, PAGE = 4, 32, 8, 128, 16
PROMPTS = [37, 300, 1, 1024]
STEPS = 8
rng = np.random.default_rng(0)

if not has_gpu():
    print("No CUDA GPU is visible: compiling the kernels and running the NumPy reference path only.")
    for cfg in (decode_config("bfloat16", D, HQ // HKV, PAGE), cukv.AppendConfig("bfloat16", D, PAGE)):
        m = cfg.compiled
        r = m.functions[cfg.name]
        print(f"  {cfg.name}: {r.registers} registers, {r.spills} spill bytes, "
              f"{'cache hit' if m.cache_hit else f'compiled in {m.compile_seconds:.2f} s'}")
    # the reference decode of one step over a tiny paged cache
    k_pages = rng.standard_normal((8, PAGE, HKV, D))
    v_pages = rng.standard_normal((8, PAGE, HKV, D))
    table = np.array([[3, 1, 6], [0, 2, 7]])
    out, lse = reference.decode(rng.standard_normal((2, HQ, D)), k_pages, v_pages, table, np.array([40, 20]))
    print(f"  reference decode: out {out.shape}, lse {lse.shape}, finite: {bool(np.isfinite(out).all())}")
    print("decode_loop: OK (reference path; run on a GPU machine for the kernels)")
    sys.exit(0)

import cupy as cp  # noqa: E402

from cukv.dtypes import from_storage, to_storage  # noqa: E402
from cukv.testing import assert_close  # noqa: E402

cache = cukv.PagedKVCache(num_pages=512, page_size=PAGE, num_kv_heads=HKV, head_dim=D, fill="nan")
alloc = cukv.PageAllocator(cache.num_pages, order="random", seed=0)  # pages in random physical order
seqs = cukv.SequenceTable(cache, max_batch=B, max_pages_per_seq=128, allocator=alloc)

# host float64 mirror of every token appended, for the reference
hist_k = [np.zeros((0, HKV, D)) for _ in range(B)]
hist_v = [np.zeros((0, HKV, D)) for _ in range(B)]


def append(counts):
    slots = seqs.extend(counts)
    n = int(sum(counts))
    k = to_storage(rng.standard_normal((n, HKV, D)), "bfloat16")
    v = to_storage(rng.standard_normal((n, HKV, D)), "bfloat16")
    cukv.append_kv(cache, cp.asarray(k), cp.asarray(v), cp.asarray(slots))
    at = 0
    for b, c in enumerate(counts):
        hist_k[b] = np.concatenate([hist_k[b], from_storage(k[at: at + c], "bfloat16")])
        hist_v[b] = np.concatenate([hist_v[b], from_storage(v[at: at + c], "bfloat16")])
        at += c


append(PROMPTS)
dec = cukv.BatchDecode(HQ, HKV, D, PAGE, "bfloat16").plan(batch_size=B, max_kv_len=max(PROMPTS) + STEPS)
times = []
for step in range(STEPS):
    append([1] * B)                       # the new token's K/V goes in first ...
    q_host = to_storage(rng.standard_normal((B, HQ, D)), "bfloat16")
    table = seqs.page_table()
    start = cp.cuda.Event(); end = cp.cuda.Event()
    start.record()
    out, lse = dec.run(cp.asarray(q_host), cache, table, return_lse=True)   # ... then attention
    end.record(); end.synchronize()
    times.append(cp.cuda.get_elapsed_time(start, end))
    q = from_storage(q_host, "bfloat16")
    for b in range(B):
        n = len(hist_k[b])
        ro, rl = reference.attention(q[b: b + 1], hist_k[b], hist_v[b], [n - 1])
        assert_close(from_storage(out[b].get(), "bfloat16"), ro[0], "bfloat16", name=f"step {step} seq {b}")
        assert_close(lse[b].get(), rl[0], "float32", atol=2e-3, rtol=2e-3, name=f"lse step {step} seq {b}")
    print(f"step {step}: lengths {seqs.lengths.tolist()}  decode {times[-1] * 1e3:.1f} us  matches reference")
print(f"decode_loop: OK ({STEPS} steps, median {np.median(times) * 1e3:.1f} us per step incl. launch)")
