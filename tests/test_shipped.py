"""Every shipped specialization compiles for sm_90a without spills, stack or shared-memory opt-in; the CLI
that builds them ahead of time works."""
import os
import subprocess
import sys

import pytest

from cukv import AppendConfig, DecodeConfig, compiler
from cukv.specs import select, shipped

ARCH = "sm_90a"
SHIPPED = shipped()


def test_shipped_set():
    names = [c.name for c in SHIPPED]
    assert len(names) == len(set(names)), "two shipped configs share a name"
    assert any(isinstance(c, DecodeConfig) for c in SHIPPED) and any(isinstance(c, AppendConfig) for c in SHIPPED)
    assert {c.head_dim for c in SHIPPED if isinstance(c, DecodeConfig)} == {64, 96, 128, 256}
    assert {c.dtype for c in SHIPPED} == {"bfloat16", "float16"}
    assert select("d64") and all("d64" in c.name for c in select("d64"))
    assert len(select(None)) == len(SHIPPED)


@pytest.mark.compile_ahead(build=lambda cfg: cfg, arch=ARCH)
@pytest.mark.parametrize("cfg", SHIPPED, ids=lambda c: c.name)
def test_shipped_config_resources(cfg, fresh_kernel_cache):
    mod = compiler.compile_source(cfg.name, cfg.render(), arch=ARCH)
    assert mod.cubin_path.parent == fresh_kernel_cache, "compiled in this session, into its fresh cache"
    assert cfg.name in mod.functions, f"ptxas reported {sorted(mod.functions)}"
    r = mod.functions[cfg.name]
    assert r.spill_stores == 0 and r.spill_loads == 0, r
    assert r.stack_frame == 0, r
    assert r.static_smem < 48 * 1024, r
    if isinstance(cfg, DecodeConfig):
        assert r.static_smem == cfg.smem_bytes, r
    assert mod.cubin_path.is_file()


def test_cli_compile_filter(tmp_path):
    env = dict(os.environ, CUKV_CACHE_DIR=str(tmp_path / "cli_cache"))
    env.pop("CUKV_NO_COMPILE", None)
    # two compile processes into the empty cache, then one process served from it: both paths of the command
    p = subprocess.run([sys.executable, "-m", "cukv", "compile", "--filter", "d64", "--jobs", "2"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("cukv_")]
    want = {c.name for c in select("d64")}
    assert {ln.split()[0] for ln in rows} == want
    assert not any("SPILLS" in ln for ln in rows), p.stdout
    assert len(list((tmp_path / "cli_cache").glob("*.cubin"))) == len(want)
    # a second run is served from the cache, and with CUKV_NO_COMPILE it still succeeds
    env["CUKV_NO_COMPILE"] = "1"
    p2 = subprocess.run([sys.executable, "-m", "cukv", "compile", "--filter", "d64", "--jobs", "1"],
                        capture_output=True, text=True, env=env, timeout=300)
    assert p2.returncode == 0, p2.stdout + p2.stderr
    assert all(ln.split()[6] == "yes" for ln in p2.stdout.splitlines() if ln.startswith("cukv_")), p2.stdout


def test_cli_compile_unknown_filter_fails(tmp_path):
    env = dict(os.environ, CUKV_CACHE_DIR=str(tmp_path / "c"))
    p = subprocess.run([sys.executable, "-m", "cukv", "compile", "--filter", "no-such-kernel", "--jobs", "1"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 1
    assert "no shipped specialization matches" in p.stdout
