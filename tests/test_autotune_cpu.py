"""Opt-in prefill autotuning without a GPU: the device, the compile reports and the timed problem are faked,
so these cover candidate handling, the persisted store and its lookup (round trip, corrupt file, env switch)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cukv
from cukv import BatchPrefill, autotune, cli, tuned
from cukv.compiler import FunctionReport
from cukv.errors import NoGPUError
from cukv.configs.prefill import HEAD_DIMS, PrefillConfig
from cukv.policy.prefill import DEFAULTS, default_config, tile_config

DEV = "Fake GPU 80GB"
README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty cache dir, autotune lookups on, a GPU named DEV."""
    monkeypatch.setenv("CUKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CUKV_AUTOTUNE", raising=False)
    monkeypatch.setattr(tuned, "device_name", lambda: DEV)
    return tmp_path / "cache" / "autotune.json"


class FakeProblem:
    """Stands in for the GPU problem: outputs are the configs themselves, times come from a table."""

    flops = 2e12

    def __init__(self, ms, wrong=()):
        self.ms, self.wrong, self.timed = ms, set(wrong), []

    def run(self, cfg):
        return cfg, cfg

    def max_diff(self, out, ref):
        return 7.0 if (out.BM, out.BN, out.BK, out.stages) in self.wrong else 0.01

    def time_ms(self, runner, reps):
        self.timed.append(runner)
        return self.ms.get((runner.BM, runner.BN, runner.BK, runner.stages), 1.0)


def fake_compile(spills=(), broken=()):
    def reports(configs, jobs=None):
        out = {}
        for c in configs:
            shape = (c.BM, c.BN, c.BK, c.stages)
            if shape in broken:
                out[c.name] = (None, "error: static assertion failed")
            else:
                n = 24 if shape in spills else 0
                out[c.name] = (FunctionReport(c.name, 128, n, n, n, 0), None)
        return out
    return reports


def _tune(monkeypatch, problem, spills=(), broken=(), **kw):
    monkeypatch.setattr(autotune, "_compile_reports", fake_compile(spills, broken))
    monkeypatch.setattr(autotune, "_make_problem", lambda *a, **k: problem)
    seen = []
    best = autotune.tune_prefill("bfloat16", 128, 16, on_result=seen.append, **kw)
    return best, seen


def test_persist_lookup_round_trip(store, monkeypatch):
    fast = (128, 64, 128, 3)
    problem = FakeProblem({fast: 0.5, DEFAULTS[128]: 0.8})
    best, seen = _tune(monkeypatch, problem, candidates=[(64, 64, 128, 2), fast, (64, 32, 128, 3)])
    assert (best.BM, best.BN, best.BK, best.stages) == fast
    assert all(r.ok for r in seen) and len(seen) == 3

    data = json.loads(store.read_text())
    assert data["schema"] == autotune.SCHEMA
    rec = data["records"][f"{DEV}|bfloat16|128|16"]
    assert rec["config"] == dict(zip(autotune.FIELDS, fast))
    assert rec["ms"] == 0.5 and rec["tflops"] == pytest.approx(2e12 / 0.5e-3 / 1e12)
    assert rec["name"] == best.name and rec["problem"]["seq_len"] == 4096

    assert autotune.lookup("bfloat16", 128, 16) == best
    assert BatchPrefill(8, 2, 128, 16).config == best  # ops ask the store first
    assert default_config("bfloat16", 128, 16) == tile_config("bfloat16", 128, 16, *DEFAULTS[128])  # pure
    assert cukv.BatchPrefill(32, 8, 128, page_size=16).config == best  # no GPU needed to pick the config
    # other keys stay on the documented default
    assert autotune.lookup("float16", 128, 16) is None
    assert autotune.lookup("bfloat16", 128, 0) is None
    assert autotune.lookup("bfloat16", 64, 16) is None
    assert cukv.BatchPrefill(32, 8, 128, page_size=None).config == tile_config("bfloat16", 128, 0, *DEFAULTS[128])
    monkeypatch.setattr(tuned, "device_name", lambda: "Another GPU")
    assert autotune.lookup("bfloat16", 128, 16) is None
    monkeypatch.setattr(tuned, "device_name", lambda: None)  # no GPU: nothing applies
    assert autotune.lookup("bfloat16", 128, 16) is None


def test_second_tune_keeps_other_records_and_replaces_its_own(store, monkeypatch):
    _tune(monkeypatch, FakeProblem({(64, 64, 128, 2): 0.1}), candidates=[(64, 64, 128, 2)])
    monkeypatch.setattr(autotune, "_make_problem", lambda *a, **k: FakeProblem({}))
    autotune.tune_prefill("float16", 64, 0, candidates=[(128, 64, 64, 2)])
    best, _ = _tune(monkeypatch, FakeProblem({(128, 32, 128, 2): 0.2}), candidates=[(128, 32, 128, 2)])
    recs = json.loads(store.read_text())["records"]
    assert set(recs) == {f"{DEV}|bfloat16|128|16", f"{DEV}|float16|64|0"}
    assert recs[f"{DEV}|bfloat16|128|16"]["config"]["BN"] == 32
    assert autotune.lookup("float16", 64, 0) == tile_config("float16", 64, 0, 128, 64, 64, 2)
    assert [p.name for p in store.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_default_candidates_start_with_the_default(store, monkeypatch):
    problem = FakeProblem({})
    best, seen = _tune(monkeypatch, problem, quick=True)
    assert seen[0].is_default and seen[0].config == tile_config("bfloat16", 128, 16, *DEFAULTS[128])
    assert len(seen) == len(autotune.candidate_configs("bfloat16", 128, 16, quick=True))
    assert best == seen[0].config  # every candidate 1.0 ms: the first (the default) wins ties


def test_invalid_spilling_broken_and_wrong_candidates_are_skipped(store, monkeypatch):
    good, spilling, broken, wrong = (128, 64, 128, 4), (64, 128, 128, 4), (192, 64, 128, 2), (64, 32, 128, 2)
    problem = FakeProblem({good: 0.9, spilling: 0.1, broken: 0.1, wrong: 0.1}, wrong=[wrong])
    best, seen = _tune(monkeypatch, problem, spills=[spilling], broken=[broken],
                       candidates=[(100, 64, 128, 4), (128, 64, 64, 2), (128, 64, 128, 9), "x", spilling, broken,
                                   wrong, good])
    status = {(r.config.BM, r.config.BN, r.config.BK, r.config.stages) if hasattr(r.config, "BM") else r.config:
              r.status for r in seen}
    assert status == {(100, 64, 128, 4): "invalid", (128, 64, 64, 2): "invalid", (128, 64, 128, 9): "invalid",
                      "x": "invalid", spilling: "spills", broken: "compile error", wrong: "mismatch", good: "ok"}
    invalid = [r for r in seen if r.status == "invalid"]
    assert "PrefillConfig.BM=100" in invalid[0].detail and "KVBufferConfig.stages=2" in invalid[1].detail
    assert (best.BM, best.BN, best.BK, best.stages) == good
    assert [(c.BM, c.BN, c.BK, c.stages) for c in problem.timed] == [good]  # only the good one was timed
    assert autotune.lookup("bfloat16", 128, 16) == best


def test_nothing_correct_raises_and_stores_nothing(store, monkeypatch):
    with pytest.raises(RuntimeError, match="no candidate ran correctly"):
        _tune(monkeypatch, FakeProblem({}, wrong=[(64, 64, 128, 2)]), candidates=[(64, 64, 128, 2)])
    with pytest.raises(ValueError, match="no valid candidate"):
        _tune(monkeypatch, FakeProblem({}), candidates=[(100, 64, 128, 4)])
    assert not store.exists()


def test_candidate_for_another_shape_rejected(store, monkeypatch):
    _, seen = _tune(monkeypatch, FakeProblem({}), candidates=[tile_config("bfloat16", 64, 16, 128, 64, 64, 2),
                                                              (128, 64, 128, 2)])
    assert seen[0].status == "invalid" and "not for dtype=bfloat16, head_dim=128" in seen[0].detail


def test_no_persist(store, monkeypatch):
    _tune(monkeypatch, FakeProblem({}), candidates=[(128, 64, 128, 2)], persist=False)
    assert not store.exists()


def test_no_gpu_raises(store, monkeypatch):
    monkeypatch.setattr(tuned, "device_name", lambda: None)
    with pytest.raises(NoGPUError):
        autotune.tune_prefill("bfloat16", 128, 16, candidates=[(128, 64, 128, 2)])
    assert not store.exists()


def test_env_switch_off(store, monkeypatch):
    best, _ = _tune(monkeypatch, FakeProblem({}), candidates=[(64, 32, 128, 2)])
    default = tile_config("bfloat16", 128, 16, *DEFAULTS[128])
    for value, want in (("0", None), (" 0 ", None), ("1", best), ("", best)):
        monkeypatch.setenv("CUKV_AUTOTUNE", value)
        assert autotune.lookup("bfloat16", 128, 16) == want, value
        assert BatchPrefill(8, 2, 128, 16).config == (want or default)
    monkeypatch.setenv("CUKV_AUTOTUNE", "0")  # tuning itself still works (and stores) with lookups off
    best2, _ = _tune(monkeypatch, FakeProblem({}), candidates=[(64, 48, 128, 2)])
    assert json.loads(store.read_text())["records"][f"{DEV}|bfloat16|128|16"]["config"]["BN"] == 48


@pytest.mark.parametrize("text", [
    "{not json", "", "[1, 2]", '{"schema": 1}', '{"schema": 1, "records": []}', '{"schema": 99, "records": {}}',
    "\udcff",
])
def test_corrupt_file_warns_and_is_ignored(store, monkeypatch, text):
    store.parent.mkdir(parents=True)
    store.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.warns(autotune.AutotuneWarning, match="ignoring the autotune file"):
        assert autotune.lookup("bfloat16", 128, 16) is None
    with pytest.warns(autotune.AutotuneWarning):
        assert BatchPrefill(8, 2, 128, 16).config == tile_config("bfloat16", 128, 16, *DEFAULTS[128])
    # tuning replaces a corrupt file
    best, _ = _tune(monkeypatch, FakeProblem({}), candidates=[(64, 32, 128, 2)])
    assert autotune.lookup("bfloat16", 128, 16) == best


@pytest.mark.parametrize("config", [
    {"BM": 100, "BN": 64, "BK": 128, "stages": 4},      # no longer valid
    {"BM": 128, "BN": 64, "BK": 128},                   # a field missing
    {"BM": "128", "BN": 64, "BK": 128, "stages": 4},    # wrong type
    None,
])
def test_bad_record_warns_and_is_ignored(store, config):
    store.parent.mkdir(parents=True)
    rec = {"config": config} if config is not None else "nonsense"
    store.write_text(json.dumps({"schema": autotune.SCHEMA, "records": {f"{DEV}|bfloat16|128|16": rec}}))
    with pytest.warns(autotune.AutotuneWarning, match="ignoring the autotune record"):
        assert autotune.lookup("bfloat16", 128, 16) is None


def test_missing_file_and_other_records_touch_no_device(store, monkeypatch):
    def boom():
        raise AssertionError("device_name must not be asked")

    monkeypatch.setattr(tuned, "device_name", boom)
    assert autotune.lookup("bfloat16", 128, 16) is None  # no file
    store.parent.mkdir(parents=True)
    store.write_text(json.dumps({"schema": autotune.SCHEMA, "records": {
        f"{DEV}|float16|64|16": {"config": {"BM": 64, "BN": 64, "BK": 64, "stages": 2}}}}))
    assert autotune.lookup("bfloat16", 128, 16) is None  # records, none for this key


def test_failed_write_leaves_the_old_file(store, monkeypatch):
    best, _ = _tune(monkeypatch, FakeProblem({}), candidates=[(64, 32, 128, 2)])
    before = store.read_bytes()

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        autotune.save_record(tile_config("bfloat16", 64, 16, 64, 64, 64, 2), DEV, ms=1.0)
    assert store.read_bytes() == before
    assert [p.name for p in store.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_candidate_grid():
    for d in HEAD_DIMS:
        full = autotune.candidate_configs("bfloat16", d, 16)
        quick = autotune.candidate_configs("bfloat16", d, 16, quick=True)
        base = tile_config("bfloat16", d, 16, *DEFAULTS[d])
        assert full[0] == base and quick[0] == base
        assert len(set(full)) == len(full) and set(quick) <= set(full) | {base}
        assert 1 < len(quick) <= 40 < len(full)
        for c in full[1:]:
            assert c.BM in (64, 128, 192) and c.BN % 16 == 0 and c.BN <= 128 and 2 <= c.stages <= 6
        assert {c.BK for c in quick} == {base.BK}


def test_compile_reports_real(tmp_path, monkeypatch):
    """The real compile step (NVRTC, two spawned worker processes) fills the disk cache and reports."""
    monkeypatch.setenv("CUKV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CUKV_NO_COMPILE", raising=False)
    monkeypatch.setenv("CUKV_ARCH", "sm_90a")
    from cukv import compiler

    compiler.target_arch.cache_clear()
    try:
        cfgs = [tile_config("bfloat16", 64, 16, 64, 32, 64, 2), tile_config("float16", 64, 0, 64, 16, 64, 2)]
        reps = autotune._compile_reports(cfgs, jobs=2)
        for c in cfgs:
            rep, err = reps[c.name]
            assert err is None and rep.registers > 0 and rep.spills == 0, (rep, err)
            assert c.compiled.cache_hit  # the main process finds the workers' cubins
    finally:
        compiler.target_arch.cache_clear()


def test_defaults_table_and_readme():
    table = autotune.defaults_table()
    rows = table.splitlines()[2:]
    assert len(rows) == len(DEFAULTS)
    for row, d in zip(rows, sorted(DEFAULTS)):
        c = tile_config("bfloat16", d, 16, *DEFAULTS[d])
        assert row == f"| {d} | {c.BM} | {c.BN} | {c.BK} | {c.stages} | {c.num_threads} | {c.smem_bytes} |"
    assert table in README.read_text(), ("README's prefill tile table (section 'Command line') is out of date with "
                                         "cukv.policy.prefill.DEFAULTS; "
                                         "paste the output of `python -m cukv autotune defaults`")


def test_cli_autotune(store, monkeypatch, capsys):
    assert cli.main(["autotune", "defaults"]) == 0
    assert capsys.readouterr().out.strip() == autotune.defaults_table()
    assert cli.main(["autotune", "prefill"]) == 2
    assert "--head-dim is required" in capsys.readouterr().err
    assert cli.main(["autotune", "prefill", "--head-dim", "100"]) == 2
    assert "not supported" in capsys.readouterr().err
    monkeypatch.setattr(tuned, "device_name", lambda: None)
    assert cli.main(["autotune", "prefill", "--head-dim", "128"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert cli.main(["autotune", "show"]) == 0
    assert "0 record(s)" in capsys.readouterr().out


def test_cli_autotune_table(store, monkeypatch, capsys):
    fast = (128, 64, 128, 2)
    monkeypatch.setattr(autotune, "_compile_reports", fake_compile(spills=[(64, 64, 128, 2)]))
    monkeypatch.setattr(autotune, "_make_problem", lambda *a, **k: FakeProblem({fast: 0.25}))
    assert cli.main(["autotune", "prefill", "--head-dim", "128", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "ok (default)" in out and "spills" in out and "TFLOP/s" in out
    assert f"winner: {tile_config('bfloat16', 128, 16, *fast).name}" in out and "0.250 ms" in out
    assert "saved to" in out
    assert cli.main(["autotune", "show"]) == 0
    assert f"{DEV}|bfloat16|128|16: BM=128 BN=64 BK=128 stages=2  0.250 ms" in capsys.readouterr().out


def test_import_does_not_touch_cupy(tmp_path):
    code = ("import sys, cukv.autotune as a\n"
            "from cukv.policy.prefill import default_config\n"
            "assert a.lookup('bfloat16', 128, 16) is None\n"
            "default_config('bfloat16', 128, 16)\n"
            "assert 'cupy' not in sys.modules, 'cupy imported'\n")
    env = dict(os.environ, CUKV_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
