"""cukv: GPU attention kernels over paged KV caches, compiled at run time (Jinja2 -> NVRTC -> cubin).

Quick tour::

    cache = cukv.PagedKVCache(num_pages, page_size, num_kv_heads, head_dim, dtype="bfloat16")
    seqs = cukv.SequenceTable(cache, max_batch, max_pages_per_seq)
    cukv.append_kv(cache, k_new, v_new, cupy.asarray(seqs.extend(counts)))
    dec = cukv.BatchDecode(num_qo_heads, num_kv_heads, head_dim, page_size).plan(batch, max_len)
    out, lse = dec.run(q, cache, seqs.page_table(), return_lse=True)

``cukv.reference`` holds the float64 NumPy definitions every kernel is tested against.
"""
from ._version import __version__
from .configs import AppendConfig, DecodeConfig, DequantConfig, KVBufferConfig, MergeConfig, PrefillConfig
from .errors import CompileError, CompileForbidden, CukvError, NoGPUError, NotPlannedError
from .kvcache import PageAllocator, PagedKVCache, PageTable, SequenceTable
from .ops.append import append_kv
from .ops.decode import BatchDecode, decode
from .ops.dequant import dequantize_kv
from .ops.merge import merge_states, merge_states_n
from .ops.prefill import BatchPrefill, prefill

__all__ = [
    "__version__", "AppendConfig", "append_kv", "PageAllocator", "PagedKVCache", "PageTable", "SequenceTable",
    "BatchDecode", "DecodeConfig", "decode", "BatchPrefill", "KVBufferConfig", "PrefillConfig", "prefill", "DequantConfig", "dequantize_kv", "MergeConfig", "merge_states", "merge_states_n", "CompileError", "CompileForbidden", "CukvError", "NoGPUError", "NotPlannedError",
]
