"""Kernel-config dataclasses: every valid point of the domain renders (and a sample compiles cleanly), every
invalid field value is rejected with a ValueError naming the field and the value."""
import dataclasses
import math
import re

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cukv import AppendConfig, DecodeConfig
from cukv.policy.decode import decode_config
from cukv.operand import APPEND_ARGS, DECODE_ARGS

DTYPES = ("bfloat16", "float16")
WARPS = (1, 2, 4, 8)


def _decode_or_none(**kw):
    try:
        return decode_config(**kw)
    except ValueError:  # outside the domain (a launch bound below the kernel's registers)
        return None


def decode_configs(head_dims=st.integers(1, 8).map(lambda i: 32 * i), min_blocks=(1, 2)):
    return st.builds(_decode_or_none, dtype=st.sampled_from(DTYPES), head_dim=head_dims, group=st.integers(1, 16),
                     page_size=st.integers(1, 4096), num_warps=st.sampled_from(WARPS),
                     min_blocks=st.sampled_from(min_blocks)).filter(lambda c: c is not None)


def append_configs():
    return st.builds(AppendConfig, dtype=st.sampled_from(DTYPES), head_dim=st.integers(1, 128).map(lambda i: 8 * i),
                     page_size=st.integers(1, 1 << 16), threads=st.sampled_from((128, 256, 512)))


pytestmark = pytest.mark.usefixtures("fresh_kernel_cache")  # the resource reports below come from this run's NVRTC


# ----------------------------------------------------------------------------------------------
# DecodeConfig: valid domain


@given(decode_configs())
def test_decode_every_valid_config_renders(cfg):
    src = cfg.render()
    assert cfg.name in src
    assert f"void __launch_bounds__({cfg.num_warps * 32}, {cfg.min_blocks}) {cfg.name}(" in src
    assert "static_assert" in src
    # the sizes Python computed are the ones the source re-checks
    if cfg.stages:
        assert f"K::RING_BYTES == {cfg.ring_smem_bytes}," in src
        assert f"K::NO == {cfg.num_mmas}," in src
        assert "typedef DecodeRingKernel<DecodeTraits> K;" in src
    else:
        for member in ("num_k_strips", "num_k_mmas2", "num_mmas", "input_frag_size"):
            assert f"K::Buf::{member} == {getattr(cfg, member)}," in src, member
    assert f"sizeof(K::Smem) == {cfg.smem_bytes}," in src
    assert f"sizeof(DecodeArgs) == {DECODE_ARGS.itemsize}," in src
    # DecodeTraits: the config's fields and decisions by name
    assert (f"static constexpr int page_size = {cfg.page_size}, head_dim = {cfg.head_dim}, group = {cfg.group};"
            in src)
    assert f"static constexpr int num_warps = {cfg.num_warps};" in src
    assert f"static constexpr int stages = {cfg.stages};" in src
    assert f"static constexpr int cluster = {cfg.cluster};" in src
    assert f"static constexpr bool q_in_smem = {'true' if cfg.q_in_smem else 'false'};" in src
    assert f"static constexpr bool warp_slots = {'true' if cfg.warp_slots else 'false'};" in src
    assert ("__nv_bfloat16" if cfg.dtype == "bfloat16" else "__half") in src
    assert cfg.render() == src  # deterministic: the cache key depends on it


@given(decode_configs())
def test_decode_derived_sizes(cfg):
    assert cfg.num_k_strips == cfg.head_dim // 32
    assert cfg.num_mmas == math.ceil(cfg.head_dim / 64) * 8
    assert cfg.input_frag_size == 4
    assert cfg.num_threads == 32 * cfg.num_warps
    assert cfg.num_k_mmas2 == 2
    assert cfg.smem_bytes % 16 == 0
    assert cfg.smem_bytes <= 48 * 1024  # static shared memory: no opt-in needed anywhere in the domain
    short = {"bfloat16": "bf16", "float16": "f16"}[cfg.dtype]
    ring = f"_r{cfg.stages}" if cfg.stages else ""
    assert cfg.name == (f"cukv_decode_{short}_d{cfg.head_dim}_g{cfg.group}_p{cfg.page_size}_w{cfg.num_warps}"
                        f"_b{cfg.min_blocks}{ring}")
    # the default staging: the ring wherever it applies and fits, registers elsewhere
    ring_ok = cfg.page_size % 16 == 0 and cfg.head_dim % 64 == 0
    assert (cfg.stages > 0) == (ring_ok and cfg.num_warps * 2 * 2 * 16 * cfg.head_dim * 2 + cfg.smem_bytes <= 227 * 1024)
    assert cfg.stages in (0, 2, 3)
    assert cfg.total_smem_bytes == cfg.smem_bytes + cfg.ring_smem_bytes <= 227 * 1024
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", cfg.name)  # a C identifier: it is the kernel's entry


@given(decode_configs(), decode_configs())
def test_decode_names_identify_configs(a, b):
    assert (a.name == b.name) == (a == b)


@pytest.mark.parametrize("kw,why", [
    ({"stages": 1}, "accepted"), ({"stages": 9}, "accepted"), ({"stages": -1}, "accepted"),
    ({"stages": 2, "page_size": 24}, "multiple of 16"), ({"stages": 2, "head_dim": 96}, "multiple of 64"),
    ({"stages": 2, "kv_dtype": "fp8_e4m3", "scale_block": 128, "sub": 2}, "replaces sub"),
    ({"stages": 8, "num_warps": 8}, "exceed"),
])
def test_decode_ring_stages_domain(kw, why):
    with pytest.raises(ValueError, match=f"DecodeConfig.stages={kw['stages']!r} is not valid.*{why}"):
        decode_config(**kw)


@settings(max_examples=6)
@given(st.sampled_from((64, 128, 256)), st.sampled_from((1, 4, 8, 16)), st.sampled_from((16, 64)),
       st.sampled_from((2, 4)), st.sampled_from((2, 3, 4)), st.sampled_from(DTYPES))
def test_decode_ring_configs_compile_without_spills(d, group, ps, nw, stages, dt):
    try:
        cfg = decode_config(dt, d, group, ps, nw, stages=stages)
    except ValueError:  # too much shared memory for this (warps, stages, head_dim)
        assume(False)
    _check_resources(cfg)


@pytest.mark.compile_ahead(build=lambda d, stages: decode_config("bfloat16", d, 1, 16, 4, stages=stages))
@pytest.mark.parametrize("stages", [0, None], ids=["registers", "default"])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_decode_every_head_dim_compiles_for_both_stagings(d, stages):
    """Hypothesis samples the domain; this pins every head dim (a d256-only static_assert once slipped by)."""
    _check_resources(decode_config("bfloat16", d, 1, 16, 4, stages=stages))


@pytest.mark.compile_ahead(build=lambda kw: decode_config(**kw))
@pytest.mark.parametrize("kw", [
    {"cluster": 4, "stages": 0}, {"cluster": 8, "stages": 3}, {"cluster": 2, "head_dim": 256, "group": 16, "stages": 0},
    {"cluster": 3, "kv_dtype": "fp8_e4m3", "scale_block": 128},
], ids=lambda kw: "_".join(f"{k}{v}" for k, v in kw.items()))
def test_decode_cluster_merge_compiles_without_spills(kw):
    cfg = decode_config(**kw)
    assert cfg.name.endswith(f"_c{kw['cluster']}")
    src = cfg.render()
    assert f"__cluster_dims__({kw['cluster']}, 1, 1)" in src
    _check_resources(cfg)


@pytest.mark.parametrize("cluster", [1, 9, -2])
def test_decode_cluster_domain(cluster):
    with pytest.raises(ValueError, match=f"DecodeConfig.cluster={cluster!r} is not valid"):
        decode_config(cluster=cluster)


def test_decode_config_is_frozen_and_hashable():
    cfg = decode_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.head_dim = 64
    assert {cfg: 1}[decode_config()] == 1


def _check_resources(cfg):
    mod = cfg.compiled
    assert cfg.name in mod.functions, f"no ptxas report for {cfg.name}: {sorted(mod.functions)}"
    r = mod.functions[cfg.name]
    assert r.spill_stores == 0 and r.spill_loads == 0, f"{cfg.name} spills: {r}"
    assert r.stack_frame == 0, f"{cfg.name} has a stack frame: {r}"
    assert r.static_smem <= 48 * 1024, r
    assert r.static_smem == cfg.smem_bytes, f"{cfg.name}: ptxas {r.static_smem} B, config {cfg.smem_bytes} B"


@settings(max_examples=6)
@given(decode_configs(head_dims=st.sampled_from((64, 96, 128, 256)), min_blocks=(1, 2, 3, 4)))
def test_decode_valid_configs_compile_without_spills(cfg):
    _check_resources(cfg)


@pytest.mark.parametrize("args", [
    ("bfloat16", 128, 4, 16, 8, 2), ("float16", 96, 1, 16, 8, 2), ("float16", 128, 4, 16, 4, 3),
    ("bfloat16", 64, 16, 16, 4, 4, "fp8_e4m3", 64), ("bfloat16", 64, 1, 16, 8, 3),
], ids=lambda a: "d{1}_g{2}_p{3}_w{4}_b{5}".format(*a) + ("_fp8" if len(a) > 6 else ""))
def test_decode_spilling_corners_are_outside_the_domain(args):
    """Launch bounds that leave fewer registers than the kernel needs spilled (ptxas, sm_90a sweep):
    the config names min_blocks, the cap and the need."""
    kw = dict(zip(("kv_dtype", "scale_block"), args[6:]))
    with pytest.raises(ValueError, match=r"DecodeConfig.min_blocks=\d is not valid: with num_warps=\d caps registers "
                                         r"at \d+ per thread .*below the \d+ this kernel needs"):
        decode_config(*args[:6], stages=0, **kw)


def _capped_config(args, stages):
    kw = {"kv_dtype": "fp8_e4m3", "scale_block": 128} if args[1] == 128 else {}
    return decode_config(*args, stages=stages, **kw)


@pytest.mark.compile_ahead(build=_capped_config)
@pytest.mark.parametrize("args,stages", [
    (("bfloat16", 64, 16, 16, 4, 3), 0), (("float16", 64, 7, 16, 8, 2), None), (("bfloat16", 64, 5, 1, 4, 4), 0),
    (("bfloat16", 128, 12, 16, 4, 3), None), (("bfloat16", 32, 16, 16, 8, 2), 0),
], ids=lambda a: "_".join(map(str, a)) if isinstance(a, tuple) else f"stages{a}")
def test_decode_capped_launch_bounds_that_the_domain_keeps_compile_without_spills(args, stages):
    """The other side of min_registers: points it lets through under a cap of 168 or 128, beside the swept ones
    (other groups, page size 1, d32, float16)."""
    cfg = _capped_config(args, stages)
    assert cfg.register_cap < 255
    _check_resources(cfg)


@pytest.mark.compile_ahead(build=lambda group: decode_config("bfloat16", 256, group, 16, kv_dtype="fp8_e4m3",
                                                             scale_block=64))
@pytest.mark.parametrize("group", [9, 16])
def test_decode_fp8_64_dim_blocks_past_d128_take_the_ring(group):
    """The register kernel spills there (64-128 bytes, ptxas, every warp count); BatchDecode then plans with the
    ring alone."""
    kw = dict(kv_dtype="fp8_e4m3", scale_block=64)
    with pytest.raises(ValueError, match=r"DecodeConfig.stages=0 is not valid: .*64-dim scale blocks"):
        decode_config("bfloat16", 256, group, 16, stages=0, **kw)
    cfg = decode_config("bfloat16", 256, group, 16, **kw)
    assert cfg.stages > 0
    _check_resources(cfg)
    from cukv import BatchDecode

    dec = BatchDecode(group * 2, 2, 256, 16, kv_dtype="fp8_e4m3", scale_granularity=64)
    assert dec._configs == (dec.config,) and dec.config.stages > 0


# ----------------------------------------------------------------------------------------------
# DecodeConfig: invalid fields


@pytest.mark.parametrize("field,value", [
    ("dtype", "float32"), ("dtype", "bf16"), ("dtype", None),
    ("head_dim", 100), ("head_dim", 0), ("head_dim", 16), ("head_dim", 288), ("head_dim", -64), ("head_dim", "128"),
    ("head_dim", 128.0),
    ("group", 0), ("group", 17), ("group", -1),
    ("page_size", 0), ("page_size", 4097), ("page_size", -16),
    ("num_warps", 3), ("num_warps", 0), ("num_warps", 16),
    ("min_blocks", 0), ("min_blocks", 5),
    ("BN", 32), ("BN", 8), ("BK", 64), ("BK", 16),
])
def test_decode_invalid_field_is_named(field, value):
    with pytest.raises(ValueError, match=re.escape(f"DecodeConfig.{field}={value!r} is not valid")):
        decode_config(**{field: value})


@given(st.sampled_from(["head_dim", "group", "page_size", "num_warps"]), st.integers(-10_000, 10_000))
def test_decode_invalid_integers_rejected(field, value):
    ok = {"head_dim": 32 <= value <= 256 and value % 32 == 0, "group": 1 <= value <= 16,
          "page_size": 1 <= value <= 4096, "num_warps": value in WARPS}[field]
    if ok:
        assert getattr(decode_config(**{field: value}), field) == value
    else:
        with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}")):
            decode_config(**{field: value})


def test_decode_bool_dims_rejected():
    for field in ("head_dim", "group", "page_size"):
        with pytest.raises(ValueError, match=f"{field}=True"):
            decode_config(**{field: True})


@pytest.mark.parametrize("cls,field,value", [
    (DecodeConfig, "num_warps", 4.0), (DecodeConfig, "num_warps", True), (DecodeConfig, "min_blocks", 2.0),
    (DecodeConfig, "BN", 16.0), (AppendConfig, "threads", 256.0),
])
def test_non_int_values_equal_to_allowed_ints_rejected(cls, field, value):
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}")):
        cls(**{field: value})


def test_decode_error_lists_accepted_values():
    with pytest.raises(ValueError, match=r"accepted: 1, 2, 4, 8"):
        decode_config(num_warps=3)
    with pytest.raises(ValueError, match=r"accepted: integers 1\.\.16"):
        decode_config(group=17)
    with pytest.raises(ValueError, match=r"multiple of 32"):
        decode_config(head_dim=100)


# ----------------------------------------------------------------------------------------------
# AppendConfig


@given(append_configs())
def test_append_every_valid_config_renders(cfg):
    src = cfg.render()
    assert cfg.name in src
    assert "static_assert" in src
    assert f"sizeof(AppendArgs) == {APPEND_ARGS.itemsize}," in src
    assert f"__launch_bounds__({cfg.threads}) {cfg.name}(" in src
    assert f"append_kv<T, {cfg.page_size}, {cfg.head_dim}>" in src
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", cfg.name)


@settings(max_examples=3)
@given(append_configs())
def test_append_valid_configs_compile_without_spills(cfg):
    r = cfg.compiled.functions[cfg.name]
    assert r.spills == 0 and r.stack_frame == 0, r


@pytest.mark.parametrize("field,value", [
    ("dtype", "float32"), ("dtype", "half"),
    ("head_dim", 12), ("head_dim", 0), ("head_dim", 1032), ("head_dim", -8), ("head_dim", 64.0),
    ("page_size", 0), ("page_size", 65537),
    ("threads", 64), ("threads", 1024), ("threads", 0),
])
def test_append_invalid_field_is_named(field, value):
    with pytest.raises(ValueError, match=re.escape(f"AppendConfig.{field}={value!r} is not valid")):
        AppendConfig(**{field: value})


@given(st.integers(-100, 2000))
def test_append_head_dim_domain(value):
    if 8 <= value <= 1024 and value % 8 == 0:
        assert AppendConfig(head_dim=value).head_dim == value
    else:
        with pytest.raises(ValueError, match=re.escape(f"head_dim={value}")):
            AppendConfig(head_dim=value)
