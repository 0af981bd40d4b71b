"""Shared-prefix (cascade) attention, checked against one-shot attention and the float64 reference.

B sequences share a long prefix (a system prompt) and each has a suffix of its own, the last q_len tokens
of which are new this step. Cascade attention computes
  1. every query against the shared prefix once, from contiguous K/V, with no mask (all queries come after it),
  2. each sequence's queries against its own suffix in the paged cache, causal (bottom-right aligned),
and merges the two by their LSE (cukv.merge_states). That must equal one-shot causal attention over
prefix + suffix, which the paged cache can also do directly: the prefix pages are shared by every
sequence's page table, stored once.

Without a GPU it says so, compiles the merge kernel to a cubin (proving the toolchain) and checks the same
identity on the float64 reference.
"""
import sys
import time

import numpy as np

import cukv
from cukv import reference
from cukv.device import has_gpu
from cukv.dtypes import from_storage, to_storage
from cukv.configs.merge import MergeConfig

GPU = has_gpu()
DTYPE = "bfloat16"
PAGE = 16
if GPU:
    HQ, HKV, D, PREFIX, B, MAX_SUFFIX = 16, 4, 128, 1024, 8, 256
else:  # small enough for the float64 reference to run in a blink
    HQ, HKV, D, PREFIX, B, MAX_SUFFIX = 8, 2, 64, 128, 4, 40
assert PREFIX % PAGE == 0, "the prefix fills whole pages, so every sequence can share them"
rng = np.random.default_rng(0)


def rounded(shape):
    """Random values as the cache stores them (bf16), returned as storage and as float64."""
    s = to_storage(rng.standard_normal(shape).astype(np.float32), DTYPE)
    return s, from_storage(s, DTYPE)


# ---- the batch: a shared prefix, one suffix per sequence, the suffix's last q_len tokens are this step's queries
suffix_lens = rng.integers(MAX_SUFFIX // 4, MAX_SUFFIX + 1, size=B)
q_lens = np.array([rng.integers(1, n + 1) for n in suffix_lens])
q_offsets = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
total_q = int(q_offsets[-1])
k_pre_s, k_pre = rounded((PREFIX, HKV, D))
v_pre_s, v_pre = rounded((PREFIX, HKV, D))
k_suf_s, k_suf = rounded((int(suffix_lens.sum()), HKV, D))
v_suf_s, v_suf = rounded((int(suffix_lens.sum()), HKV, D))
q_s, q = rounded((total_q, HQ, D))

# ---- pages: the prefix's pages once, then each suffix's, all in shuffled physical order
prefix_pages = PREFIX // PAGE
suffix_pages = -(-suffix_lens // PAGE)
num_pages = prefix_pages + int(suffix_pages.sum()) + 2
ids = rng.permutation(num_pages).astype(np.int32)
pre_ids, cur = ids[:prefix_pages], prefix_pages
suffix_table = np.zeros((B, int(suffix_pages.max())), np.int32)
for b in range(B):
    suffix_table[b, : suffix_pages[b]] = ids[cur: cur + suffix_pages[b]]
    cur += suffix_pages[b]
full_table = np.concatenate([np.tile(pre_ids, (B, 1)), suffix_table], axis=1)  # prefix pages shared by all
full_lens = (PREFIX + suffix_lens).astype(np.int32)


def slots_of(table_row, n):
    pos = np.arange(n)
    return table_row[pos // PAGE].astype(np.int64) * PAGE + pos % PAGE


pre_slots = slots_of(pre_ids, PREFIX)
suf_slots = np.concatenate([slots_of(suffix_table[b], int(suffix_lens[b])) for b in range(B)])

# host mirror of the paged cache (NaN where nothing was written) for the reference
k_pages = np.full((num_pages, PAGE, HKV, D), np.nan)
v_pages = np.full((num_pages, PAGE, HKV, D), np.nan)
reference.append(k_pages, v_pages, np.concatenate([k_pre, k_suf]), np.concatenate([v_pre, v_suf]),
                 np.concatenate([pre_slots, suf_slots]))

# the answer: one-shot causal attention of each sequence over prefix + suffix
t0 = time.perf_counter()
want_o, want_lse = reference.prefill_paged(q, q_offsets, k_pages, v_pages, full_table, full_lens, mask="causal")
print(f"{B} sequences share a {PREFIX}-token prefix; suffixes {suffix_lens.tolist()}, new tokens {q_lens.tolist()} "
      f"({total_q} queries, {HQ} query heads / {HKV} KV heads, head_dim {D}); "
      f"reference in {time.perf_counter() - t0:.1f} s")

if not GPU:
    print("No CUDA GPU is visible: compiling the merge kernel and checking the cascade identity on the float64 "
          "reference only (the prefill and merge kernels run on a GPU machine).")
    cfg = MergeConfig(DTYPE, D)
    m = cfg.compiled
    r = m.functions[cfg.name]
    print(f"  {cfg.name}: {r.registers} registers, {r.spills} spill bytes, "
          f"{'cache hit' if m.cache_hit else f'compiled in {m.compile_seconds:.2f} s'}")
    # 1. every query against the shared prefix: one sequence of all queries, no mask
    pre_o, pre_lse = reference.prefill_contiguous(q, [0, total_q], k_pre, v_pre, [0, PREFIX], mask="none")
    # 2. each sequence against its own suffix, causal
    suf_o, suf_lse = reference.prefill_paged(q, q_offsets, k_pages, v_pages, suffix_table, suffix_lens, mask="causal")
    # 3. merge by LSE
    o, lse = reference.merge_states([pre_o, suf_o], [pre_lse, suf_lse])
    np.testing.assert_allclose(o, want_o, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-9, atol=1e-12)
    print(f"  cascade (prefix + suffix, merged) == one-shot: max |diff| {np.abs(o - want_o).max():.2e}")
    print("cascade_prefix: OK (reference path; run on a GPU machine for the kernels)")
    sys.exit(0)

import cupy as cp  # noqa: E402

from cukv.ops.merge import merge_states  # noqa: E402
from cukv.testing import assert_close  # noqa: E402

cache = cukv.PagedKVCache(num_pages, PAGE, HKV, D, dtype=DTYPE, fill="nan")
cukv.append_kv(cache, cp.asarray(np.concatenate([k_pre_s, k_suf_s])), cp.asarray(np.concatenate([v_pre_s, v_suf_s])),
               cp.asarray(np.concatenate([pre_slots, suf_slots])))
qd = cp.asarray(q_s)
k_pre_d, v_pre_d = cp.asarray(k_pre_s), cp.asarray(v_pre_s)
suffix_pt = cukv.PageTable(cp.asarray(suffix_table), cp.asarray(suffix_lens.astype(np.int32)), PAGE)
full_pt = cukv.PageTable(cp.asarray(np.ascontiguousarray(full_table)), cp.asarray(full_lens), PAGE)

pf_prefix = cukv.BatchPrefill(HQ, HKV, D, page_size=None, dtype=DTYPE)           # contiguous K/V
pf_prefix.plan(np.array([0, total_q], np.int32), np.array([PREFIX], np.int32), mask="none")
prefix_kv = (k_pre_d, v_pre_d, cp.asarray(np.array([0, PREFIX], np.int32)))
pf_suffix = cukv.BatchPrefill(HQ, HKV, D, page_size=PAGE, dtype=DTYPE)
pf_suffix.plan(q_offsets, suffix_lens.astype(np.int32), mask="causal")
pf_full = cukv.BatchPrefill(HQ, HKV, D, page_size=PAGE, dtype=DTYPE)
pf_full.plan(q_offsets, full_lens, mask="causal")


def cascade():
    o1, l1 = pf_prefix.run(qd, prefix_kv, return_lse=True)
    o2, l2 = pf_suffix.run(qd, (cache, suffix_pt), return_lse=True)
    return merge_states(o1, l1, o2, l2)


def one_shot():
    return pf_full.run(qd, (cache, full_pt), return_lse=True)


def timed(fn, reps=20):
    fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / reps


o, lse = cascade()
of, lsef = one_shot()
for name, (out, l) in (("cascade", (o, lse)), ("one-shot", (of, lsef))):
    assert_close(from_storage(out.get(), DTYPE), want_o, DTYPE, name=f"{name} output")
    assert_close(l.get(), want_lse, "float32", atol=2e-3, rtol=2e-3, name=f"{name} lse")
    print(f"  {name}: matches the float64 reference")
t_c, t_o = timed(cascade), timed(one_shot)
print(f"  cascade {t_c * 1e3:.1f} us (prefix once + suffixes + merge) vs one-shot {t_o * 1e3:.1f} us")
print(f"cascade_prefix: OK ({B} sequences, {PREFIX}-token shared prefix, {total_q} queries)")
