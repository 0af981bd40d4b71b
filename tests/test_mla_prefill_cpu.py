"""MLA prefill without a GPU: MLAPrefillConfig over its whole domain (every point raises a ValueError naming a field,
or renders with the seed's derived sizes in their documented relations), the shipped specializations compile for
sm_90a without spills, and BatchMLAPrefill's host-side argument errors name the argument."""
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cukv import compiler, validate
from cukv.configs.mla_prefill import MLAPrefillConfig
from cukv.policy.mla_prefill import SHIPPED_PAGE_SIZES, shipped
from cukv.configs.prefill import SMEM_LIMIT
from cukv.ops.mla_prefill import BatchMLAPrefill, mla_prefill_flops

FIELD_RE = re.compile(r"MLAPrefillConfig\.(\w+)=")
FIELDS = ("dtype", "BM", "BN", "stages", "page_size", "pingpong", "pv_wait", "persistent", "tma", "tma_store", "lazy_rescale",
          "smem")

pytestmark = pytest.mark.usefixtures("fresh_kernel_cache")


def config_args():
    """Drawn field by field from each field's domain and a little past it (so hypothesis can shrink)."""
    return st.fixed_dictionaries({
        "dtype": st.sampled_from(("bfloat16", "float16", "float32")),
        "BM": st.sampled_from((32, 64, 128, 192, 256)),
        "BN": st.sampled_from(tuple(range(0, 161, 8))),
        "stages": st.integers(0, 9),
        "page_size": st.sampled_from((-1, 0, 1, 16, 48, 64, 4096, 4097)),
        "pingpong": st.booleans(),
        "pv_wait": st.booleans(),
        "persistent": st.sampled_from((False, True, 1)),
        "tma": st.sampled_from((False, True, None)),
        "tma_store": st.sampled_from((False, True, "yes")),
        "lazy_rescale": st.sampled_from((False, True, 0)),
    })


@given(config_args())
def test_every_point_raises_naming_a_field_or_renders(a):
    try:
        cfg = MLAPrefillConfig(**a)
    except ValueError as e:
        m = FIELD_RE.search(str(e))
        assert m and m.group(1) in FIELDS, str(e)
        return
    src = cfg.render()
    assert cfg.name in src and "{{" not in src
    assert cfg.k_elements == cfg.BN * 192 and cfg.v_elements == cfg.BN * 128
    assert cfg.k_bytes == cfg.k_nope_bytes + cfg.k_rope_bytes == cfg.kv_buffer.stage_bytes
    assert cfg.v_bytes == cfg.k_nope_bytes == 2 * cfg.k_rope_bytes
    assert cfg.num_kv_stages == cfg.stages and cfg.num_qk_stages == 1
    assert cfg.smem_bytes <= SMEM_LIMIT and cfg.num_threads == (cfg.BM // 64 + 1) * 128
    for key in ("k_nope_bytes", "k_rope_bytes", "k_bytes", "v_bytes", "k_elements", "v_elements", "num_kv_stages"):
        assert f"== {getattr(cfg, key)}, \"{key}\"" in src
    assert ("_pers" in cfg.name) == cfg.persistent and ("OnceArgs once" in src) == cfg.persistent
    assert ("_tma" in cfg.name) == cfg.tma and ("MLAPrefillMaps maps" in src) == cfg.tma
    assert ("_st" in cfg.name) == cfg.tma_store and ("CUtensorMap omap" in src) == cfg.tma_store
    assert cfg.out_bytes == (cfg.BM * 256 if cfg.tma_store else 0)
    assert cfg.name.endswith("_lr") == cfg.lazy_rescale
    assert f"lazy_rescale = {'true' if cfg.lazy_rescale else 'false'};" in src
    assert not cfg.persistent or cfg.BM >= 128
    if cfg.tma:  # boxes of whole 8-row swizzle groups, the rope's within a page (0: by cp.async)
        assert cfg.tma_rows == cfg.BN // 4 and cfg.tma_rows % 8 == 0
        r = cfg.rope_tma_rows
        assert r == 0 or (r % 8 == 0 and cfg.tma_rows % r == 0 and (cfg.page_size == 0 or cfg.page_size % r == 0))
    else:
        assert cfg.tma_rows == cfg.rope_tma_rows == 0


@given(config_args(), config_args())
def test_names_identify_configs(a, b):
    try:
        ca, cb = MLAPrefillConfig(**a), MLAPrefillConfig(**b)
    except ValueError:
        return
    assert (ca.name == cb.name) == (ca == cb)


def test_shipped_set():
    names = [c.name for c in shipped()]
    assert len(names) == len(set(names)) == 2 * 2 * len(SHIPPED_PAGE_SIZES)  # dtypes x (TILE, WIDE_TILE)


def _grid_variant(dtype, page_size, persistent, tma, stages):
    """The default tile on the persistent grid and/or with the tensor-copy producer."""
    import dataclasses

    from cukv.policy.mla_prefill import default_config

    # off the persistent grid a one-tile ring of 128 keys needs pv_wait (the config's stages rule)
    return dataclasses.replace(default_config(dtype, page_size), persistent=persistent, tma=tma, stages=stages,
                               pv_wait=not persistent or default_config(dtype, page_size).pv_wait)


def _tma_store_variant(dtype, page_size, persistent, tma, stages):
    """The default tile with its output through shared memory by TMA."""
    import dataclasses

    from cukv.policy.mla_prefill import default_config

    base = default_config(dtype, page_size)
    return dataclasses.replace(base, persistent=persistent, tma=tma, stages=stages, tma_store=True,
                               pv_wait=base.pv_wait or not persistent)  # the stages rule off the persistent grid


@pytest.mark.compile_ahead(build=lambda cfg: cfg, arch="sm_90a")
@pytest.mark.parametrize("cfg", shipped(), ids=lambda c: c.name)
def test_shipped_compiles_without_spills(cfg):
    mod = compiler.compile_source(cfg.name, cfg.render(), arch="sm_90a")
    f = mod.functions[cfg.name]
    assert f.spills == 0 and f.stack_frame == 0, f


@pytest.mark.compile_ahead(build=_grid_variant, arch="sm_90a")
@pytest.mark.parametrize("persistent,tma,stages", [(True, False, 2), (False, True, 2), (True, True, 2), (True, True, 3)],
                         ids=["pers", "tma", "pers_tma", "pers_tma_s3"])
@pytest.mark.parametrize("page_size", SHIPPED_PAGE_SIZES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_grid_and_tma_variants_compile_without_spills(dtype, page_size, persistent, tma, stages):
    """The persistent grid and the tensor-copy producer over the default tile, every shipped rope source."""
    cfg = _grid_variant(dtype, page_size, persistent, tma, stages)
    f = compiler.compile_source(cfg.name, cfg.render(), arch="sm_90a").functions[cfg.name]
    assert f.spills == 0 and f.stack_frame == 0, f


@pytest.mark.compile_ahead(build=_tma_store_variant, arch="sm_90a")
@pytest.mark.parametrize("persistent,tma,stages", [(True, True, 3), (False, False, 2), (False, True, 2)],
                         ids=["pers_tma_s3", "base", "tma"])
@pytest.mark.parametrize("page_size", SHIPPED_PAGE_SIZES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tma_store_variants_compile_without_spills(dtype, page_size, persistent, tma, stages):
    """The output through shared memory by TMA beside the default tile (the persistent grid with tensor copies) and
    beside one block per item, every shipped rope source."""
    cfg = _tma_store_variant(dtype, page_size, persistent, tma, stages)
    assert cfg.out_bytes == 128 * 128 * 2 and cfg.smem_bytes <= SMEM_LIMIT
    f = compiler.compile_source(cfg.name, cfg.render(), arch="sm_90a").functions[cfg.name]
    assert f.spills == 0 and f.stack_frame == 0, f


def test_tma_store_errors():
    with pytest.raises(ValueError, match=r"MLAPrefillConfig\.tma_store=True .*49152-byte output staging .* over 232448"):
        MLAPrefillConfig("bfloat16", BM=192, BN=96, stages=3, pv_wait=True, pingpong=True, persistent=True,
                         tma=True, tma_store=True)
    MLAPrefillConfig("bfloat16", BM=192, BN=96, stages=3, pv_wait=True, pingpong=True, persistent=True, tma=True)
    with pytest.raises(ValueError, match=r"MLAPrefillConfig\.tma_store=1"):
        MLAPrefillConfig("bfloat16", tma_store=1)
    assert MLAPrefillConfig("bfloat16", BM=64, tma_store=True).out_bytes == 64 * 256


def test_persistent_and_tma_errors():
    with pytest.raises(ValueError, match=r"MLAPrefillConfig\.persistent=True .*BM >= 128, not 64"):
        MLAPrefillConfig("bfloat16", BM=64, persistent=True)
    with pytest.raises(ValueError, match=r"MLAPrefillConfig\.tma=True .*multiple of 32, not 48"):
        MLAPrefillConfig("bfloat16", BN=48, tma=True)
    with pytest.raises(ValueError, match=r"MLAPrefillConfig\.tma=1"):
        MLAPrefillConfig("bfloat16", tma=1)
    with pytest.raises(ValueError, match="max_blocks"):
        BatchMLAPrefill(16, max_blocks=0)
    cfg = MLAPrefillConfig("bfloat16", BN=128, stages=2, pv_wait=True, page_size=48, tma=True)
    assert (cfg.tma_rows, cfg.rope_tma_rows) == (32, 16)
    assert MLAPrefillConfig("bfloat16", BN=128, stages=2, pv_wait=True, page_size=1, tma=True).rope_tma_rows == 0
    # three stages of 128 keys: on the persistent grid only
    MLAPrefillConfig("bfloat16", BN=128, stages=3, pv_wait=True, pingpong=True, persistent=True)
    with pytest.raises(ValueError, match=r"MLAPrefillConfig\.stages=3 .*off the persistent grid"):
        MLAPrefillConfig("bfloat16", BN=128, stages=3, pv_wait=True, pingpong=True, tma=True)


# ---- BatchMLAPrefill: errors before any device work


def test_constructor_errors():
    with pytest.raises(ValueError, match="num_heads"):
        BatchMLAPrefill(0)
    with pytest.raises(ValueError, match="page_size"):
        BatchMLAPrefill(16, page_size=0)
    with pytest.raises(ValueError, match="does not match"):
        BatchMLAPrefill(16, page_size=16, config=MLAPrefillConfig(page_size=64))
    with pytest.raises(TypeError, match="MLAPrefillConfig"):
        BatchMLAPrefill(16, config=object())


@pytest.mark.parametrize("kw,match", [
    (dict(kv_offsets=[0, 5, 9]), r"kv_offsets\[2\] - kv_offsets\[1\] = 4, but kv_lengths\[1\]=3"),
    (dict(kv_offsets=[0, 5]), r"kv_offsets has shape"),
    (dict(kv_lengths=[5]), r"kv_lengths has shape"),
    (dict(kv_lengths=[5, -1]), r"kv_lengths"),
    (dict(q_offsets=[1, 2, 3]), r"q_offsets"),
    (dict(q_offsets=[0, 4, 2]), r"q_offsets"),
])
def test_plan_errors_name_the_argument(kw, match):
    """Named errors before any device work (these run without a GPU)."""
    args = dict(q_offsets=[0, 2, 4], kv_lengths=[5, 3])
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        BatchMLAPrefill(16, page_size=16).plan(**args)
    with pytest.raises(ValueError, match=match):
        validate.mla_prefill_batch(args["q_offsets"], args["kv_lengths"], args.get("kv_offsets"))


@pytest.mark.parametrize("tail", [0, 17, 2.5, True])
def test_plan_tail_heads_domain(tail):
    """tail_heads: an integer 1..num_heads, refused by name before any device work."""
    with pytest.raises((ValueError, TypeError), match=r"tail_heads=.* must be"):
        BatchMLAPrefill(16, page_size=16).plan([0, 2, 4], [5, 3], tail_heads=tail)


def test_plan_mask_error():
    with pytest.raises(ValueError, match="mask"):
        BatchMLAPrefill(16).plan([0, 2], [2], mask="sliding")


def test_default_kv_offsets_are_the_running_sum():
    qo, kl, ko = validate.mla_prefill_batch([0, 2, 4], [5, 3])
    assert ko.tolist() == [0, 5, 8]
    assert validate.mla_prefill_batch([0, 2, 4], [5, 3], [7, 12, 15])[2].tolist() == [7, 12, 15]


H, TQ, TK = 16, 10, 24


@pytest.mark.parametrize("shapes,match", [
    (dict(q=(TQ, H, 128)), r"q has width 128 .* takes 192"),
    (dict(q=(TQ, H, 576)), r"q has width 576"),
    (dict(k_nope=(TK, H, 192)), r"k_nope has width 192 .* takes 128"),
    (dict(v=(TK, H, 512)), r"v has width 512 .* takes 128"),
    (dict(k_rope=(TK, 128)), r"k_rope has width 128 .* takes 64"),
    (dict(k_nope=(TK, 8, 128)), r"k_nope has 8 heads .* num_heads=16"),
    (dict(v=(TK, 32, 128)), r"v has 32 heads"),
    (dict(q=(TQ, 8, 192)), r"q has 8 heads"),
    (dict(q=(TQ + 1, H, 192)), r"q has 11 tokens"),
    (dict(v=(TK - 1, H, 128)), r"v has 23 rows"),
    (dict(k_rope=(TK - 1, 64)), r"k_rope has 23 rows"),
    (dict(k_nope=(TK, H)), r"k_nope has shape"),
])
def test_shape_errors_name_the_argument(shapes, match):
    s = dict(q=(TQ, H, 192), k_nope=(TK, H, 128), v=(TK, H, 128), k_rope=(TK, 64))
    s.update(shapes)
    with pytest.raises(ValueError, match=match):
        validate.check_mla_prefill_shapes(H, TQ, TK, s["q"], s["k_nope"], s["v"], s["k_rope"])


def test_page_ids_out_of_range_in_checked_mode():
    """The checked mode's host check of the table (run(check=True) passes these names)."""
    bt = np.array([[3, 1, 7], [0, 2, 9]], np.int32)
    with pytest.raises(ValueError, match=r"block_table\[1, 2\]=9 is not a page of the cache \(0..7\)"):
        validate.check_table(bt, np.array([40, 33]), 16, 8, ("block_table", "kv_lengths"))
    validate.check_table(bt, np.array([40, 32]), 16, 8, ("block_table", "kv_lengths"))  # column 2 unused by row 1
    with pytest.raises(ValueError, match=r"kv_lengths\[0\]=49 needs 4 pages"):
        validate.check_table(bt, np.array([49, 3]), 16, 8, ("block_table", "kv_lengths"))


def test_flops():
    assert mla_prefill_flops(1, 8, 8, 2, causal=False) == 2 * 2 * 64 * 320
    assert mla_prefill_flops(1, 8, 8, 2) == 2 * 2 * 36 * 320
    assert mla_prefill_flops(1, 2, 10, 1) == 2 * (2 * 8 + 3) * 320


# ---- the benchmark's host side


def test_bench_shapes_and_table():
    from cukv.bench import mla_prefill as b
    from cukv.cli import build_parser

    assert [s[0] for s in b.SHAPES][:5] == ["1x128x8192", "4x128x2048", "1x32x8192", "1x16x16384", "4x16x4096"]
    assert set(b.QUICK) <= {s[0] for s in b.SHAPES}
    assert {(s[4], s[5]) for s in b.SHAPES[5:]} == {(16384, "causal"), (16384, "none")}
    r = {"shape": "4x16x4096", "cukv_ms": 1.0, "cukv_tflops": 500.0, "cudnn_ms": 1.2, "cudnn_tflops": 420.0,
         "cukv_over_cudnn": 1.2, "cudnn_max_abs_diff": 1e-3, "flashinfer_ms": None, "flashinfer_error": "x"}
    text = b.format_table({"device": "H100", "peers": "imported", "rows": [r], "geomean_cukv_over_cudnn": 1.2})
    assert "peer/cukv 1.200" in text and "flashinfer failed: x" in text and "geomean_cukv_over_cudnn: 1.200" in text
    assert build_parser().parse_args(["bench", "mla-prefill", "--quick"]).what == "mla-prefill"
