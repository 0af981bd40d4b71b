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
from .append import AppendConfig, append_kv
from .cache import PageAllocator, PagedKVCache, PageTable, SequenceTable
from .decode import BatchDecode, DecodeConfig, decode
from .prefill import BatchPrefill, prefill
from .prefill_config import KVBufferConfig, PrefillConfig
from .dequant import DequantConfig, dequantize_kv
from .merge import MergeConfig, merge_states, merge_states_n
from .errors import CompileError, CompileForbidden, CukvError, NoGPUError
from .mla_cache import MLAKVCache, append_mla
from .configs.mla_decode import MLADecodeConfig
from .ops.mla_decode import BatchMLADecode, mla_decode

__all__ = [
    "__version__", "AppendConfig", "append_kv", "PageAllocator", "PagedKVCache", "PageTable", "SequenceTable",
    "BatchDecode", "DecodeConfig", "decode", "BatchPrefill", "KVBufferConfig", "PrefillConfig", "prefill", "DequantConfig", "dequantize_kv", "MergeConfig", "merge_states", "merge_states_n", "CompileError", "CompileForbidden", "CukvError", "NoGPUError",
    "MLAKVCache", "append_mla", "MLADecodeConfig", "BatchMLADecode", "mla_decode",
]
