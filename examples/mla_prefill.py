"""MLA prefill over a cached prefix (DeepSeek-V2/V3, Kimi K2), checked against the float64 reference.

Each token's latent row (512 ``kv_c`` + 64 rope ``k_pe``) lives in a paged :class:`cukv.MLAKVCache`. For a
prefill the caller up-projects the latent rows into per-head ``k_nope`` and ``v`` (``kv_c @ W_UK``, ``kv_c @
W_UV``: plain matmuls); the rope part of every key is read by the kernel straight from the cache's columns
512..575, once per tile for all heads. Two ways to attend the new tokens to prefix + themselves:

  1. one shot: ``kv_lengths`` counts the cached prefix and the new tokens, the causal mask is bottom-right
     aligned (query i of a sequence sits at ``kv_len - q_len + i``);
  2. chunked context (vLLM's way): the new tokens against the prefix with no mask, then against themselves
     (causal, here with a contiguous ``k_rope``), merged by LSE with :func:`cukv.merge_states`.

Both must equal the reference. Without a GPU it says so, compiles the kernel (proving the toolchain) and checks
the same identity on the float64 reference.
"""
import sys

import numpy as np

import cukv
from cukv import reference
from cukv.device import has_gpu
from cukv.dtypes import from_storage, to_storage

GPU = has_gpu()
DTYPE, PAGE, LATENT, ROPE = "bfloat16", 64, 512, 64
if GPU:
    H, PREFIX, NEW = 16, [1000, 3000], [300, 17]
else:  # small enough for the float64 reference to run in a blink
    H, PREFIX, NEW = 2, [70, 5], [9, 1]
rng = np.random.default_rng(0)
B = len(PREFIX)
kv_lens = np.add(PREFIX, NEW)
q_offsets = np.r_[0, np.cumsum(NEW)]
kv_offsets = np.r_[0, np.cumsum(kv_lens)]


def rounded(shape, scale=1.0):
    """Random bf16 values: (storage, float64)."""
    s = to_storage(rng.standard_normal(shape) * scale, DTYPE)
    return s, from_storage(s, DTYPE)


# ---- the latent rows of every token (prefix + new), and the model's up-projections
kv_c_s, kv_c = rounded((int(kv_lens.sum()), LATENT))
k_pe_s, k_pe = rounded((int(kv_lens.sum()), ROPE))
w_uk_s, w_uk = rounded((LATENT, H * 128), LATENT ** -0.5)
w_uv_s, w_uv = rounded((LATENT, H * 128), LATENT ** -0.5)
q_s, q = rounded((int(q_offsets[-1]), H, 192))

# ---- pages: each sequence's tokens in shuffled pages, slot = page * PAGE + offset
pages = -(-kv_lens // PAGE)
ids = rng.permutation(int(pages.sum()) + 2).astype(np.int32)
table = np.zeros((B, int(pages.max())), np.int32)
slots = []
for b in range(B):
    table[b, : pages[b]] = ids[pages[:b].sum(): pages[:b + 1].sum()]
    pos = np.arange(kv_lens[b])
    slots.append(table[b, pos // PAGE].astype(np.int64) * PAGE + pos % PAGE)
slots = np.concatenate(slots)

print(f"{B} sequences: cached prefixes {list(PREFIX)}, new tokens {list(NEW)}, {H} heads (192/128), page {PAGE}")

if not GPU:
    from cukv.policy.mla_prefill import default_config

    # the answer, on the bf16-rounded up-projections a kernel would see
    k_nope = from_storage(to_storage((kv_c @ w_uk).reshape(-1, H, 128), DTYPE), DTYPE)
    v = from_storage(to_storage((kv_c @ w_uv).reshape(-1, H, 128), DTYPE), DTYPE)
    want, want_lse = reference.mla_prefill(q, q_offsets, k_nope, v, k_pe, kv_offsets, mask="causal")

    print("No CUDA GPU is visible: compiling the kernel and checking one-shot == chunked on the float64 reference "
          "only (the kernels run on a GPU machine).")
    cfg = default_config(DTYPE, PAGE)
    m = cfg.compiled
    r = m.functions[cfg.name]
    print(f"  {cfg.name}: {r.registers} registers, {r.spills} spill bytes")
    new_rows = np.concatenate([np.arange(kv_offsets[b] + PREFIX[b], kv_offsets[b + 1]) for b in range(B)])
    old_rows = np.concatenate([np.arange(kv_offsets[b], kv_offsets[b] + PREFIX[b]) for b in range(B)])
    po = np.r_[0, np.cumsum(PREFIX)]
    o1, l1 = reference.mla_prefill(q, q_offsets, k_nope[old_rows], v[old_rows], k_pe[old_rows], po, mask="none")
    o2, l2 = reference.mla_prefill(q, q_offsets, k_nope[new_rows], v[new_rows], k_pe[new_rows], q_offsets)
    o, lse = reference.merge_states([o1, o2], [l1, l2])
    np.testing.assert_allclose(o, want, rtol=1e-9, atol=1e-12)
    print(f"  chunked (prefix, then new tokens, merged) == one shot: max |diff| {np.abs(o - want).max():.2e}")
    print("mla_prefill: OK (reference path; run on a GPU machine for the kernels)")
    sys.exit(0)

import cupy as cp  # noqa: E402

from cukv.testing import assert_close  # noqa: E402


def bf16_dev(x):
    """float32 device array -> bf16 bits, round to nearest even (as the reference's to_storage)."""
    u = cp.ascontiguousarray(x, dtype=cp.float32).view(cp.uint32).astype(cp.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)


def f32_dev(bits):
    return (bits.astype(cp.uint32) << 16).view(cp.float32)


cache = cukv.MLAKVCache(int(pages.sum()) + 2, PAGE, dtype=DTYPE, fill="nan")   # NaN in unused slots: never read
kv_c_d = cp.asarray(kv_c_s)
cukv.append_mla(cache, kv_c_d, cp.asarray(k_pe_s), cp.asarray(slots))
# the up-projection, on the device (float32 matmuls, rounded to bf16 once)
k_nope_d = bf16_dev(f32_dev(kv_c_d) @ f32_dev(cp.asarray(w_uk_s))).reshape(-1, H, 128)
v_d = bf16_dev(f32_dev(kv_c_d) @ f32_dev(cp.asarray(w_uv_s))).reshape(-1, H, 128)
# the answer, on the bf16-rounded up-projections the kernel sees
k_nope = from_storage(k_nope_d.get(), DTYPE)
v = from_storage(v_d.get(), DTYPE)
want, want_lse = reference.mla_prefill(q, q_offsets, k_nope, v, k_pe, kv_offsets, mask="causal")
qd, table_d = cp.asarray(q_s), cp.asarray(table)

# 1. one shot over prefix + new tokens, rope from the cache
one = cukv.BatchMLAPrefill(H, page_size=PAGE).plan(q_offsets, kv_lens, mask="causal")
out, lse = one.run(qd, k_nope_d, v_d, cache=cache, block_table=table_d, return_lse=True)
assert_close(from_storage(out.get(), DTYPE), want, DTYPE, name="one-shot output")
assert_close(lse.get(), want_lse, "float32", atol=2e-3, rtol=2e-3, name="one-shot lse")
print("  one shot (prefix + new tokens, causal): matches the float64 reference")

# 2. chunked: the prefix (no mask; the first PREFIX[b] keys of each sequence, rope from the cache) ...
prefix_rows = cp.asarray(np.concatenate([np.arange(kv_offsets[b], kv_offsets[b] + PREFIX[b]) for b in range(B)]))
new_rows = cp.asarray(np.concatenate([np.arange(kv_offsets[b] + PREFIX[b], kv_offsets[b + 1]) for b in range(B)]))
ctx = cukv.BatchMLAPrefill(H, page_size=PAGE).plan(q_offsets, PREFIX, mask="none")
o1, l1 = ctx.run(qd, k_nope_d[prefix_rows], v_d[prefix_rows], cache=cache, block_table=table_d, return_lse=True)
# ... then the new tokens against themselves (causal), rope from a contiguous k_rope[new tokens, 64]
own = cukv.BatchMLAPrefill(H, page_size=None).plan(q_offsets, NEW, mask="causal")
o2, l2 = own.run(qd, k_nope_d[new_rows], v_d[new_rows], k_rope=cp.asarray(k_pe_s)[new_rows], return_lse=True)
o, lse = cukv.merge_states(o1, l1, o2, l2)
assert_close(from_storage(o.get(), DTYPE), want, DTYPE, name="chunked output")
assert_close(lse.get(), want_lse, "float32", atol=2e-3, rtol=2e-3, name="chunked lse")
print("  chunked (prefix without a mask, new tokens causal, merged by LSE): matches the float64 reference")
print(f"mla_prefill: OK ({B} sequences, {int(q_offsets[-1])} new tokens over {int(kv_lens.sum())} keys, {H} heads)")
