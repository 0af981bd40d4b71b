"""The specializations cukv ships: what `python -m cukv compile` builds and CI checks for spills."""
from __future__ import annotations

from .configs.append import AppendConfig
from .configs.decode import HEAD_DIMS
from .configs.merge import MergeConfig
from .configs.prefill import HEAD_DIMS as PREFILL_HEAD_DIMS
from .policy.decode import decode_config
from .policy.prefill import default_config as prefill_default
from .configs.mla_append import shipped as mla_append_shipped
from .policy.mla_decode import shipped as mla_decode_shipped
from .policy.mla_prefill import shipped as mla_prefill_shipped
from .policy.mla_decode import sparse_shipped as sparse_mla_shipped

DTYPES = ("bfloat16", "float16")
GROUPS = (1, 2, 4, 8, 16)
PAGE_SIZES = (16,)


def shipped():
    """Every config object cukv compiles ahead of time (others compile on first use)."""
    out = []
    for dt in DTYPES:
        for d in HEAD_DIMS:
            out.append(MergeConfig(dt, d))
            for ps in PAGE_SIZES:
                out.append(AppendConfig(dt, d, ps))
                for g in GROUPS:
                    cfg = decode_config(dt, d, g, ps, tma=None)  # BatchDecode's default
                    out.append(cfg)
                    if cfg.stages:  # plan() takes the register kernel for small steps: ship it too
                        out.append(decode_config(dt, d, g, ps, stages=0))
                    if d == 128 and g == 4 and ps == 16:  # the benchmark's clustered small steps
                        out.extend(decode_config(dt, d, g, ps, cluster=c, tma=None) for c in (2, 8))
        for d in PREFILL_HEAD_DIMS:
            for ps in (16, 0):  # page 16 and contiguous K/V
                out.append(prefill_default(dt, d, ps))
    out.extend(mla_decode_shipped())
    out.extend(mla_append_shipped())
    out.extend(mla_prefill_shipped())
    out.extend(sparse_mla_shipped())
    return out


def select(pattern: str | None):
    cfgs = shipped()
    return [c for c in cfgs if not pattern or pattern in c.name]
