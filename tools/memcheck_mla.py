"""Hostile inputs for the MLA kernels, to run under compute-sanitizer (a GPU machine):

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/memcheck_mla.py

Sparse prefill with every kind of invalid index (-1, -2^31, num_rows, 2^31 - 1, uint32 values past 2^31) and cut
lists, over 16-bit and FP8 rows, with the narrow (16/32 heads) and the split (64 heads) consumers, and the
alternating ones over per-slice gathers (128 heads, 16-bit rows); dense decode
with garbage block-table entries past each row's used pages. Nothing may read or write out of bounds; the script
prints what it ran.
"""
import cupy as cp
import numpy as np

import cukv
from cukv.dtypes import to_storage


def hostile_indices(rng, t_n, topk, num_rows):
    idx = rng.integers(0, num_rows, (t_n, topk)).astype(np.int64)
    bad = np.array([-1, -2 ** 31, num_rows, 2 ** 31 - 1, num_rows + 7, -5])
    mask = rng.random((t_n, topk)) < 0.3
    idx[mask] = rng.choice(bad, int(mask.sum()))
    idx[0] = -1  # a token with no valid key
    return cp.asarray(idx.astype(np.int32))


def main():
    rng = np.random.default_rng(0)
    rows = to_storage(rng.standard_normal((700, 576)), "bfloat16")
    for kv_dtype in (None, "fp8_e4m3"):
        cache = cukv.MLAKVCache(num_pages=12, page_size=64, dtype=kv_dtype or "bfloat16", fill="nan")
        cukv.append_mla(cache, cp.asarray(rows[:, :512]), cp.asarray(rows[:, 512:]), cp.arange(700),
                        dtype="bfloat16")
        forms = [(16, None), (32, None), (64, None)] + ([(128, "alternate")] if kv_dtype is None else [])
        for heads, schedule in forms:
            t_n, topk = 5, 384
            q = cp.asarray(to_storage(rng.standard_normal((t_n, heads, 576)), "bfloat16"))
            idx = hostile_indices(rng, t_n, topk, 12 * 64)
            lens = cp.asarray(np.array([topk, 100, 0, 383, 257], np.int32))
            att = cukv.SparseMLA(heads, kv_dtype=kv_dtype, schedule=schedule).plan(t_n, topk)
            att.run(q, cache, idx, topk_lengths=lens)
            att.run(q, cache, idx.view(cp.uint32) | cp.uint32(2 ** 31))  # every key invalid
            print(f"sparse {att.config.name}: ok", flush=True)
    cache = cukv.MLAKVCache(num_pages=12, page_size=16, dtype="bfloat16", fill="nan")
    cukv.append_mla(cache, cp.asarray(rows[:150, :512]), cp.asarray(rows[:150, 512:]), cp.arange(150))
    table = np.full((3, 40), 2 ** 30, np.int32)  # garbage past each row's pages
    table[0, :6], table[1, :3] = np.arange(6), np.arange(6, 9)
    for heads, s_q in ((16, 1), (8, 4), (64, 1)):
        q = cp.asarray(to_storage(rng.standard_normal((3, s_q, heads, 576)), "bfloat16"))
        dec = cukv.BatchMLADecode(heads).plan([90, 40, 0], s_q)
        dec.run(q, cache, cp.asarray(table))
        print(f"decode {dec.config.name}: ok", flush=True)
    cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
