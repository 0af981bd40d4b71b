"""Prefill over an FP8 e4m3 KV cache, both strategies, checked against the float64 reference.

A batch of prompts is appended to an FP8 cache with per-(token, head) scales (the quantizing append), then
attended causally. ``BatchPrefill(fp8_prefill=...)`` has two strategies: 'fused' (the FP8 kernel converts K/V
tiles as it goes) and 'dequantize_first' (``cukv.dequantize_kv`` gathers each sequence's codes into ragged bf16
K/V once, then the bf16 prefill runs). 'auto' picks by how many query rows share each key. Both must match the
float64 attention over the cache's dequantized values, and the dequantized K must be what the host quantizer
gives for the same tokens.

Without a GPU it says so, compiles the gather-and-dequantize kernel and the fused FP8 prefill to cubins (proving
the toolchain) and checks the quantizer round trip on the host model.
"""
import numpy as np

import cukv
from cukv import fp8, reference
from cukv.device import has_gpu
from cukv.configs.dequant import DequantConfig
from cukv.dtypes import from_storage, to_storage
from cukv.policy.prefill import default_config

GPU = has_gpu()
HQ, HKV, D, PAGE = 16, 2, 128, 16
Q_LENS = [700, 333, 64] if GPU else [40, 7]
rng = np.random.default_rng(0)
total = sum(Q_LENS)
k_s = to_storage(rng.standard_normal((total, HKV, D)).astype(np.float32), "bfloat16")
v_s = to_storage(rng.standard_normal((total, HKV, D)).astype(np.float32), "bfloat16")
q_s = to_storage(rng.standard_normal((total, HQ, D)).astype(np.float32), "bfloat16")
offsets = np.concatenate([[0], np.cumsum(Q_LENS)]).astype(np.int32)
# what the cache will hold, by the host model of the quantizing append (bit-identical on the device)
k_codes, k_scales = fp8.quantize(from_storage(k_s, "bfloat16"), D)
v_codes, v_scales = fp8.quantize(from_storage(v_s, "bfloat16"), D)
k_deq, v_deq = fp8.dequantize(k_codes, k_scales, D), fp8.dequantize(v_codes, v_scales, D)
print(f"{len(Q_LENS)} prompts of {Q_LENS} tokens, {HQ}/{HKV} heads, d{D}, FP8 cache with token scales")

if not GPU:
    print("No CUDA GPU is visible: compiling the kernels and checking the quantizer on the host model only.")
    for cfg in (DequantConfig("bfloat16", D, PAGE, D), default_config("bfloat16", D, PAGE, "fp8_e4m3", D)):
        r = cfg.compiled.functions[cfg.name]
        print(f"  {cfg.name}: {r.registers} registers, {r.spill_stores} spill bytes")
    err = np.abs(k_deq - from_storage(k_s, "bfloat16")) / np.abs(from_storage(k_s, "bfloat16")).max(-1, keepdims=True)
    print(f"  quantization error of K, relative to each row's largest: {err.max():.3f} (e4m3: at most 2^-4)")
    assert err.max() <= 2.0 ** -4
    print("fp8_prefill: OK (host model; run on a GPU machine for the kernels)")
    raise SystemExit(0)

import cupy as cp  # noqa: E402  (a GPU is here)

cache = cukv.PagedKVCache(128, PAGE, HKV, D, dtype="fp8_e4m3", scale_granularity="token", fill="nan")
seqs = cukv.SequenceTable(cache, max_batch=len(Q_LENS), max_pages_per_seq=64)
cukv.append_kv(cache, cp.asarray(k_s), cp.asarray(v_s), cp.asarray(seqs.extend(Q_LENS)))
table = seqs.page_table()

k, v, kv_offsets = cukv.dequantize_kv(cache, table, Q_LENS)
got_k = from_storage(k.get(), "bfloat16")
want_k = from_storage(to_storage(k_deq.astype(np.float32), "bfloat16"), "bfloat16")
assert np.array_equal(got_k, want_k), "dequantize_kv differs from the host quantizer's values rounded to bf16"
print(f"  dequantize_kv: {k.shape[0]} keys per KV head, equal to the host model bit for bit")

want = reference.prefill_contiguous(from_storage(q_s, "bfloat16"), offsets, k_deq, v_deq, offsets)[0]
q = cp.asarray(q_s)
for strategy in ("fused", "dequantize_first", "auto"):
    pf = cukv.BatchPrefill(HQ, HKV, D, PAGE, kv_dtype="fp8_e4m3", fp8_prefill=strategy).plan(offsets, Q_LENS)
    out = from_storage(pf.run(q, (cache, table)).get(), "bfloat16")
    err = np.abs(out - want).max()
    print(f"  fp8_prefill={strategy!r} ran {pf.strategy!r}: max |out - float64 reference| {err:.4f}")
    assert err < 0.05, err
print("fp8_prefill: OK")
