"""The gather-and-dequantize kernel's config (templates/dequant_kv.cu.j2): an FP8 cache to ragged 16-bit K/V."""
from __future__ import annotations

import dataclasses

from ..operand import DEQUANT_ARGS
from .base import KernelConfig
from .checks import CTYPES, SHORT, check_in, check_kv_quant, check_range


@dataclasses.dataclass(frozen=True)
class DequantConfig(KernelConfig):
    """Template parameters of the gather-and-dequantize kernel (``templates/dequant_kv.cuh``).

    Examples
    --------
    >>> from cukv import DequantConfig
    >>> cfg = DequantConfig("bfloat16", head_dim=128, page_size=16, scale_block=128)   # per-token scales
    >>> cfg.name, cfg.grid(max_len=40, num_heads=2, batch=3)
    ('cukv_dequant_bf16_e4m3s128_d128_p16', (5, 3, 2))
    >>> DequantConfig("bfloat16", head_dim=100)
    Traceback (most recent call last):
    ...
    ValueError: DequantConfig.head_dim=100 is not valid: must be a multiple of 16 (FP8 rows)
    """

    template = "dequant_kv.cu.j2"

    #: output type
    dtype: str = "bfloat16"
    head_dim: int = 128
    page_size: int = 16
    #: dims per scale (the head dim for per-token scales), 0 for one scale per tensor
    scale_block: int = 128
    threads: int = 256

    def __post_init__(self):
        check_in("DequantConfig", "dtype", self.dtype, tuple(CTYPES))
        check_range("DequantConfig", "head_dim", self.head_dim, 16, 1024)
        if self.head_dim % 16:
            raise ValueError(f"DequantConfig.head_dim={self.head_dim} is not valid: must be a multiple of 16 "
                             "(FP8 rows)")
        check_kv_quant("DequantConfig", "fp8_e4m3", self.scale_block, self.head_dim)
        check_range("DequantConfig", "page_size", self.page_size, 1, 4096)
        check_in("DequantConfig", "threads", self.threads, (128, 256, 512))

    @property
    def name(self) -> str:
        return f"cukv_dequant_{SHORT[self.dtype]}_e4m3s{self.scale_block}_d{self.head_dim}_p{self.page_size}"

    def grid(self, max_len: int, num_heads: int, batch: int) -> tuple:
        """(tokens of the longest sequence x heads x 8-code vectors over threads, sequences, K and V)."""
        work = max(1, max_len) * num_heads * (self.head_dim // 8)
        return ((work + self.threads - 1) // self.threads, batch, 2)

    def render_params(self) -> dict:
        return dict(name=self.name, ctype=CTYPES[self.dtype], page_size=self.page_size,
                    head_dim=self.head_dim, scale_block=self.scale_block, threads=self.threads,
                    args_bytes=DEQUANT_ARGS.itemsize)
