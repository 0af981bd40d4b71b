"""MergeConfig (merge_states kernel) without a GPU: the valid domain renders and its derived sizes are the
ones the source re-checks, invalid fields raise ValueError naming field and value, a sample compiles for
sm_90a through the compile path with no spills, and wrong arguments are refused before any GPU work."""
import dataclasses
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cukv import compiler
from cukv.errors import CompileError
from cukv.ops.merge import MERGE_ARGS, MERGE_DTYPES, THREADS, MergeConfig, merge_states, merge_states_n

ARCH = "sm_90a"
DTYPES = tuple(MERGE_DTYPES)


pytestmark = pytest.mark.usefixtures("fresh_kernel_cache")  # the resource reports below come from this run's NVRTC


def _valid(dtype, head_dim, threads) -> bool:
    vec = 16 // MERGE_DTYPES[dtype][2]
    return 4 <= head_dim <= 1024 and head_dim % vec == 0 and threads in THREADS and head_dim // vec <= threads


@given(st.sampled_from(DTYPES), st.integers(-8, 1100), st.sampled_from(THREADS + (0, 32, 96, 100, 1024)))
def test_domain_is_exactly_the_rules(dtype, head_dim, threads):
    if not _valid(dtype, head_dim, threads):
        with pytest.raises(ValueError) as e:
            MergeConfig(dtype, head_dim, threads)
        msg = str(e.value)
        assert msg.startswith("MergeConfig.") and (f"head_dim={head_dim}" in msg or f"threads={threads}" in msg), msg
        return
    cfg = MergeConfig(dtype, head_dim, threads)
    assert cfg.vec * cfg.itemsize == 16
    assert cfg.threads_per_row * cfg.vec == cfg.head_dim
    assert cfg.rows_per_block >= 1
    assert cfg.rows_per_block * cfg.threads_per_row + cfg.idle_threads == cfg.threads
    assert 0 <= cfg.idle_threads < cfg.threads_per_row
    src = cfg.render()
    assert src == cfg.render()  # deterministic: the cache key depends on it
    assert f"void __launch_bounds__(THREADS) {cfg.name}(" in src
    assert f"typedef {MERGE_DTYPES[dtype][0]} T;" in src
    assert f"constexpr int DEPTH = {head_dim};" in src
    assert f"constexpr int THREADS = {threads};" in src
    for member, value in (("kVec", cfg.vec), ("kThreadsPerRow", cfg.threads_per_row),
                          ("kRowsPerBlock", cfg.rows_per_block), ("kIdleThreads", cfg.idle_threads)):
        assert f"static_assert(K::{member} == {value}," in src, member
    assert f"static_assert(sizeof(MergeArgs) == {MERGE_ARGS.itemsize}," in src
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", cfg.name)


@given(st.sampled_from(DTYPES), st.sampled_from((64, 80, 96, 128, 192, 256, 512)), st.sampled_from(THREADS),
       st.sampled_from(DTYPES), st.sampled_from((64, 80, 96, 128, 192, 256, 512)), st.sampled_from(THREADS))
def test_names_identify_configs(d1, h1, t1, d2, h2, t2):
    if not (_valid(d1, h1, t1) and _valid(d2, h2, t2)):
        return
    a, b = MergeConfig(d1, h1, t1), MergeConfig(d2, h2, t2)
    assert (a.name == b.name) == (a == b)


@pytest.mark.parametrize("field,value", [
    ("dtype", "int8"), ("dtype", "bf16"), ("dtype", None), ("dtype", "float64"),
    ("head_dim", 0), ("head_dim", 12), ("head_dim", 2048), ("head_dim", -64), ("head_dim", "128"), ("head_dim", 128.0),
    ("head_dim", True),
    ("threads", 0), ("threads", 96), ("threads", 1024), ("threads", 128.0), ("threads", "128"),
])
def test_invalid_field_names_field_and_value(field, value):
    with pytest.raises(ValueError) as e:
        MergeConfig(**{field: value})
    assert f"MergeConfig.{field}={value!r}" in str(e.value)


def test_rules_are_explained():
    with pytest.raises(ValueError, match=r"multiple of 8 for bfloat16"):
        MergeConfig("bfloat16", 20)
    assert MergeConfig("float32", 20).vec == 4  # 20 float32 values are five 16-byte vectors
    with pytest.raises(ValueError, match=r"needs 128 threads per row, more than threads=64"):
        MergeConfig("float32", 512, 64)


def test_config_is_frozen_and_hashable():
    cfg = MergeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.head_dim = 64
    assert {cfg: 1}[MergeConfig()] == 1
    assert cfg.name == "cukv_merge_bf16_d128_t128"


def test_args_layout():
    assert MERGE_ARGS.itemsize == 64  # 4 pointers, 3 int64, int32 count + pad: matches MergeArgs


@pytest.mark.compile_ahead(build=lambda dtype, head_dim, threads: MergeConfig(dtype, head_dim, threads), arch=ARCH)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,threads", [(64, 128), (80, 128), (128, 128), (192, 256), (256, 64), (512, 512)])
def test_compiles_for_sm90a_without_spills(dtype, head_dim, threads):
    cfg = MergeConfig(dtype, head_dim, threads)
    mod = compiler.compile_source(cfg.name, cfg.render(), arch=ARCH)
    assert cfg.name in mod.functions, f"ptxas reported {sorted(mod.functions)}"
    r = mod.functions[cfg.name]
    assert r.spill_stores == 0 and r.spill_loads == 0, r
    assert r.stack_frame == 0, r
    assert r.static_smem == 0, r
    assert r.registers <= 64, r  # a streaming kernel: full occupancy at any block size
    assert mod.cubin_path.is_file()
    again = compiler.compile_source(cfg.name, cfg.render(), arch=ARCH)
    assert again.cache_hit and again.key == mod.key


def test_compiled_goes_through_the_shared_base(monkeypatch):
    """MergeConfig renders and compiles through KernelConfig (the one path every config takes)."""
    from cukv.configs.base import KernelConfig

    calls = []
    real = compiler.compile_source

    def spy(name, source, *a, **k):
        calls.append((name, source))
        return real(name, source, *a, **k)

    monkeypatch.setattr(compiler, "compile_source", spy)
    cfg = MergeConfig("float16", 96)
    assert isinstance(cfg, KernelConfig) and cfg.template == "merge_states.cu.j2"
    mod = cfg.compiled
    assert calls == [(cfg.name, compiler.render("merge_states.cu.j2", **cfg.render_params()))]
    assert calls[0][1] == cfg.render()
    assert cfg.name in mod.functions
    assert cfg.compiled is mod  # once per config object


def test_static_asserts_catch_a_drift():
    """A derived size that disagrees with the header's own fails the compile, naming the size."""
    cfg = MergeConfig("bfloat16", 128)
    for field, wrong in (("vec", 4), ("rows_per_block", 7), ("args_bytes", 72)):
        src = compiler.render("merge_states.cu.j2", **{**cfg.render_params(), field: wrong})
        with pytest.raises(CompileError) as e:
            compiler.compile_source(cfg.name + "_drift", src, arch=ARCH)
        assert "static assertion failed" in str(e.value) or "static_assert" in str(e.value)


def test_non_arrays_are_refused_naming_the_argument():
    with pytest.raises(TypeError, match=r"^v_a must be a CuPy array"):
        merge_states([[0.0]], None, None, None)
    with pytest.raises(TypeError, match=r"^vs must be a CuPy array"):
        merge_states_n("values", None)


def test_numpy_input_message_mentions_cupy_asarray():
    with pytest.raises(TypeError, match=r"vs is a NumPy \(host\) array.*cupy.asarray\(vs\)"):
        merge_states_n(np.zeros((2, 1, 1, 64), np.float16), np.zeros((2, 1, 1), np.float32))
    with pytest.raises(TypeError, match=r"v_a is a NumPy \(host\) array"):
        merge_states(np.zeros((1, 1, 64), np.float16), None, None, None)
