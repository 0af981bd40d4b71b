"""PrefillConfig / KVBufferConfig over their whole domain (no GPU): every point either raises a ValueError that
names the field, or renders (StrictUndefined) with derived sizes that keep their documented relations; a few
valid points compile for sm_90a without spills and within the shared-memory limit."""
import dataclasses
import itertools
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cukv.operand import PREFILL_ARGS
from cukv.configs.prefill import HEAD_DIMS, SMEM_LIMIT, KVBufferConfig, PrefillConfig
from cukv.policy.prefill import DEFAULTS, pv_wait_16bit, tile_config

DTYPES = ("bfloat16", "float16")
PAGE_SIZES = (0, 1, 16, 48)
BMS = (64, 128, 192)
BNS = tuple(range(16, 257, 16))
BKS = (64, 128, 192, 256)
STAGES = tuple(range(2, 9))
FIELD_RE = re.compile(r"(PrefillConfig|KVBufferConfig)\.(\w+)=")


def _accepts(**kw) -> bool:
    try:
        KVBufferConfig(**kw)
        return True
    except ValueError:
        return False


#: the BN the staging ring takes (one cache row per producer lane and step): whole 16-row groups from 16 up
KV_BNS = tuple(bn for bn in range(1, 513) if _accepts(BN=bn, BK=64, depth=64, stages=2))


def _round64(n):
    return -(-n // 64) * 64


def shape_args():
    return st.fixed_dictionaries({
        "dtype": st.sampled_from(DTYPES), "head_dim": st.sampled_from(HEAD_DIMS),
        "page_size": st.sampled_from(PAGE_SIZES), "BM": st.sampled_from(BMS), "BN": st.sampled_from(BNS),
        "BK": st.sampled_from(BKS), "stages": st.sampled_from(STAGES), "pingpong": st.booleans(),
        "tma": st.booleans(), "pv_wait": st.booleans()})


def valid_args():
    return st.builds(lambda shape, dtype, ps: dict(zip(("head_dim", "BM", "BN", "BK", "stages"), shape), dtype=dtype,
                                                   page_size=ps),
                     st.sampled_from(VALID), st.sampled_from(DTYPES), st.sampled_from(PAGE_SIZES))


def _documented_violations(a):
    """(must, may): fields whose documented KVBuffer / shared-memory rule the point certainly breaks, and
    those it may break (shared memory within the alignment slack and barriers of the limit). The register
    budget rule on BN is left to the config: it tracks the kernel."""
    d, bk = a["head_dim"], a["BK"]
    must = set()
    if not (bk == _round64(d) or (bk < d and d % bk == 0)):
        must.add("BK")  # the head rounded up to whole 64-dim atoms (full_kv), or a divisor of it (streamed)
    elif a["stages"] < -(-d // bk) + 1:
        must.add("stages")  # a tile's K elements plus the previous tile's V element
    if a.get("pingpong") and a["BM"] < 128:
        must.add("pingpong")  # the ring orders two or three consumer warpgroups
    if a.get("tma") and math.gcd(a["page_size"], a["BN"] // 4) % 8:
        must.add("tma")  # a box is whole 8-row swizzle groups of one page (if paged) and of a producer warp's rows
    q_and_ring = a["BM"] * _round64(d) * 2 + a["stages"] * a["BN"] * bk * 2
    if q_and_ring > SMEM_LIMIT:
        must.add("smem")
    may = must | ({"smem"} if q_and_ring + 1024 + 17 * 8 > SMEM_LIMIT else set())
    return must, may


def _valid_shapes():
    """Every valid (head_dim, BM, BN, BK, stages): validity depends on neither dtype nor page size."""
    out = []
    for d, bm, bn, bk, s in itertools.product(HEAD_DIMS, BMS, BNS, BKS, STAGES):
        try:
            PrefillConfig("bfloat16", d, 16, bm, bn, bk, s)
        except ValueError:
            continue
        out.append((d, bm, bn, bk, s))
    return out


VALID = _valid_shapes()


# compiled into the session's fresh cache (reports from this run's NVRTC), with no autotune records in the way
pytestmark = pytest.mark.usefixtures("fresh_kernel_cache")


def test_bn_domain():
    assert KV_BNS == tuple(range(16, KV_BNS[-1] + 1, 16)) and KV_BNS[-1] >= 128, KV_BNS


def test_every_head_dim_has_valid_shapes_and_a_valid_default():
    assert {v[0] for v in VALID} == set(HEAD_DIMS)
    for d in HEAD_DIMS:  # VALID leaves pv_wait off; d256's default rings one tile and needs it
        cfg = tile_config("bfloat16", d, 16, *DEFAULTS[d])
        assert (d, *DEFAULTS[d]) in VALID or (cfg.pv_wait and d == 256), d
    assert len(VALID) > 200


# ----------------------------------------------------------------------------------------------
# the whole domain


@given(st.one_of(shape_args(), st.deferred(valid_args)))  # about half the draws are valid points
def test_every_point_raises_naming_a_field_or_renders(a):
    must, may = _documented_violations(a)
    try:
        cfg = PrefillConfig(**a)
    except ValueError as e:
        m = FIELD_RE.search(str(e))
        assert m, f"message names no field: {e}"
        field = m.group(2)
        if field == "smem":  # a derived size: the message must say which fields to lower
            assert "smem" in may and all(f in str(e) for f in ("stages", "BN", "BM")), str(e)
        else:
            assert field in {f.name for f in dataclasses.fields(PrefillConfig)}, str(e)
            assert str(a[field]) in str(e), str(e)  # ... and the value
            # fields outside `may` fall to BN's own range or to measured register rules, which track the kernel
        return
    assert not must, f"{cfg} breaks the documented rules {must}"
    src = cfg.render()
    assert cfg.name in src and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", cfg.name)
    kb = cfg.kv_buffer
    want = {"num_repeats": kb.num_repeats, "smem_stage_size": kb.smem_stage_size, "num_k_tiles": kb.num_k_tiles,
            "num_k_mmas2": kb.num_k_mmas2, "full_kv": "true" if kb.full_kv else "false",
            "num_threads": cfg.num_threads, "num_v_slices": cfg.num_v_slices, "PrefillArgs": PREFILL_ARGS.itemsize}
    asserts = [ln for ln in src.splitlines() if ln.startswith("static_assert(")]
    for what, value in want.items():
        line = next((ln for ln in asserts if f'"{what}' in ln), None)
        assert line is not None, f"no static_assert checks {what}"
        assert f"== {value}," in line, (what, value, line)
    assert ("__nv_bfloat16" if cfg.dtype == "bfloat16" else "__half") in src
    # the traits struct the kernel reads, one named member per field and decision
    members = {"head_dim": cfg.head_dim, "BM": cfg.BM, "BN": cfg.BN, "BK": cfg.BK, "stages": cfg.stages,
               "page_size": cfg.page_size, "tma_rows": cfg.tma_rows, "pingpong": str(cfg.pingpong).lower(),
               "pv_wait": str(cfg.pv_wait).lower(), "smem_bytes": cfg.smem_bytes,
               "producer_regs": cfg.producer_registers, "consumer_regs": cfg.consumer_registers}
    for member, value in members.items():
        assert re.search(rf"\b{member} = {value}[,;]", src), (member, value)
    assert cfg.render() == src  # deterministic: the cache key depends on it


@given(st.sampled_from(VALID), st.sampled_from(DTYPES), st.sampled_from(PAGE_SIZES))
def test_derived_sizes(shape, dtype, page_size):
    cfg = PrefillConfig(dtype, shape[0], page_size, *shape[1:])
    kb, d = cfg.kv_buffer, cfg.head_dim
    assert (kb.dtype, kb.BN, kb.BK, kb.depth, kb.stages) == (cfg.dtype, cfg.BN, cfg.BK, d, cfg.stages)
    assert kb.bk_smem == 64 and kb.BK % kb.bk_smem == 0
    assert kb.num_repeats == cfg.BK // 64
    assert kb.smem_cols == cfg.BK and kb.smem_stage_size == cfg.BN * cfg.BK and kb.stage_bytes == 2 * kb.smem_stage_size
    assert kb.num_k_tiles == -(-d // cfg.BK)
    assert kb.full_kv == (cfg.BK >= d) == (kb.num_k_tiles == 1)
    assert kb.full_kv or d % cfg.BK == 0  # a streamed head splits into whole BK blocks
    assert kb.num_k_mmas2 == cfg.BK // 16
    assert kb.zero_partial_tile_pad == (d % 64 != 0)
    assert cfg.stages >= kb.num_k_tiles + 1
    assert cfg.num_threads == 128 * (cfg.BM // 64 + 1)  # one producer warpgroup + BM / 64 consumers
    assert cfg.v_cols == min(d, cfg.BK) and cfg.num_v_slices * cfg.v_cols == d
    assert cfg.num_v_slices == (1 if kb.full_kv else d // cfg.BK)
    assert cfg.smem_bytes <= SMEM_LIMIT
    assert cfg.smem_bytes >= cfg.BM * _round64(d) * 2 + cfg.stages * kb.stage_bytes  # Q tile + ring, at least
    assert cfg.name == (f"cukv_prefill_{'bf16' if cfg.dtype == 'bfloat16' else 'f16'}_d{d}_p{cfg.page_size}"
                        f"_m{cfg.BM}_n{cfg.BN}_k{cfg.BK}_s{cfg.stages}")


@given(st.sampled_from(VALID), st.sampled_from(VALID), st.sampled_from(PAGE_SIZES), st.sampled_from(PAGE_SIZES))
def test_names_identify_configs(a, b, pa, pb):
    ca, cb = PrefillConfig("bfloat16", a[0], pa, *a[1:]), PrefillConfig("float16", b[0], pb, *b[1:])
    assert ca.name != cb.name
    cb16 = PrefillConfig("bfloat16", b[0], pb, *b[1:])
    assert (ca.name == cb16.name) == (ca == cb16)


# ----------------------------------------------------------------------------------------------
# a few valid points compile cleanly

# Every valid BM 128/192 shape at head_dim 192 and 256 (page sizes 0, 1, 16, 48, with and without tensor copies) and
# every BM 64 one with BN >= 96 compiled without spills once PrefillConfig took in the three rules that sweep found
# (BM=128 with whole elements of 48-80 rows and no tensor copies at depths 3 and 5-7; BM=64, d256, BN=128
# at depth 3; d192 with BK=64 and BN=128 beside two or more consumer warpgroups). The sample below draws from the
# whole valid domain; test_gaps_of_the_domain pins the points the sweep found.


def _check_compiles(cfg):
    mod = cfg.compiled
    assert cfg.name in mod.functions, f"no resource report for {cfg.name}: {sorted(mod.functions)}"
    r = mod.functions[cfg.name]
    assert r.spill_stores == 0 and r.spill_loads == 0, f"{cfg.name} spills: {r}"
    assert r.stack_frame == 0, f"{cfg.name} has a stack frame: {r}"
    assert r.static_smem == 0, r  # everything is dynamic shared memory, sized by smem_bytes
    assert cfg.smem_bytes <= SMEM_LIMIT == 232448


@settings(max_examples=6)
@given(st.sampled_from(VALID), st.sampled_from(DTYPES), st.sampled_from(PAGE_SIZES))
def test_valid_points_compile_without_spills(shape, dtype, page_size):
    _check_compiles(PrefillConfig(dtype, shape[0], page_size, *shape[1:]))


def test_defaults_compile_without_spills_at_odd_page_sizes():
    """Page sizes 16 and 0 are the shipped specializations (test_shipped); 1 and 48 have their own row math."""
    from cukv.autotune import _compile_reports

    cfgs = [PrefillConfig("bfloat16", d, ps, *DEFAULTS[d], pv_wait=pv_wait_16bit("bfloat16", d, *DEFAULTS[d][1:]))
            for d in HEAD_DIMS for ps in (1, 48)]
    _compile_reports(cfgs, jobs=2)  # into the disk cache, two processes at a time
    for cfg in cfgs:
        _check_compiles(cfg)


@pytest.mark.parametrize("args,field", [
    (("bfloat16", 192, 16, 128, 64, 192, 3), "stages"), (("bfloat16", 256, 16, 128, 80, 256, 3), "stages"),
    (("bfloat16", 256, 48, 128, 48, 256, 6), "stages"), (("bfloat16", 256, 1, 64, 128, 256, 3), "stages"),
    (("bfloat16", 192, 16, 192, 128, 64, 4), "BN"), (("bfloat16", 192, 0, 128, 128, 64, 4), "BN")],
    ids=["d192_m128_n64_s3", "d256_m128_n80_s3", "d256_m128_n48_s6_p48", "d256_m64_n128_s3_p1", "d192_m192_n128_k64",
         "d192_m128_n128_k64_p0"])
def test_gaps_of_the_domain(args, field):
    """Points the compile sweep found spilling: the domain names the field that excludes them."""
    with pytest.raises(ValueError, match=rf"PrefillConfig\.{field}="):
        PrefillConfig(*args)


@pytest.mark.compile_ahead(build=lambda args, tma: PrefillConfig(*args, tma=tma))
@pytest.mark.parametrize("args,tma", [(("bfloat16", 192, 16, 128, 64, 192, 3), True),
                                      (("bfloat16", 256, 16, 128, 64, 256, 5), True),
                                      (("bfloat16", 192, 16, 128, 64, 192, 2), False),
                                      (("bfloat16", 192, 16, 128, 112, 64, 4), False)],
                         ids=["d192_m128_n64_s3_tma", "d256_m128_n64_s5_tma", "d192_m128_n64_s2", "d192_m128_n112_k64"])
def test_neighbours_of_the_gaps_stay_valid_and_compile(args, tma):
    _check_compiles(PrefillConfig(*args, tma=tma))


# ----------------------------------------------------------------------------------------------
# invalid fields


@pytest.mark.parametrize("field,value", [
    ("dtype", "float32"), ("dtype", "bf16"), ("dtype", None), ("dtype", 16),
    ("head_dim", 100), ("head_dim", 0), ("head_dim", 32), ("head_dim", 1024), ("head_dim", -128),
    ("head_dim", True), ("head_dim", "128"), ("head_dim", 128.0),
    ("page_size", -1), ("page_size", 4097), ("page_size", True), ("page_size", "16"), ("page_size", 16.0),
    ("BM", 32), ("BM", 256), ("BM", 0), ("BM", True), ("BM", "128"), ("BM", 128.0),
    ("BN", 8), ("BN", 24), ("BN", 136), ("BN", 272), ("BN", 0), ("BN", True), ("BN", "128"), ("BN", 128.0),
    ("BK", 32), ("BK", 96), ("BK", 512), ("BK", 0), ("BK", True), ("BK", "128"), ("BK", 128.0),
    ("stages", 1), ("stages", 9), ("stages", 0), ("stages", True), ("stages", "4"), ("stages", 4.0),
])
def test_invalid_field_is_named(field, value):
    named = rf"(PrefillConfig|KVBufferConfig)\.{field}={re.escape(repr(value))} is not valid"
    with pytest.raises(ValueError, match=named):
        PrefillConfig(**{field: value})


@pytest.mark.parametrize("head_dim,BK", [(128, 256), (64, 128), (80, 64), (96, 64), (96, 192), (192, 128),
                                          (512, 192), (256, 192)])
def test_wrong_bk_for_head_dim(head_dim, BK):
    """BK is the head rounded up to 64 (full_kv) or a smaller divisor of it (streamed): nothing else."""
    with pytest.raises(ValueError, match=rf"KVBufferConfig\.BK={BK} is not valid: must be the head dim rounded up"):
        PrefillConfig(head_dim=head_dim, BK=BK, stages=8, BN=16, BM=64)


def test_too_few_stages_for_streamed_blocks():
    with pytest.raises(ValueError, match=r"KVBufferConfig\.stages=2 is not valid: must be >= num_k_tiles \+ 1 = 3"):
        PrefillConfig(head_dim=128, BK=64, stages=2)
    PrefillConfig(head_dim=128, BK=64, stages=3, BN=64)
    with pytest.raises(ValueError, match=r"stages=4 .* >= num_k_tiles \+ 1 = 5"):
        PrefillConfig(head_dim=512, BK=128, stages=4, BM=64, BN=16)


def test_shared_memory_limit_is_named():
    with pytest.raises(ValueError, match=r"PrefillConfig\.smem=\d+ is not valid: .* exceed 232448; lower stages"):
        PrefillConfig(head_dim=256, BK=256, BN=128, stages=8, BM=64)


@pytest.mark.parametrize("field,value", [
    ("dtype", "float32"), ("BN", 8), ("BN", True), ("BK", 32), ("BK", True), ("depth", 8), ("depth", 100),
    ("depth", 528), ("depth", True), ("stages", 1), ("stages", 9), ("stages", 4.0), ("transpose", 1),
    ("transpose", None), ("swizzle", 64), ("swizzle", True), ("cache_depth", 64), ("cache_depth", 5000),
    ("head_dim_offset", -1), ("head_dim_offset", 1),
])
def test_kv_buffer_invalid_field_is_named(field, value):
    with pytest.raises(ValueError, match=rf"KVBufferConfig\.{field}={re.escape(repr(value))} is not valid"):
        KVBufferConfig(**{field: value})


@given(st.integers(1, 40).map(lambda i: 16 * i), st.sampled_from(KV_BNS), st.sampled_from(BKS),
       st.sampled_from(STAGES), st.integers(0, 512))
def test_kv_buffer_domain(depth, BN, BK, stages, extra):
    """KVBufferConfig alone (MAX's KVBuffer parameters): valid exactly where the documented rules hold; a
    wider cache row (cache_depth) with a head_dim_offset reads a column window of it."""
    full = BK == _round64(depth)
    ok = depth <= 512 and (full or (BK < depth and depth % BK == 0)) and stages >= -(-depth // BK) + 1
    kw = dict(BN=BN, BK=BK, depth=depth, stages=stages)
    if not ok:
        with pytest.raises(ValueError, match=r"KVBufferConfig\.(depth|BK|stages)="):
            KVBufferConfig(**kw)
        return
    kb = KVBufferConfig(**kw, cache_depth=depth + extra, head_dim_offset=extra)
    assert kb.full_kv == full and kb.num_k_tiles == (1 if full else depth // BK)
    assert kb.num_repeats * 64 == BK and kb.smem_stage_size == BN * BK and kb.num_k_mmas2 == BK // 16
    with pytest.raises(ValueError, match=r"KVBufferConfig\.head_dim_offset="):
        KVBufferConfig(**kw, cache_depth=depth + extra, head_dim_offset=extra + 1)


def test_configs_are_frozen_and_hashable():
    cfg = PrefillConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.BM = 64
    assert {cfg: 1}[PrefillConfig()] == 1 and {cfg.kv_buffer: 1}[KVBufferConfig()] == 1


@pytest.mark.parametrize("args, match", [
    ((4, 3, 128), r"num_qo_heads=4 must be a multiple of num_kv_heads=3"),
    ((0, 1, 128), r"num_qo_heads=0 must be a positive integer"),
    ((65536, 1, 128), r"num_qo_heads=65536 exceeds 65535"),  # heads run along the grid's y (work items along x)
])
def test_batch_prefill_refuses_head_counts(args, match):
    import cukv

    with pytest.raises(ValueError, match=match):
        cukv.BatchPrefill(*args, page_size=16)


@pytest.mark.compile_ahead(build=lambda: tile_config("bfloat16", 256, 16, *DEFAULTS[256]))
def test_pv_wait_domain():
    """pv_wait: on by default exactly where the ring holds one tile (d256's 128-key default); it lifts the P-register
    term of the register rule and admits a ring of one tile where that compiles without spills."""
    d256 = tile_config("bfloat16", 256, 16, *DEFAULTS[256])
    assert d256.pv_wait and d256.stages == 2 and d256.name.endswith("_pp_pvw") and d256.persistent
    src = d256.render()
    for member in ("stages = 2", "pingpong = true", "persistent = true", "pv_wait = true"):
        assert member in src, member
    for d in HEAD_DIMS:
        assert tile_config("bfloat16", d, 16, *DEFAULTS[d]).pv_wait is (d == 256), d
    assert not tile_config("bfloat16", 256, 16, 128, 64, 256, 4).pv_wait
    assert tile_config("bfloat16", 128, 16, 128, 128, 128, 2).pv_wait  # a ring of one tile, not a default
    with pytest.raises(ValueError, match=r"PrefillConfig\.stages=2 .*pv_wait=True"):
        dataclasses.replace(d256, pv_wait=False)
    with pytest.raises(ValueError, match=r"PrefillConfig\.pv_wait=1 is not valid"):
        dataclasses.replace(d256, pv_wait=1)
    # launched per item, d192's one-tile ring spills (ptxas): the stages rule keeps it out
    with pytest.raises(ValueError, match=r"PrefillConfig\.stages=2"):
        PrefillConfig("bfloat16", 192, 16, 128, 128, 192, 2, tma=True, pv_wait=True)
    # S + O + P at d256 x 128 keys is over the consumers' budget; with pv_wait P V completes before the next S
    assert d256.register_estimate == 64 + 128
    assert dataclasses.replace(d256, stages=4, BN=64, pv_wait=False).register_estimate == 32 + 128 + 16
    _check_compiles(d256)
