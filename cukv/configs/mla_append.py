"""MLAAppendConfig: the template parameters of the MLA append kernel (templates/mla_append.cu.j2), which writes
new tokens' 576-wide latent rows (or 656-byte FP8 rows) into an :class:`~cukv.MLAKVCache`."""
from __future__ import annotations

import dataclasses

import numpy as np

from .base import KernelConfig
from .checks import CTYPES, SHORT, check_bool, check_in

# the kernel's by-value argument (templates/mla_append.cuh MLAAppendArgs)
APPEND_ARGS = np.dtype([("kv_c", "<u8"), ("k_pe", "<u8"), ("slots", "<u8"), ("cache", "<u8"),
                        ("kv_c_stride", "<i8"), ("k_pe_stride", "<i8"), ("page_stride", "<i8"),
                        ("row_stride", "<i8"), ("num_tokens", "<i4"), ("num_pages", "<i4"),
                        ("page_size", "<i4"), ("pad", "<i4")])
#: a block per token (templates/mla_append.cuh): FP8 thread t quantizes values 4t..4t+3, warp w scale block w
THREADS = 128


@dataclasses.dataclass(frozen=True)
class MLAAppendConfig(KernelConfig):
    """Template parameters of the MLA append kernel.

    Examples
    --------
    >>> from cukv.configs.mla_append import MLAAppendConfig
    >>> MLAAppendConfig("bfloat16").name, MLAAppendConfig("bfloat16", fp8=True, pow2_scales=True).name
    ('cukv_mla_append_bf16', 'cukv_mla_append_bf16_e4m3_pow2')
    >>> MLAAppendConfig("float16", pow2_scales=True)
    Traceback (most recent call last):
    ...
    ValueError: MLAAppendConfig.pow2_scales=True is not valid: applies to FP8 rows only (fp8=True)
    """

    template = "mla_append.cu.j2"

    #: element type of kv_c and k_pe
    dtype: str = "bfloat16"
    #: write 656-byte FP8 rows (else 16-bit rows of ``dtype``)
    fp8: bool = False
    #: FP8: round each scale up to a power of two (FlashMLA's quantizer)
    pow2_scales: bool = False

    def __post_init__(self):
        check_in("MLAAppendConfig", "dtype", self.dtype, tuple(CTYPES))
        check_bool("MLAAppendConfig", "fp8", self.fp8)
        check_bool("MLAAppendConfig", "pow2_scales", self.pow2_scales)
        if self.pow2_scales and not self.fp8:
            raise ValueError("MLAAppendConfig.pow2_scales=True is not valid: applies to FP8 rows only (fp8=True)")

    @property
    def name(self) -> str:
        kind = ("_e4m3" + ("_pow2" if self.pow2_scales else "")) if self.fp8 else ""
        return f"cukv_mla_append_{SHORT[self.dtype]}{kind}"

    def render_params(self) -> dict:
        return dict(name=self.name, ctype=CTYPES[self.dtype], fp8=self.fp8, pow2=self.pow2_scales,
                    args_bytes=APPEND_ARGS.itemsize)


def shipped() -> list[MLAAppendConfig]:
    """The MLA append specializations compiled ahead of time."""
    return [MLAAppendConfig(dt, f8, p2) for dt in ("bfloat16", "float16")
            for f8, p2 in ((False, False), (True, False), (True, True))]
