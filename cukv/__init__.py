"""cukv: GPU attention kernels over paged KV caches, compiled at run time (Jinja2 -> NVRTC -> cubin).

A decode step over a paged bf16 cache (bf16 arrays are uint16 bit patterns: ``cukv.dtypes.to_storage``):

>>> import cupy as cp, numpy as np, cukv
>>> from cukv.dtypes import to_storage
>>> rng = np.random.default_rng(0)
>>> def bf16(*shape): return cp.asarray(to_storage(rng.standard_normal(shape), "bfloat16"))
>>> cache = cukv.PagedKVCache(num_pages=16, page_size=16, num_kv_heads=2, head_dim=128, dtype="bfloat16")
>>> seqs = cukv.SequenceTable(cache, max_batch=2, max_pages_per_seq=8)
>>> cukv.append_kv(cache, bf16(50, 2, 128), bf16(50, 2, 128), cp.asarray(seqs.extend([30, 20])))
>>> dec = cukv.BatchDecode(num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16)
>>> dec = dec.plan(batch_size=2, max_kv_len=128)
>>> out, lse = dec.run(bf16(2, 8, 128), cache, seqs.page_table(), return_lse=True)
>>> out.shape, lse.shape
((2, 8, 128), (2, 8))

``cukv.reference`` holds the float64 NumPy definitions every kernel is tested against; the examples of
``BatchDecode``, ``BatchPrefill``, ``append_kv``, ``merge_states`` and ``dequantize_kv`` check against it.
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
from .mla_cache import MLAKVCache
from .configs.mla_decode import MLADecodeConfig
from .ops.mla_append import append_mla
from .ops.mla_decode import BatchMLADecode, mla_decode
from .configs.mla_prefill import MLAPrefillConfig
from .ops.mla_prefill import BatchMLAPrefill, mla_prefill
from .ops.sparse_mla import SparseMLA, sparse_indices, sparse_mla_decode, sparse_mla_prefill

__all__ = [
    "__version__", "AppendConfig", "append_kv", "PageAllocator", "PagedKVCache", "PageTable", "SequenceTable",
    "BatchDecode", "DecodeConfig", "decode", "BatchPrefill", "KVBufferConfig", "PrefillConfig", "prefill", "DequantConfig", "dequantize_kv", "MergeConfig", "merge_states", "merge_states_n", "CompileError", "CompileForbidden", "CukvError", "NoGPUError", "NotPlannedError",
    "MLAKVCache", "append_mla", "MLADecodeConfig", "BatchMLADecode", "mla_decode", "MLAPrefillConfig", "BatchMLAPrefill",
    "mla_prefill", "SparseMLA", "sparse_mla_prefill", "sparse_mla_decode", "sparse_indices",
]
