"""The append kernel's config (templates/append.cu.j2): writes new tokens' K/V (or FP8 codes and scales)."""
from __future__ import annotations

import dataclasses

from ..operand import APPEND_ARGS
from .base import KernelConfig
from .checks import CTYPES, SHORT, check_in, check_kv_quant, check_range


@dataclasses.dataclass(frozen=True)
class AppendConfig(KernelConfig):
    """Template parameters of the append kernel (templates/append.cu.j2).

    Examples
    --------
    >>> from cukv import AppendConfig
    >>> cfg = AppendConfig("bfloat16", head_dim=128, page_size=16)
    >>> cfg.name, cfg.grid(num_tokens=100, num_heads=8)
    ('cukv_append_bf16_d128_p16', 50)
    >>> AppendConfig("bfloat16", head_dim=128, page_size=16, kv_dtype="fp8_e4m3", scale_block=128).name
    'cukv_append_bf16_e4m3s128_d128_p16'
    >>> AppendConfig("bfloat16", head_dim=100)
    Traceback (most recent call last):
    ...
    ValueError: AppendConfig.head_dim=100 is not valid: must be a multiple of 8
    """

    template = "append.cu.j2"

    dtype: str = "bfloat16"
    head_dim: int = 128
    page_size: int = 16
    threads: int = 256
    #: cache element type: None (same as ``dtype``) or 'fp8_e4m3' (quantizing append)
    kv_dtype: str | None = None
    #: FP8 only: dims per scale (the head dim for per-token scales), 0 for the caller's per-tensor scales
    scale_block: int = 0

    def __post_init__(self):
        check_in("AppendConfig", "dtype", self.dtype, tuple(CTYPES))
        check_kv_quant("AppendConfig", self.kv_dtype, self.scale_block, self.head_dim)
        if self.kv_dtype is not None and self.head_dim % 16:
            raise ValueError(f"AppendConfig.head_dim={self.head_dim} is not valid: must be a multiple of 16 for an "
                             "FP8 cache")
        check_range("AppendConfig", "head_dim", self.head_dim, 8, 1024)
        if self.head_dim % 8:
            raise ValueError(f"AppendConfig.head_dim={self.head_dim} is not valid: must be a multiple of 8")
        check_range("AppendConfig", "page_size", self.page_size, 1, 1 << 16)
        check_in("AppendConfig", "threads", self.threads, (128, 256, 512))

    @property
    def quantized(self) -> bool:
        return self.kv_dtype is not None

    @property
    def name(self) -> str:
        q = f"_e4m3s{self.scale_block}" if self.quantized else ""
        return f"cukv_append_{SHORT[self.dtype]}{q}_d{self.head_dim}_p{self.page_size}"

    def grid(self, num_tokens: int, num_heads: int) -> int:
        """Blocks to launch: a thread per 16-byte vector, or a warp per (token, head) row when quantizing."""
        work = num_tokens * num_heads * (32 if self.quantized else self.head_dim // 8)
        return max(1, min((work + self.threads - 1) // self.threads, 65535))

    def render_params(self) -> dict:
        return dict(name=self.name, ctype=CTYPES[self.dtype], page_size=self.page_size,
                    head_dim=self.head_dim, threads=self.threads, args_bytes=APPEND_ARGS.itemsize,
                    quantized=self.quantized, scale_block=self.scale_block)
