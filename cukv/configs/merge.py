"""The merge kernel's config (templates/merge_states.cu.j2): partial attentions combined by their LSE."""
from __future__ import annotations

import dataclasses

import numpy as np

from .base import KernelConfig
from .checks import check_in, check_range, check_rule

#: value dtypes: name -> (C++ type, short name, bytes)
MERGE_DTYPES = {"bfloat16": ("__nv_bfloat16", "bf16", 2), "float16": ("__half", "f16", 2),
                "float32": ("float", "f32", 4)}
THREADS = (64, 128, 256, 512)

#: Python twin of MergeArgs (templates/merge_states.cuh); its size is checked by static_assert
MERGE_ARGS = np.dtype([
    ("v", "u8"), ("s", "u8"), ("out", "u8"), ("lse", "u8"),
    ("v_state_stride", "i8"), ("s_state_stride", "i8"), ("num_rows", "i8"),
    ("num_states", "i4"), ("pad_", "i4"),
], align=True)


@dataclasses.dataclass(frozen=True)
class MergeConfig(KernelConfig):
    """Template parameters of the merge kernel: value dtype, head dim and threads per block.

    A row (one token and head) is handled by ``threads_per_row`` consecutive threads, each moving 16 bytes
    (``vec`` elements); a block holds ``rows_per_block`` rows and leaves ``idle_threads`` idle when the row
    width does not divide the block. The number of states is a run-time argument.

    Examples
    --------
    >>> from cukv import MergeConfig
    >>> cfg = MergeConfig("float16", head_dim=128)
    >>> cfg.name, cfg.vec, cfg.threads_per_row, cfg.rows_per_block
    ('cukv_merge_f16_d128_t128', 8, 16, 8)
    >>> MergeConfig("float16", head_dim=100)
    Traceback (most recent call last):
    ...
    ValueError: MergeConfig.head_dim=100 is not valid: must be a multiple of 8 for float16 (each thread moves 16 bytes)
    """

    template = "merge_states.cu.j2"

    dtype: str = "bfloat16"
    head_dim: int = 128
    threads: int = 128

    def __post_init__(self):
        c = "MergeConfig"
        check_in(c, "dtype", self.dtype, tuple(MERGE_DTYPES))
        check_range(c, "head_dim", self.head_dim, 4, 1024)
        check_rule(c, "head_dim", self.head_dim, self.head_dim % self.vec == 0,
                   f"must be a multiple of {self.vec} for {self.dtype} (each thread moves 16 bytes)")
        check_in(c, "threads", self.threads, THREADS)
        check_rule(c, "head_dim", self.head_dim, self.threads_per_row <= self.threads,
                   f"needs {self.threads_per_row} threads per row, more than threads={self.threads}")

    @property
    def itemsize(self) -> int:
        return MERGE_DTYPES[self.dtype][2]

    @property
    def vec(self) -> int:
        """Elements per 16-byte load."""
        return 16 // self.itemsize

    @property
    def threads_per_row(self) -> int:
        return self.head_dim // self.vec

    @property
    def rows_per_block(self) -> int:
        return self.threads // self.threads_per_row

    @property
    def idle_threads(self) -> int:
        return self.threads - self.rows_per_block * self.threads_per_row

    @property
    def name(self) -> str:
        return f"cukv_merge_{MERGE_DTYPES[self.dtype][1]}_d{self.head_dim}_t{self.threads}"

    def render_params(self) -> dict:
        return dict(name=self.name, ctype=MERGE_DTYPES[self.dtype][0], head_dim=self.head_dim, threads=self.threads,
                    vec=self.vec, threads_per_row=self.threads_per_row, rows_per_block=self.rows_per_block,
                    idle_threads=self.idle_threads, args_bytes=MERGE_ARGS.itemsize)
