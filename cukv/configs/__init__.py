"""Kernel configs: one frozen dataclass per kernel, whose fields are the template's parameters; a shared base
(``KernelConfig``) renders and compiles them. Defaults live in :mod:`cukv.policy`."""
from .append import AppendConfig
from .base import KernelConfig
from .decode import DecodeConfig
from .dequant import DequantConfig
from .merge import MergeConfig
from .mla_decode import MLADecodeConfig
from .mla_prefill import MLAPrefillConfig
from .prefill import KVBufferConfig, PrefillConfig

__all__ = ["AppendConfig", "DecodeConfig", "DequantConfig", "KVBufferConfig", "KernelConfig", "MergeConfig", "MLADecodeConfig",
           "MLAPrefillConfig", "PrefillConfig"]
