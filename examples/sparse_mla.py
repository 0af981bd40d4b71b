"""Sparse MLA (DeepSeek-V3.2 / GLM-5 DSA) over a paged latent cache, checked against the float64 reference.

An indexer scores every cached token for each new query token and keeps the top-k; attention then runs in the
absorbed MLA form (576 / 512) over just those rows. cukv takes each pick as a cache row number ``page * page_size
+ offset``: :func:`cukv.sparse_indices` converts per-request token positions through the page table. Picks the
indexer leaves empty are -1 (skipped), and ``topk_lengths`` stops a list early.

Two checks: the sparse decode against the reference, and the identity that a list holding every position of a
request is the dense absorbed MLA decode (:func:`cukv.mla_decode`). Without a GPU it says so, compiles the kernel
(proving the toolchain) and checks the identity on the float64 reference.
"""
import numpy as np

import cukv
from cukv import reference
from cukv.device import has_gpu
from cukv.dtypes import from_storage, to_storage

GPU = has_gpu()
DTYPE, PAGE = "bfloat16", 64
H, S_Q, TOPK = (16, 2, 256) if GPU else (2, 1, 8)
LENS = [1000, 300] if GPU else [40, 12]
rng = np.random.default_rng(0)
B = len(LENS)

# ---- pages: each request's tokens in shuffled pages
pages = [-(-n // PAGE) for n in LENS]
ids = rng.permutation(sum(pages) + 1).astype(np.int32)
table = np.full((B, max(pages)), -1, np.int32)
slots = []
for b in range(B):
    table[b, :pages[b]] = ids[sum(pages[:b]):sum(pages[:b + 1])]
    pos = np.arange(LENS[b])
    slots.append(table[b, pos // PAGE].astype(np.int64) * PAGE + pos % PAGE)
slots = np.concatenate(slots)
rows_s = to_storage(rng.standard_normal((len(slots), 576)), DTYPE)
q_s = to_storage(rng.standard_normal((B, S_Q, H, 576)), DTYPE)

# ---- the indexer: per query token, the TOPK best-scoring positions of its request (fewer where it is short)
positions = np.full((B, S_Q, TOPK), -1, np.int64)
for b in range(B):
    score = rng.standard_normal((S_Q, LENS[b]))
    k = min(TOPK, LENS[b])
    positions[b, :, :k] = np.argsort(-score, axis=1)[:, :k]
indices = cukv.sparse_indices(positions, table, PAGE)  # int32 [B, S_Q, TOPK], -1 where empty
lengths = np.array([TOPK, TOPK // 2], np.int32)        # request 1 reads the first half of each list only

print(f"{B} requests of {LENS} cached tokens, {S_Q} new tokens each, {H} heads, top-{TOPK}, page {PAGE}")
flat_rows = np.full((int(table.max() + 1) * PAGE, 576), np.nan)  # the cache as rows; NaN where never written
flat_rows[slots] = from_storage(rows_s, DTYPE)
want, want_lse, want_max = reference.sparse_mla(from_storage(q_s, DTYPE).reshape(B * S_Q, H, 576), flat_rows,
                                                indices.reshape(B * S_Q, TOPK), np.repeat(lengths, S_Q))

if not GPU:
    from cukv.configs.sparse_mla import SparseMLAConfig

    print("No CUDA GPU is visible: compiling the kernel and checking sparse (every position) == dense MLA decode on "
          "the float64 reference only (the kernels run on a GPU machine).")
    cfg = SparseMLAConfig(DTYPE)
    r = cfg.compiled.functions[cfg.name]
    print(f"  {cfg.name}: {r.registers} registers, {r.spills} spill bytes")
    q = from_storage(q_s, DTYPE)
    every = np.full((B, S_Q, max(LENS)), -1, np.int64)
    for b in range(B):
        every[b, :, :LENS[b]] = np.arange(LENS[b])
    idx = cukv.sparse_indices(every, table, PAGE)
    sparse, _, _ = reference.sparse_mla(q.reshape(B * S_Q, H, 576), np.nan_to_num(flat_rows),
                                        idx.reshape(B * S_Q, -1))
    pages3 = np.nan_to_num(flat_rows).reshape(-1, PAGE, 576)
    dense, _ = reference.mla_decode(q[:, -1:], pages3, np.maximum(table, 0), LENS)  # the last token sees all
    assert np.allclose(sparse.reshape(B, S_Q, H, 512)[:, -1], dense[:, 0])
    print("OK (reference only: no GPU)")
else:
    import cupy as cp

    from cukv.testing import assert_close

    cache = cukv.MLAKVCache(len(ids), PAGE, DTYPE, fill="nan")  # NaN in every unused slot: never read
    cukv.append_mla(cache, cp.asarray(rows_s[:, :512]), cp.asarray(rows_s[:, 512:]), cp.asarray(slots))
    out, lse, max_logits = cukv.sparse_mla_decode(cp.asarray(q_s), cache, cp.asarray(indices),
                                                  topk_lengths=cp.asarray(lengths))
    err = assert_close(from_storage(out.get(), DTYPE).reshape(want.shape), want, DTYPE)
    assert_close(lse.get().reshape(want_lse.shape), want_lse, "float32", atol=3e-3, rtol=1e-4, name="lse")
    assert_close(max_logits.get().reshape(want_max.shape), want_max, "float32", atol=3e-3, rtol=1e-4,
                 name="max_logits")
    print(f"  sparse decode: relative error {err:.1e} against the float64 reference")

    # every position of each request, for the last new token: the dense absorbed MLA decode
    every = np.full((B, 1, max(LENS)), -1, np.int64)
    for b in range(B):
        every[b, 0, :LENS[b]] = np.arange(LENS[b])
    idx = cp.asarray(cukv.sparse_indices(every, table, PAGE))
    q_last = cp.ascontiguousarray(cp.asarray(q_s)[:, -1:])
    sparse, _, _ = cukv.sparse_mla_decode(q_last, cache, idx)
    dense = cukv.mla_decode(q_last, cache, cp.asarray(np.maximum(table, 0)), LENS)
    diff = float(np.abs(from_storage(sparse.get(), DTYPE) - from_storage(dense.get(), DTYPE)).max())
    print(f"  every position == dense MLA decode: max |difference| {diff:.1e}")
    assert diff < 2e-2
    print("OK")
