"""MLA decode and cache without a GPU: every shipped specialization compiles for sm_90a without spills, the
config domain, the plan's work list, the references, and named errors."""
import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cukv import compiler, reference
from cukv.configs import mla_append
from cukv.configs.mla_append import MLAAppendConfig
from cukv.configs.mla_decode import PERSISTENT_REGS, MLADecodeConfig
from cukv.configs.sparse_mla import SparseMLAConfig
from cukv.ops.mla_decode import BatchMLADecode
from cukv.policy import mla_decode as mla_decode_policy
from cukv.policy.mla_decode import (DEFAULT_BLOCK_N, DEFAULT_FP8_ROWS, DEFAULT_LAZY_RESCALE, DEFAULT_PREFETCH,
                                    DEFAULT_STAGES, DEFAULT_TMA, NARROW_FP8_PREFETCH, mla_decode_config, plan_items)

ARCH = "sm_90a"
SHIPPED = mla_decode_policy.shipped() + mla_append.shipped()

pytestmark = pytest.mark.usefixtures("fresh_kernel_cache")


@pytest.mark.compile_ahead(build=lambda cfg: cfg, arch=ARCH)
@pytest.mark.parametrize("cfg", SHIPPED, ids=lambda c: c.name)
def test_shipped_mla_compiles_without_spills(cfg):
    mod = compiler.compile_source(cfg.name, cfg.render(), arch=ARCH)
    for name, r in mod.functions.items():
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0, r
    assert cfg.name in mod.functions


@given(dtype=st.sampled_from(["bfloat16", "float16", "float32"]), block_n=st.sampled_from([16, 32, 64, 128]),
       stages=st.integers(0, 10), schedule=st.sampled_from(["split", "alternate", "narrow", "pingpong"]),
       block_rows=st.sampled_from([16, 24, 32, 64]))
def test_config_domain(dtype, block_n, stages, schedule, block_rows):
    valid = (dtype != "float32" and block_n in (32, 64) and 2 <= stages <= 8 and schedule != "pingpong"
             and block_rows in (16, 32, 64) and (block_rows != 64) == (schedule == "narrow")
             and (schedule != "narrow" or block_n == 64))
    if valid:
        smem = (block_rows * 576 * 2 + stages * block_n * 576 * 2 + block_n * 128 + 2048
                + (8 * (2 + 2 * stages) + 63) // 64 * 64)
        valid = smem <= 227 * 1024
    if not valid:
        with pytest.raises(ValueError, match="MLADecodeConfig.(dtype|block_n|num_kv_stages|schedule|block_rows)"):
            MLADecodeConfig(dtype, block_n, stages, schedule=schedule, block_rows=block_rows)
        return
    cfg = MLADecodeConfig(dtype, block_n, stages, schedule=schedule, block_rows=block_rows)
    assert cfg.k_bytes == cfg.k_nope_bytes + cfg.k_rope_bytes == block_n * 576 * 2
    assert cfg.v_bytes == block_n * 512 * 2 and cfg.q_bytes == block_rows * 576 * 2
    assert f"static_assert(Pipe::smem_bytes == {cfg.smem_bytes}" in cfg.render()


def test_fp8_config_rules():
    with pytest.raises(ValueError, match="MLADecodeConfig.kv_dtype"):
        MLADecodeConfig("float16", kv_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="MLADecodeConfig.kv_dtype"):
        MLADecodeConfig(kv_dtype="int8")
    cfg = MLADecodeConfig(kv_dtype="fp8_e4m3")
    assert cfg.row_bytes == 656 and "static_assert(Pipe::row_bytes == 656" in cfg.render()


@pytest.mark.compile_ahead(build=lambda: MLADecodeConfig("bfloat16", 32, 4), arch=ARCH)
def test_config_static_asserts_compile_for_other_shapes():
    cfg = MLADecodeConfig("bfloat16", 32, 4)
    r = compiler.compile_source(cfg.name, cfg.render(), arch=ARCH).functions[cfg.name]
    assert r.spills == 0


PERSISTENT = [MLADecodeConfig("bfloat16", 64, 2, schedule="alternate", tma=True, slice_release=True,
                              lazy_rescale=True, multicast=mc, persistent=True) for mc in (False, True)]


def test_persistent_config_rules():
    with pytest.raises(ValueError, match=r"MLADecodeConfig\.persistent=True is not valid: .*slice_release=True"):
        MLADecodeConfig(persistent=True)
    for heads in (16, 64):  # the narrow and split kernels of few heads: no per-slice ring to carry
        with pytest.raises(ValueError, match=r"MLADecodeConfig\.persistent=True is not valid: .*slice_release=True"):
            BatchMLADecode(heads, persistent=True)
    assert BatchMLADecode(128, persistent=True).config.persistent
    assert [c.name for c in PERSISTENT] == ["cukv_mla_decode_bf16_n64_s2_alt_tma_slices_ps_lr",
                                            "cukv_mla_decode_bf16_n64_s2_alt_tma_slices_mc_ps_lr"]
    assert all(c.regs == PERSISTENT_REGS for c in PERSISTENT)


@pytest.mark.compile_ahead(build=lambda cfg: cfg, arch=ARCH)
@pytest.mark.parametrize("cfg", PERSISTENT, ids=lambda c: c.name)
def test_persistent_compiles_without_spills(cfg):
    """The opt-in persistent blocks (not shipped): the item loop fits the producer's 72 registers."""
    r = compiler.compile_source(cfg.name, cfg.render(), arch=ARCH).functions[cfg.name]
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0, r


@given(lens=st.lists(st.integers(0, 70000), min_size=1, max_size=40), nrb=st.integers(1, 4),
       sms=st.sampled_from([8, 132]), block_n=st.sampled_from([32, 64]))
def test_plan_items_cover_every_token_once(lens, nrb, sms, block_n):
    items, c = plan_items(lens, nrb, block_n, sms)
    assert len(items) <= 2 * sms + len(lens) * nrb
    got = {}
    for b, rb, begin, end, n in items:
        got.setdefault((b, rb), []).append((begin, end, n))
    for b, n_tok in enumerate(lens):
        for rb in range(nrb):
            spans = sorted(got[(b, rb)])
            assert spans[0][0] == 0 and spans[-1][1] == n_tok
            assert all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
            assert all(s[2] == len(spans) for s in spans)
            assert all(s[0] % block_n == 0 for s in spans)
    sizes = [e - s for _, _, s, e, _ in items]
    assert sizes == sorted(sizes, reverse=True)
    if nrb % 2 == 0:  # cluster pairs (MLADecodeConfig.multicast): a chunk's row blocks 2k, 2k + 1 at indices 2i, 2i + 1
        for x, y in zip(items[0::2], items[1::2]):
            assert (x[0], x[2], x[3]) == (y[0], y[2], y[3]) and x[1] % 2 == 0 and y[1] == x[1] + 1


def test_plan_splits_long_single_sequence():
    items, c = plan_items([32768], 2, 64, 132)
    assert 100 <= len(items) <= 264 and c < 512


def test_reference_matches_generic_attention(rng):
    q = rng.standard_normal((2, 3, 4, 576))
    pages = rng.standard_normal((6, 5, 576))
    table = np.array([[4, 1, 2], [0, 3, 5]])
    lens = [13, 6]
    sink = rng.standard_normal(4)
    out, lse = reference.mla_decode(q, pages, table, lens, softmax_scale=0.07, sink=sink)
    for b in range(2):
        rows = reference.gather(pages[:, :, None], table[b], lens[b])  # [n, 1, 576]
        pos = lens[b] - 3 + np.arange(3)
        o, l = reference.attention(q[b].reshape(3, 4, 576), rows, rows[..., :512], pos, sm_scale=0.07, sink=sink)
        np.testing.assert_allclose(out[b], o, atol=1e-12)
        np.testing.assert_allclose(lse[b], l, atol=1e-12)


def test_reference_zero_length_and_causal_edge(rng):
    q = rng.standard_normal((1, 4, 2, 576))
    pages = rng.standard_normal((1, 8, 576))
    out, lse = reference.mla_decode(q, pages, np.zeros((1, 1), int), [2])
    assert np.isinf(lse[0, :2]).all() and (out[0, :2] == 0).all()  # queries 0, 1 see nothing
    assert np.isfinite(lse[0, 2:]).all()


def test_fp8_quantizer_reference(rng):
    from cukv import fp8

    x = (rng.standard_normal((9, 512)) * rng.uniform(1e-3, 1e3, (9, 1))).astype(np.float32)
    x[2] = 0
    pe = rng.standard_normal((9, 64)).astype(np.float32)
    rows = reference.mla_quantize_fp8(x, pe)
    codes, scales = fp8.quantize(x, 128)
    assert np.array_equal(rows[:, :512], codes)
    assert np.array_equal(rows[:, 512:528].copy().view("<f4"), scales)
    p2 = reference.mla_quantize_fp8(x, pe, pow2_scales=True)
    s2 = p2[:, 512:528].copy().view("<f4").astype(np.float64)
    assert np.all(np.log2(s2) == np.round(np.log2(s2))) and np.all(s2 >= scales) and np.all(s2 < 2 * scales)
    deq = reference.mla_dequantize_fp8(p2)
    assert np.all(np.abs(deq[:, :512] - x) <= np.repeat(s2, 128, axis=1) * 16 + 1e-30)
    np.testing.assert_allclose(deq[:, 512:], pe, rtol=2 ** -8)


def test_named_errors_without_gpu():
    with pytest.raises(ValueError, match="num_heads"):
        BatchMLADecode(0)
    with pytest.raises(ValueError, match="num_heads"):
        BatchMLADecode(129)
    with pytest.raises(TypeError, match="dtype"):
        BatchMLADecode(16, "float32")
    with pytest.raises(ValueError, match="block_n"):
        BatchMLADecode(16, block_n=48)
    with pytest.raises(ValueError, match=r"^s_q=1\.5 must be in 1\.\.8"):
        BatchMLADecode(16).plan([5], s_q=1.5)
    with pytest.raises(ValueError, match=r"^seq_lens\[1\]=-1 must be in 0\.\."):
        BatchMLADecode(16).plan([5, -1])
    with pytest.raises(TypeError, match=r"^kv_dtype='fp8_e4m3' needs dtype='bfloat16'"):
        BatchMLADecode(16, "float16", kv_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="pow2_scales"):
        MLAAppendConfig("bfloat16", False, True)


def test_policy_defaults_are_the_configs():
    """BatchMLADecode takes its tile from the policy; the config's own defaults agree with it (64 heads: wider than
    the narrow blocks)."""
    lazy = DEFAULT_LAZY_RESCALE
    assert mla_decode_config() == MLADecodeConfig(tma=DEFAULT_TMA, lazy_rescale=lazy) == BatchMLADecode(64).config
    assert (MLADecodeConfig().block_n, MLADecodeConfig().num_kv_stages) == (DEFAULT_BLOCK_N, DEFAULT_STAGES)
    assert BatchMLADecode(16, block_n=32, num_kv_stages=4).config == MLADecodeConfig("bfloat16", 32, 4, tma=DEFAULT_TMA,
                                                                                     lazy_rescale=lazy)
    assert not BatchMLADecode(16, kv_dtype="fp8_e4m3").config.tma  # FP8 rows go through the dequantizing producer
    assert BatchMLADecode(16).config == mla_decode_config(rows=16) == MLADecodeConfig(
        schedule="narrow", block_rows=16, tma=DEFAULT_TMA, lazy_rescale=lazy)


def test_fp8_producer_fields():
    """The FP8 default (L2 prefetch, 16 rows in flight) is shipped; the fields' domains are named errors."""
    fp8 = BatchMLADecode(64, kv_dtype="fp8_e4m3").config
    assert fp8 == mla_decode_config(kv_dtype="fp8_e4m3") and fp8 in SHIPPED
    assert BatchMLADecode(16, kv_dtype="fp8_e4m3").config in SHIPPED
    assert (fp8.prefetch_tiles, fp8.fp8_rows) == (DEFAULT_PREFETCH["fp8_e4m3"], DEFAULT_FP8_ROWS)
    assert f"constexpr int FP8_ROWS = {fp8.fp8_rows};" in fp8.render()
    assert BatchMLADecode(16).config.prefetch_tiles == DEFAULT_PREFETCH[None]
    assert BatchMLADecode(16, kv_dtype="fp8_e4m3", block_n=32, num_kv_stages=4).config.fp8_rows == 8
    with pytest.raises(ValueError, match="MLADecodeConfig.fp8_rows=16"):
        MLADecodeConfig(kv_dtype="fp8_e4m3", block_n=32, num_kv_stages=4, fp8_rows=16)
    with pytest.raises(ValueError, match="MLADecodeConfig.fp8_rows=16"):
        MLADecodeConfig(fp8_rows=16)
    with pytest.raises(ValueError, match="MLADecodeConfig.prefetch_tiles=5"):
        MLADecodeConfig(prefetch_tiles=5)
    with pytest.raises(ValueError, match="prefetch_tiles"):
        BatchMLADecode(16, prefetch_tiles=7)
    with pytest.raises(ValueError, match="fp8_rows=16 applies to an FP8 cache only"):
        BatchMLADecode(16, fp8_rows=16)


def test_mla_configs_share_the_base():
    from cukv.configs.base import KernelConfig

    for cfg in SHIPPED:
        assert isinstance(cfg, KernelConfig) and cfg.template.startswith("mla_")


ALTERNATE = [MLADecodeConfig(dt, bn, st, schedule="alternate")
             for dt, bn, st in (("bfloat16", 64, 2), ("float16", 64, 2), ("bfloat16", 32, 4))]


@pytest.mark.compile_ahead(build=lambda cfg: cfg, arch=ARCH)
@pytest.mark.parametrize("cfg", ALTERNATE, ids=lambda c: c.name)
def test_alternate_schedule_compiles_without_spills(cfg):
    """The opt-in alternating consumers: same shared memory as the split ones, no spills, their own name, and no
    wgmma wait that ptxas had to inject (C7517: a register of an in-flight wgmma touched, the overlap lost)."""
    mod = compiler.compile_source(cfg.name, cfg.render(), arch=ARCH)
    for name, r in mod.functions.items():
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0, r
    assert "C7517" not in mod.log and "wgmma.wait_group is injected" not in mod.log, mod.log
    split = MLADecodeConfig(cfg.dtype, cfg.block_n, cfg.num_kv_stages)
    assert cfg.name == split.name + "_alt" and cfg.smem_bytes == split.smem_bytes
    assert "MLADecodeAltConsumer" in cfg.render() and "MLADecodeAltConsumer" not in split.render()


def test_schedule_rules():
    with pytest.raises(ValueError, match=r"MLADecodeConfig\.schedule='pingpong' is not valid"):
        MLADecodeConfig(schedule="pingpong")
    with pytest.raises(ValueError, match=r"MLADecodeConfig\.schedule='alternate' is not valid: .*spill"):
        MLADecodeConfig(kv_dtype="fp8_e4m3", schedule="alternate")
    with pytest.raises(ValueError, match=r"^schedule='alternate' is not offered with kv_dtype='fp8_e4m3'"):
        BatchMLADecode(16, kv_dtype="fp8_e4m3", schedule="alternate")
    assert BatchMLADecode(64, kv_dtype="fp8_e4m3").config.schedule == "split"
    assert BatchMLADecode(16, kv_dtype="fp8_e4m3").config.schedule == "narrow"
    assert BatchMLADecode(16, schedule="alternate").config == MLADecodeConfig(schedule="alternate", tma=DEFAULT_TMA,
                                                                                 lazy_rescale=DEFAULT_LAZY_RESCALE)
    assert mla_decode_config().schedule == "split"


SLICED = [MLADecodeConfig("bfloat16", 64, 2, schedule="alternate", tma=True, slice_release=True),
          MLADecodeConfig("float16", 32, 4, schedule="alternate", tma=True, slice_release=True)]


@pytest.mark.compile_ahead(build=lambda cfg: cfg, arch=ARCH)
@pytest.mark.parametrize("cfg", SLICED, ids=lambda c: c.name)
def test_slice_release_compiles_without_spills(cfg):
    """Per-slice ring barriers (opt-in): 0 spills, no wgmma wait injected by ptxas (the overlapped P V and Q K^T
    groups stay overlapped), 9 + 9 barriers per stage in the shared-memory plan, its own name and consumer."""
    mod = compiler.compile_source(cfg.name, cfg.render(), arch=ARCH)
    for name, r in mod.functions.items():
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0, r
    assert "C7517" not in mod.log and "wgmma.wait_group is injected" not in mod.log, mod.log
    alt = MLADecodeConfig(cfg.dtype, cfg.block_n, cfg.num_kv_stages, schedule="alternate", tma=True)
    barriers = lambda n: (8 * (1 + 2 * cfg.num_kv_stages * n) + 63) // 64 * 64  # noqa: E731
    assert cfg.name == alt.name + "_slices" and cfg.smem_bytes == alt.smem_bytes - barriers(1) + barriers(9)
    assert "MLADecodeSliceConsumer" in cfg.render() and "MLADecodeSliceConsumer" not in alt.render()


@pytest.mark.compile_ahead(build=lambda define: (mla_decode_config(num_heads=128, rows=128), {"defines": [define]}),
                           arch=ARCH)
@pytest.mark.parametrize("define", ["CUKV_MLA_NO_LOAD", "CUKV_MLA_NO_TMA_PREFETCH", "CUKV_TMA_EVICT_FIRST",
                                    "CUKV_MLA_WAIT_STATS", "CUKV_MLA_TIMELINE"])
def test_slice_probe_hooks_compile(define):
    """The probe defines of the default h128 kernel (benchmarks/probe_mla_rescale.py --define, probe_mla_tma.py,
    probe_mla_waits.py, probe_mla_timeline.py) still build it: no wgmma serialized, no spills in the timing builds (the
    wait counters may spill a few bytes), and the counters or the timeline where asked for."""
    cfg = mla_decode_config(num_heads=128, rows=128)
    assert cfg.slice_release
    mod = compiler.compile_source(cfg.name, cfg.render(), arch=ARCH, defines=[define])
    for name, r in mod.functions.items():
        assert define == "CUKV_MLA_WAIT_STATS" or r.spill_stores == r.spill_loads == r.stack_frame == 0, (define, r)
    assert "C7514" not in mod.log and "C7515" not in mod.log and "C7517" not in mod.log, mod.log
    cubin = mod.cubin_path.read_bytes().decode("latin-1")
    for asked, symbol in (("CUKV_MLA_WAIT_STATS", "cukv_mla_wait_stats"), ("CUKV_MLA_TIMELINE", "cukv_mla_timeline")):
        assert (symbol in cubin) == (define == asked), symbol


def test_slice_release_rules():
    for kw in ({}, {"schedule": "alternate"}, {"tma": True}, {"schedule": "alternate", "tma": True,
                                                              "kv_dtype": "fp8_e4m3"}):
        with pytest.raises(ValueError, match=r"MLADecodeConfig\.(slice_release=True|schedule='alternate'|tma=True) "
                                             r"is not valid"):
            MLADecodeConfig(slice_release=True, **kw)
    with pytest.raises(ValueError, match=r"MLADecodeConfig\.slice_release=1 is not valid"):
        MLADecodeConfig(schedule="alternate", tma=True, slice_release=1)
    dec = BatchMLADecode(16, slice_release=True)  # schedule None: the alternating one; tma: the policy's (on)
    assert dec.config == MLADecodeConfig(schedule="alternate", tma=True, slice_release=True, lazy_rescale=True)
    assert not mla_decode_config().slice_release
    for kw in ({"schedule": "split"}, {"tma": False}, {"kv_dtype": "fp8_e4m3"}, {"prefetch_tiles": 1}):
        with pytest.raises(ValueError, match=r"^slice_release=True needs the alternating schedule"):
            BatchMLADecode(16, slice_release=True, **kw)
    with pytest.raises(TypeError, match="slice_release"):
        BatchMLADecode(16, slice_release="yes")


def test_slice_release_default_applies_only_where_it_can():
    """From SLICE_RELEASE_MIN_HEADS heads the 16-bit TMA default takes per-slice barriers (and the alternating
    schedule); FP8, sparse, cp.async, prefetch and an explicit split schedule keep their configs (and stay valid)."""
    h = mla_decode_policy.SLICE_RELEASE_MIN_HEADS
    on = mla_decode_config(num_heads=h, rows=h)
    assert on.slice_release and on.schedule == "alternate" and on.tma and on in mla_decode_policy.shipped()
    assert BatchMLADecode(h).config == on and not BatchMLADecode(h - 1).config.slice_release
    assert mla_decode_config(schedule="alternate", num_heads=h).slice_release
    for kw in ({"kv_dtype": "fp8_e4m3"}, {"schedule": "split"}, {"tma": False}, {"prefetch_tiles": 1}):
        assert not mla_decode_config(num_heads=h, **kw).slice_release
    assert not mla_decode_policy.sparse_mla_config().slice_release
    assert not mla_decode_config(slice_release=False).slice_release


def test_multicast_field_and_default():
    """Cluster pairs (multicast): a bool field named in the kernel's name, with per-slice barriers or an FP8 cache's
    split kernel; the policy's default for an even count of 64-row blocks whose chunks hold MULTICAST_MIN_TILES
    tiles or more; both forms of the h128 kernels ship; an odd count of row blocks is refused by plan."""
    from cukv.policy.mla_decode import DEFAULT_MULTICAST, MULTICAST_MIN_TILES

    with pytest.raises(ValueError, match=r"MLADecodeConfig\.multicast=True is not valid: .*slice_release=True"):
        MLADecodeConfig(multicast=True)
    with pytest.raises(ValueError, match=r"MLADecodeConfig\.multicast=1 is not valid"):
        MLADecodeConfig(schedule="alternate", tma=True, slice_release=True, multicast=1)
    cfg = MLADecodeConfig(schedule="alternate", tma=True, slice_release=True, lazy_rescale=True, multicast=True)
    assert cfg.name.endswith("_slices_mc_lr") and "__cluster_dims__(2, 1, 1)" in cfg.render()
    assert "__cluster_dims__" not in dataclasses.replace(cfg, multicast=False).render()
    for rows, chunk, want in ((128, None, True), (256, 249, True), (128, MULTICAST_MIN_TILES, True),
                              (128, MULTICAST_MIN_TILES - 1, False), (128, 8, False), (192, None, False),
                              (64, None, False)):
        got = mla_decode_config(num_heads=128, rows=rows, chunk_tiles=chunk, slice_release=True).multicast
        assert got == (want and DEFAULT_MULTICAST), (rows, chunk)
    assert not mla_decode_config(num_heads=128, rows=128, multicast=False).multicast
    names = [c.name for c in mla_decode_policy.shipped()]
    assert sum(n.endswith("_slices_mc_lr") for n in names) == 2 and sum(n.endswith("_slices_lr") for n in names) == 2
    # an FP8 cache's split kernel: the pair shares the dequantization, 8 rows a producer lane, no L2 prefetch
    fp8 = mla_decode_config(kv_dtype="fp8_e4m3", num_heads=128, rows=128)
    if DEFAULT_MULTICAST:
        assert (fp8.multicast, fp8.fp8_rows, fp8.prefetch_tiles, fp8.schedule) == (True, 8, 0, "split")
        assert fp8 in mla_decode_policy.shipped() and "__cluster_dims__(2, 1, 1)" in fp8.render()
    for kw in ({"rows": 64}, {"rows": 128, "chunk_tiles": 8}):
        off = mla_decode_config(kv_dtype="fp8_e4m3", num_heads=128, **kw)
        assert (off.multicast, off.fp8_rows, off.prefetch_tiles) == (False, 16, 1), kw
    sparse = mla_decode_policy.sparse_mla_config(kv_dtype="fp8_e4m3", num_heads=128)
    assert not sparse.multicast and (sparse.fp8_rows, sparse.prefetch_tiles) == (16, 1)
    with pytest.raises(ValueError, match=r"multicast=True is not valid: .*schedule='split', block_n=64"):
        MLADecodeConfig(kv_dtype="fp8_e4m3", schedule="narrow", block_rows=16, multicast=True)
    assert MLADecodeConfig(kv_dtype="fp8_e4m3", schedule="split", fp8_rows=16, multicast=True).name.endswith("_r16_mc")
    with pytest.raises(ValueError, match=r"multicast=True shares the per-slice ring"):
        BatchMLADecode(128, slice_release=False, multicast=True)
    with pytest.raises(ValueError, match=r"cluster pairs .* 3 row blocks of 64; it needs an even count"):
        BatchMLADecode(96, schedule="alternate", slice_release=True, multicast=True).plan([100, 7], 2)


def test_lazy_rescale_field_and_default():
    """The consumers' lazy O rescale: a bool field named in the kernel's name and rendered as the consumers'
    switch; on in every default config, dense and sparse."""
    from cukv.policy.mla_decode import sparse_mla_config

    with pytest.raises(ValueError, match=r"MLADecodeConfig\.lazy_rescale=1 is not valid"):
        MLADecodeConfig(lazy_rescale=1)
    for lazy in (False, True):
        cfg = MLADecodeConfig(lazy_rescale=lazy)
        assert cfg.name.endswith("_lr") == lazy
        assert f"#define CUKV_MLA_LAZY_RESCALE {int(lazy)}" in cfg.render()
    for cfg in (mla_decode_config(), mla_decode_config(num_heads=128), mla_decode_config(kv_dtype="fp8_e4m3"),
                sparse_mla_config(), sparse_mla_config(kv_dtype="fp8_e4m3")):
        assert cfg.lazy_rescale and "_lr" in cfg.name, cfg.name


NARROW = [MLADecodeConfig("bfloat16", 64, 2, schedule="narrow", tma=True, lazy_rescale=True, block_rows=16),
          MLADecodeConfig("float16", 64, 2, schedule="narrow", lazy_rescale=False, block_rows=32),
          MLADecodeConfig("bfloat16", 64, 2, kv_dtype="fp8_e4m3", schedule="narrow", prefetch_tiles=1, fp8_rows=16,
                          lazy_rescale=True, block_rows=16),
          MLADecodeConfig("bfloat16", 64, 2, kv_dtype="fp8_e4m3", schedule="narrow", lazy_rescale=True, block_rows=32)]


@pytest.mark.compile_ahead(build=lambda cfg: cfg, arch=ARCH)
@pytest.mark.parametrize("cfg", NARROW, ids=lambda c: c.name)
def test_narrow_compiles_without_spills(cfg):
    """The narrow consumers: 0 spills, no wgmma wait injected by ptxas, a query block of the block's rows."""
    mod = compiler.compile_source(cfg.name, cfg.render(), arch=ARCH)
    for name, r in mod.functions.items():
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0, r
    assert "C7517" not in mod.log and "wgmma.wait_group is injected" not in mod.log, mod.log
    assert cfg.q_bytes == cfg.block_rows * 576 * 2 and "MLADecodeNarrowConsumer" in cfg.render()
    assert f"_nr{cfg.block_rows}" in cfg.name


def test_narrow_rules():
    """The narrow schedule's domain: 16 or 32 rows, 64-token tiles; picked for s_q x heads <= 32; named errors."""
    for bad, match in ((dict(schedule="narrow"), "block_rows=64"), (dict(block_rows=16), "block_rows=16"),
                       (dict(schedule="narrow", block_rows=16, block_n=32), "block_n=32"),
                       (dict(schedule="narrow", block_rows=24), "block_rows=24")):
        with pytest.raises(ValueError, match=rf"MLADecodeConfig\.{match}"):
            MLADecodeConfig(**bad)
    assert [mla_decode_config(rows=r).block_rows for r in (1, 16, 17, 32, 33)] == [16, 16, 32, 32, 64]
    assert mla_decode_config(rows=16, block_n=32).schedule == "split"
    assert mla_decode_config(rows=32, kv_dtype="fp8_e4m3").fp8_rows == 8  # 16 rows in flight spill beside 32 rows
    assert mla_decode_config(rows=16, kv_dtype="fp8_e4m3").prefetch_tiles == NARROW_FP8_PREFETCH
    # the rope copies: before the code loads beside the split consumers and in sparse MLA, behind them in narrow decode
    assert mla_decode_config(kv_dtype="fp8_e4m3").fp8_rope_first
    assert not mla_decode_config(rows=16, kv_dtype="fp8_e4m3").fp8_rope_first
    assert mla_decode_config(kv_dtype="fp8_e4m3").name.endswith("_rf")
    assert not mla_decode_config(kv_dtype="fp8_e4m3", block_n=32, num_kv_stages=4).fp8_rope_first
    with pytest.raises(ValueError, match="MLADecodeConfig.fp8_rope_first"):
        MLADecodeConfig(fp8_rope_first=1)
    with pytest.raises(ValueError, match=r"MLADecodeConfig\.schedule='alternate' is not valid"):
        mla_decode_config(kv_dtype="fp8_e4m3", schedule="alternate")  # the policy leaves the verdict to the config
    with pytest.raises(ValueError, match="schedule='narrow' serves at most 32"):
        BatchMLADecode(33, schedule="narrow")
    with pytest.raises(ValueError, match="schedule='narrow' serves at most 32 query rows; s_q=4"):
        BatchMLADecode(16, schedule="narrow").plan([100], s_q=4)
    from cukv.ops.sparse_mla import SparseMLA
    assert SparseMLA(16).config.schedule == "narrow" and SparseMLA(48).config.schedule == "split"
    # from SPARSE_SLICES_MIN_HEADS on, 16-bit rows: the alternating consumers over per-slice gathers
    alt = SparseMLA(64).config
    assert alt.schedule == "alternate" and alt.slice_release and alt.name.endswith("_alt_slices_nq_lr") and alt.next_q
    assert SparseMLA(128, block_n=32).config.schedule == "split"
    assert SparseMLA(128, kv_dtype="fp8_e4m3").config.schedule == "split"
    with pytest.raises(ValueError, match=r"schedule='alternate' gathers 16-bit rows .* got kv_dtype='fp8_e4m3'"):
        SparseMLA(128, kv_dtype="fp8_e4m3", schedule="alternate")
    with pytest.raises(ValueError, match=r"schedule='alternate' .* block_n=32"):
        SparseMLA(128, block_n=32, schedule="alternate")
    # the config's own rules, for configs built by hand
    with pytest.raises(ValueError, match=r"MLADecodeConfig\.schedule='alternate' is not valid"):
        SparseMLAConfig("bfloat16", 64, 2, "fp8_e4m3", "alternate", slice_release=True)
    with pytest.raises(ValueError, match=r"SparseMLAConfig\.slice_release=True is not valid"):
        SparseMLAConfig("bfloat16", 32, 4, None, "alternate", slice_release=True)
    # the next wave's query block prefetch: the per-slice gathers of one item a block only
    assert not SparseMLA(128, persistent=True).config.next_q and not SparseMLA(16).config.next_q
    with pytest.raises(ValueError, match=r"SparseMLAConfig\.next_q=True is not valid: .*slice_release=True"):
        SparseMLAConfig("bfloat16", 64, 2, None, "split", next_q=True)
    with pytest.raises(ValueError, match=r"SparseMLAConfig\.next_q=1 is not valid; accepted: True, False"):
        SparseMLAConfig("bfloat16", 64, 2, None, "alternate", slice_release=True, next_q=1)
    assert SparseMLA(16, kv_dtype="fp8_e4m3").config.fp8_rope_first
    assert SparseMLA(32, schedule="split").config.block_rows == 64
    with pytest.raises(ValueError, match="schedule='narrow' serves at most 32 heads"):
        SparseMLA(33, schedule="narrow")


def test_sparse_multicast_field():
    """Sparse MLA's FP8 pair: opt-in (SPARSE_MULTICAST off), named in the kernel's name and rendered as a cluster pair
    with the pair's producer; 16-bit rows under the split consumers and an odd count of row blocks are refused, naming
    the field or the heads."""
    from cukv.ops.sparse_mla import SparseMLA
    from cukv.policy.mla_decode import SPARSE_MULTICAST, sparse_mla_config

    assert sparse_mla_config(kv_dtype="fp8_e4m3", num_heads=128).multicast == SPARSE_MULTICAST
    cfg = SparseMLA(128, kv_dtype="fp8_e4m3", multicast=True).config
    assert cfg.name.endswith("_mc_lr_rf") and (cfg.fp8_rows, cfg.prefetch_tiles) == (8, 0)
    src = cfg.render()
    assert "__cluster_dims__(2, 1, 1)" in src and "produce_fp8_pair" in src
    with pytest.raises(ValueError, match=r"multicast=True is not valid"):
        SparseMLA(128, schedule="split", multicast=True)  # 16-bit rows pair only under the per-slice consumers
    assert SparseMLA(128, multicast=True).config.name.endswith("_alt_slices_nq_mc_lr")
    with pytest.raises(ValueError, match=r"num_heads=64 makes 1 row blocks of 64; it needs an even count"):
        SparseMLA(64, kv_dtype="fp8_e4m3", multicast=True)
    with pytest.raises(TypeError, match="multicast"):
        SparseMLA(128, kv_dtype="fp8_e4m3", multicast="yes")
