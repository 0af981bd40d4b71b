"""Python twins of the kernel-argument structs in templates/kv_operand.cuh and decode.cuh.

Structs travel to kernels by value (``__grid_constant__``) as NumPy void scalars. The NumPy structured
dtypes below use C alignment (``align=True``); their sizes are rendered into every kernel and checked by
``static_assert(sizeof(...) == ...)``, so a drift between the two sides fails at compile time.
"""
from __future__ import annotations

import numpy as np

KV_PARAMS = np.dtype([
    ("k", "u8"), ("v", "u8"), ("k_scales", "u8"), ("v_scales", "u8"),
    ("block_table", "u8"), ("cache_lengths", "u8"),
    ("k_stride", "i8", (4,)), ("v_stride", "i8", (4,)),
    ("ks_stride", "i8", (4,)), ("vs_stride", "i8", (4,)),
    ("bt_stride", "i8"), ("max_pages_per_seq", "i8"), ("num_pages", "i8"), ("batch_size", "i8"),
], align=True)

DECODE_ARGS = np.dtype([
    ("kv", KV_PARAMS),
    ("q", "u8"), ("out", "u8"), ("lse", "u8"), ("part_o", "u8"), ("part_lse", "u8"), ("sink", "u8"),
    ("counters", "u8"), ("sm_scale", "f4"), ("softcap", "f4"), ("window", "i4"), ("num_splits", "i4"), ("num_qo_heads", "i4"),
    ("split_strips", "i4"),
], align=True)

APPEND_ARGS = np.dtype([
    ("kv", KV_PARAMS),
    ("k_new", "u8"), ("v_new", "u8"), ("slots", "u8"),
    ("num_tokens", "i8"), ("num_heads", "i8"),
], align=True)


def ptr(a) -> int:
    """Device address of a CuPy array, 0 for None."""
    return 0 if a is None else int(a.data.ptr)


def as_kernel_arg(rec: np.ndarray):
    """A filled array (a 0-d structured record, or raw bytes) -> the by-value kernel argument CuPy passes through."""
    raw = rec.tobytes()
    return np.frombuffer(raw, dtype=np.dtype((np.void, len(raw))))[0]


def kv_params(cache, table=None) -> np.ndarray:
    """Fill KVCacheParams from a PagedKVCache (and a PageTable for reads)."""
    rec = np.zeros((), KV_PARAMS)
    rec["k"], rec["v"] = ptr(cache.k), ptr(cache.v)
    rec["k_stride"], rec["v_stride"] = cache.k_strides, cache.v_strides
    if getattr(cache, "k_scales", None) is not None:
        rec["k_scales"], rec["v_scales"] = ptr(cache.k_scales), ptr(cache.v_scales)
        rec["ks_stride"], rec["vs_stride"] = cache.ks_strides, cache.vs_strides
    rec["num_pages"] = cache.num_pages
    if table is not None:
        bt = table.block_table
        rec["block_table"], rec["cache_lengths"] = ptr(bt), ptr(table.lengths)
        rec["bt_stride"] = bt.strides[0] // bt.itemsize
        rec["max_pages_per_seq"] = bt.shape[1]
        rec["batch_size"] = bt.shape[0]
    return rec

PREFILL_ARGS = np.dtype([
    ("kv", KV_PARAMS),
    ("q", "u8"), ("out", "u8"), ("lse", "u8"), ("sink", "u8"), ("q_offsets", "u8"), ("work", "u8"),
    ("q_stride", "i8", (2,)), ("o_stride", "i8", (2,)),
    ("sm_scale", "f4"), ("softcap", "f4"), ("window", "i4"), ("chunk", "i4"), ("num_qo_heads", "i4"),
    ("group", "i4"), ("causal", "i4"), ("tail_heads", "i4"),
], align=True)

#: templates/prefill.cuh OnceArgs: the FP8 cache a convert-once prefill fills its workspace from, and the flags
ONCE_ARGS = np.dtype([("fp8", KV_PARAMS), ("flags", "u8"), ("tile_seq", "u8"), ("num_kv_heads", "i8"),
                      ("num_work", "i4"), ("ws_tiles", "i4")], align=True)

DEQUANT_ARGS = np.dtype([
    ("kv", KV_PARAMS),
    ("k_out", "u8"), ("v_out", "u8"), ("kv_offsets", "u8"), ("num_heads", "i8"),
], align=True)

#: templates/mla_kv_producer.cuh MLAPrefillArgs: the up-projected k_nope / v rows of an MLA prefill (the rope source
#: travels in PrefillArgs.kv)
MLA_PREFILL_ARGS = np.dtype([
    ("k_nope", "u8"), ("v", "u8"), ("kv_offsets", "u8"), ("kn_stride", "i8", (2,)), ("v_stride", "i8", (2,)),
], align=True)
