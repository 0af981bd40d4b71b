"""The decode rings' tensor-copy form (``DecodeConfig.tma``, 16-bit and FP8 caches) without a GPU: its domain and named
errors, what it renders, and that every tma config of the bench grid's shapes compiles for sm_90a without spills."""
import dataclasses

import pytest

import cukv
from cukv import DecodeConfig
from cukv.policy.decode import DEFAULT_STAGES, DEFAULT_TMA, DEFAULT_TMA_STAGES, decode_config
from cukv.tma import MAP_BYTES

# registers and shared memory move with the group, the ring depth and the head dim; dtype and page size are spot
# checks (each compile costs CI seconds)
ARCH_GRID = [("bfloat16", 128, g, 16, st) for g in (1, 2, 4, 8, 16) for st in (2, 3, 4)]
ARCH_GRID += [("float16", 128, g, 16, 3) for g in (1, 4, 16)] + [("bfloat16", 128, 4, 64, st) for st in (2, 3, 4)]
ARCH_GRID += [("bfloat16", d, g, 16, st) for d in (64, 256) for g in (1, 16) for st in (2, 4)]

pytestmark = pytest.mark.usefixtures("fresh_kernel_cache")


def _resources(cfg):
    mod = cfg.compiled
    r = mod.functions[cfg.name]
    assert r.spill_stores == 0 and r.spill_loads == 0, f"{cfg.name} spills: {r}"
    assert r.stack_frame == 0, f"{cfg.name} has a stack frame: {r}"
    assert r.static_smem == cfg.smem_bytes, f"{cfg.name}: ptxas {r.static_smem} B, config {cfg.smem_bytes} B"
    return r


def _tma_config(dt, d, group, ps, stages):
    return decode_config(dt, d, group, ps, 4, stages=stages, tma=True)


@pytest.mark.compile_ahead(build=_tma_config)
@pytest.mark.parametrize("dt,d,group,ps,stages", ARCH_GRID, ids=lambda v: str(v))
def test_tma_configs_compile_without_spills(dt, d, group, ps, stages):
    try:
        cfg = _tma_config(dt, d, group, ps, stages)
    except ValueError as e:  # too much shared memory for this (head_dim, stages): the same rule as without tma
        assert "exceed" in str(e)
        pytest.skip(str(e))
    assert cfg.tma and cfg.name.endswith(f"_r{stages}_tma")
    _resources(cfg)


# FP8 ring: d128 (one atom per row) and d256 (two), groups 4 and 8 (the bench's 32/8 heads and 64/8), pages 16 and 64,
# per-token (scale_block = head_dim) and per-tensor (0) scales (block scales are refused); min_blocks 3 (168
# registers: 3 blocks per SM)
FP8_GRID = [(128, g, ps, sb, 2, 1) for g in (4, 8) for ps in (16, 64) for sb in (128, 0)]
FP8_GRID += [(128, g, 16, 128, 3, 1) for g in (1, 16)]
FP8_GRID += [(128, g, 16, sb, 2, 3) for g in (4, 8) for sb in (128, 0)] + [(128, 4, 16, 128, 3, mb) for mb in (1, 3)]
FP8_GRID += [(256, 4, 16, 256, 2, 1), (256, 8, 64, 0, 2, 1)]


def _fp8_tma_config(d, group, ps, sb, stages, min_blocks):
    return decode_config("bfloat16", d, group, ps, 4, min_blocks, kv_dtype="fp8_e4m3", scale_block=sb, stages=stages,
                         tma=True)


@pytest.mark.compile_ahead(build=_fp8_tma_config)
@pytest.mark.parametrize("d,group,ps,sb,stages,min_blocks", FP8_GRID, ids=lambda v: str(v))
def test_fp8_tma_configs_compile_without_spills(d, group, ps, sb, stages, min_blocks):
    cfg = _fp8_tma_config(d, group, ps, sb, stages, min_blocks)
    assert cfg.tma and cfg.name.endswith(f"_r{stages}_tma")
    _resources(cfg)


def test_fp8_tma_renders_maps_and_sizes():
    plain = decode_config("bfloat16", 128, 4, 16, kv_dtype="fp8_e4m3", scale_block=128, stages=2)
    cfg = dataclasses.replace(plain, tma=True)
    src = cfg.render()
    assert "static constexpr bool tma = true;" in src and "typedef DecodeKernel<DecodeTraits> K;" in src
    assert f"sizeof(DecodeMaps) == {2 * MAP_BYTES}," in src and "K::run(a, &maps);" in src
    # the same slot bytes (code rows, then scales kept apart), plus one mbarrier per slot and 1024 bytes of slack
    assert cfg.ring_slot_bytes == plain.ring_slot_bytes
    assert cfg.ring_smem_bytes == plain.ring_smem_bytes + 1024 + 8 * cfg.num_warps * cfg.stages
    assert f"K::RING_BYTES == {cfg.ring_smem_bytes}," in src
    assert cfg.name == plain.name + "_tma"


def test_fp8_tma_default_off():
    from cukv.policy.decode import DEFAULT_FP8_TMA

    assert DEFAULT_FP8_TMA is False
    assert not decode_config("bfloat16", 128, 4, 16, kv_dtype="fp8_e4m3", scale_block=128, tma=None).tma
    assert not cukv.BatchDecode(32, 8, 128, 16, "bfloat16", kv_dtype="fp8_e4m3").config.tma
    dec = cukv.BatchDecode(32, 8, 128, 16, "bfloat16", kv_dtype="fp8_e4m3", tma=True)
    assert dec.config.tma and dec.config.stages == 2
    assert [c.tma for c in dec._configs] == [True, False]  # plan()'s register kernel for small steps: no copies


def _cluster_config(cluster):
    return decode_config("bfloat16", 128, 4, 16, stages=3, cluster=cluster, tma=True)


@pytest.mark.compile_ahead(build=_cluster_config)
@pytest.mark.parametrize("cluster", [2, 8])
def test_tma_cluster_merge_compiles_without_spills(cluster):
    cfg = _cluster_config(cluster)
    assert cfg.name.endswith(f"_r3_tma_c{cluster}")
    _resources(cfg)


def test_tma_renders_maps_and_sizes():
    plain = decode_config("bfloat16", 128, 4, 16, stages=3)
    cfg = dataclasses.replace(plain, tma=True)
    src = cfg.render()
    assert "static constexpr bool tma = true;" in src and "static constexpr bool tma = false;" in plain.render()
    assert f"sizeof(DecodeMaps) == {2 * MAP_BYTES}," in src and "DecodeMaps" not in plain.render().split("K;")[-1]
    assert "const __grid_constant__ DecodeMaps maps" in src and "K::run(a, &maps);" in src
    # the same slots, plus one mbarrier per slot and the slack that aligns the slots to 1024 bytes
    assert cfg.ring_slot_bytes == plain.ring_slot_bytes
    assert cfg.ring_smem_bytes == plain.ring_smem_bytes + 1024 + 8 * cfg.num_warps * cfg.stages
    assert f"K::RING_BYTES == {cfg.ring_smem_bytes}," in src
    assert cfg.name == plain.name + "_tma" and cfg != plain and hash(cfg) != hash(plain)


def test_tma_default_on_where_the_ring_applies():
    assert DEFAULT_TMA is True
    assert not decode_config("bfloat16", 128, 4, 16).tma  # the config's own default stays off
    assert decode_config("bfloat16", 128, 4, 16, tma=None).tma
    assert not decode_config("bfloat16", 128, 4, 16, stages=0, tma=None).tma  # registers: no ring to fill
    assert not decode_config("bfloat16", 128, 4, 8, tma=None).tma  # pages of 8: no whole 16-token strips
    assert not decode_config("bfloat16", 128, 4, 16, kv_dtype="fp8_e4m3", tma=None).tma
    assert cukv.BatchDecode(32, 8, 128, 16, "bfloat16").config.tma
    assert not cukv.BatchDecode(32, 8, 128, 16, "bfloat16", tma=False).config.tma
    dec = cukv.BatchDecode(32, 8, 128, 16, "bfloat16", tma=True)
    # the ring depth follows the staging: two slots by tensor copies, three by cp.async
    assert dec.config.tma and dec.config.stages == DEFAULT_TMA_STAGES[0] == 2
    assert cukv.BatchDecode(32, 8, 128, 16, "bfloat16", tma=False).config.stages == DEFAULT_STAGES[0] == 3
    # plan()'s register kernel for small steps has no tensor copies; the ring keeps them
    assert [c.tma for c in dec._configs] == [True, False]


@pytest.mark.parametrize("kw,why", [
    ({"stages": 0}, "stages must be 2..8"),
    ({"stages": 3, "page_size": 8}, "page_size=8 must be a multiple of 16"),
    ({"stages": 3, "page_size": 24}, "page_size=24 must be a multiple of 16"),
    ({"stages": 3, "head_dim": 96}, "head_dim=96 must be a multiple of 64"),
    ({"stages": 2, "kv_dtype": "fp8_e4m3", "head_dim": 64, "scale_block": 64}, "128 FP8 dims.*head_dim=64 must be a multiple of 128"),
    ({"stages": 2, "kv_dtype": "fp8_e4m3", "head_dim": 96, "scale_block": 32}, "head_dim=96 must be a multiple of 128"),
    ({"stages": 2, "kv_dtype": "fp8_e4m3", "scale_block": 128, "page_size": 8}, "page_size=8 must be a multiple of 16"),
    ({"stages": 0, "kv_dtype": "fp8_e4m3", "scale_block": 128}, "stages must be 2..8"),
])
def test_tma_domain_errors_are_named(kw, why):
    with pytest.raises(ValueError, match=f"DecodeConfig.tma=True is not valid: .*{why}"):
        decode_config(**{**kw, "tma": True})


@pytest.mark.parametrize("value", [1, "yes", 1.0])
def test_tma_field_takes_bools_only(value):
    with pytest.raises(ValueError, match=r"DecodeConfig.tma=.* is not valid; accepted: True, False"):
        DecodeConfig("bfloat16", 128, 4, 16, stages=3, sub=1, tma=value)


def test_batch_decode_tma_errors():
    with pytest.raises(TypeError, match="tma=1 must be True or False"):
        cukv.BatchDecode(8, 2, 128, 16, tma=1)
    with pytest.raises(ValueError, match="DecodeConfig.tma=True is not valid: .*page_size=1"):
        cukv.BatchDecode(8, 2, 128, 1, tma=True)  # the policy stages page size 1 in registers
    with pytest.raises(ValueError, match="DecodeConfig.tma=True is not valid: .*stages must be 2..8"):
        cukv.BatchDecode(8, 2, 128, 16, stages=0, tma=True)
    with pytest.raises(ValueError, match="DecodeConfig.tma=True is not valid: .*head_dim=64 must be a multiple of 128"):
        cukv.BatchDecode(8, 2, 64, 16, kv_dtype="fp8_e4m3", tma=True)
    with pytest.raises(ValueError, match="DecodeConfig.tma=True is not valid: .*stages must be 2..8"):
        cukv.BatchDecode(8, 2, 128, 16, kv_dtype="fp8_e4m3", stages=0, tma=True)


@pytest.mark.parametrize("layout", ["combined", "separate", "head_major"])
def test_tma_cache_bytes_view(layout):
    """What the tensor maps are encoded over: K/V as bytes [pages][page_size][heads][head_dim * 2] whatever the
    cache's strides (NumPy stands in for the device arrays; the driver's stride rules hold)."""
    from types import SimpleNamespace

    import numpy as np

    from cukv.ops.decode import _page_bytes
    from cukv.tma import check_page_tensor

    pages, ps, h, d = 5, 16, 8, 128
    if layout == "combined":
        k = np.zeros((pages, 2, ps, h, d), np.uint16)[:, 0]
    elif layout == "separate":
        k = np.zeros((pages, ps, h, d), np.uint16)
    else:  # [pages, heads, page_size, dim] seen as [pages, page_size, heads, dim]
        k = np.zeros((pages, h, ps, d), np.uint16).transpose(0, 2, 1, 3)
    shape, strides = _page_bytes(SimpleNamespace(shape=k.shape, strides=k.strides, itemsize=2))
    assert shape == (pages, ps, h, 2 * d) and strides == k.strides[:3] + (1,)
    check_page_tensor("cache.k", 1 << 20, shape, strides)
    bad = np.zeros((pages, ps, h, 2 * d), np.uint16)[..., ::2]
    with pytest.raises(ValueError, match="unit dim stride"):
        _page_bytes(SimpleNamespace(shape=bad.shape, strides=bad.strides, itemsize=2))


@pytest.mark.parametrize("sb", [32, 64])
def test_fp8_tma_refuses_block_scales(sb):
    with pytest.raises(ValueError, match="scale_block"):
        decode_config("bfloat16", 128, 4, 16, kv_dtype="fp8_e4m3", scale_block=sb, stages=2, tma=True)
