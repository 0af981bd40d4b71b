"""Every FP8 decode and prefill specialization the benchmarks and defaults use compiles for sm_90a with no
spills (NVRTC needs no GPU). The append kernels are covered in test_fp8_cpu.py."""
import pytest

from cukv.decode import DecodeConfig
from cukv.prefill import PrefillConfig, default_config

DECODE = [("bfloat16", 128, 4, sb) for sb in (0, 32, 64, 128)] + [
    ("float16", 128, 4, 128), ("bfloat16", 64, 8, 64), ("bfloat16", 96, 4, 32), ("bfloat16", 256, 4, 256),
    ("bfloat16", 256, 8, 64), ("bfloat16", 128, 16, 32), ("bfloat16", 128, 1, 0)]
PREFILL = [("bfloat16", d, sb) for d, sb in ((128, 128), (128, 0), (128, 32), (64, 64), (256, 256), (96, 32), (512, 64))]


@pytest.mark.parametrize("stages", [None, 0], ids=["lane_ring", "registers"])
@pytest.mark.parametrize("dtype,d,group,sb", DECODE)
def test_decode_fp8_compiles_without_spills(dtype, d, group, sb, stages):
    cfg = DecodeConfig(dtype, d, group, 16, kv_dtype="fp8_e4m3", scale_block=sb, stages=stages)
    assert (cfg.stages > 0) == (stages is None) and cfg.sub == (1 if cfg.stages else cfg.sub)
    rep = cfg.compiled.functions[cfg.name]
    assert rep.spill_stores == 0 and rep.spill_loads == 0, rep
    assert rep.static_smem == cfg.smem_bytes
    assert cfg.total_smem_bytes <= 227 * 1024


@pytest.mark.parametrize("dtype,d,sb", PREFILL)
def test_prefill_fp8_default_compiles_without_spills(dtype, d, sb):
    cfg = default_config(dtype, d, 16, "fp8_e4m3", sb)
    rep = cfg.compiled.functions[cfg.name]
    assert rep.spill_stores == 0 and rep.spill_loads == 0, rep


def test_fp8_config_domains():
    with pytest.raises(ValueError, match="scale_block"):
        DecodeConfig("bfloat16", 256, 4, 16, kv_dtype="fp8_e4m3", scale_block=32)
    with pytest.raises(ValueError, match="scale_block"):
        DecodeConfig("bfloat16", 128, 4, 16, scale_block=64)  # scales without an FP8 cache
    with pytest.raises(ValueError, match="page_size"):
        PrefillConfig("bfloat16", 128, 0, 192, 64, 128, 4, kv_dtype="fp8_e4m3", scale_block=128)
    with pytest.raises(ValueError, match="BN"):
        PrefillConfig("bfloat16", 128, 16, 128, 128, 128, 4, kv_dtype="fp8_e4m3", scale_block=128)
    with pytest.raises(ValueError, match="kv_dtype"):
        PrefillConfig("bfloat16", 128, 16, kv_dtype="fp8")
