"""The prefill benchmark's host side without a GPU: the FLOP count, the table, the CLI's arguments."""
import json
import os
import subprocess
import sys

import pytest

from cukv import cli
from cukv.bench import prefill as bp
from cukv.bench.timing import CEILING_VARIANTS


def test_causal_flops_counts_the_causal_half():
    # 4 * B * Hq * D * L * L / 2: QK^T and PV are 2*L*L*D flops each per head, causal keeps half
    assert bp.causal_flops(4, 4096, 32, 128) == 4 * 4 * 32 * 128 * 4096 * 4096 / 2
    assert bp.causal_flops(1, 1, 1, 1) == 2.0
    assert bp.causal_flops(2, 8, 3, 64) == 2 * bp.causal_flops(1, 8, 3, 64)
    assert bp.causal_flops(1, 16, 1, 64) == 4 * bp.causal_flops(1, 8, 1, 64)  # quadratic in L
    assert "L * L / 2" in bp.FLOPS_FORMULA


def test_tflops():
    f = bp.causal_flops(4, 4096, 32, 128)  # 2.2e12 flops
    assert bp.tflops(f, 10.0) == pytest.approx(f / 1e-2 / 1e12)
    assert bp.tflops(f, None) is None and bp.tflops(f, 0.0) is None


def test_shapes_are_the_documented_set():
    assert bp.SHAPES == ((4, 4096, 32, 8, 128), (1, 16384, 32, 8, 128), (8, 2048, 32, 32, 128),
                         (4, 4096, 16, 16, 256), (8, 2048, 32, 8, 64))
    assert len(bp.QUICK_SHAPES) == 2 and set(bp.QUICK_SHAPES) <= set(bp.SHAPES)
    for b, L, hq, hkv, d in bp.SHAPES:
        assert hq % hkv == 0 and L % bp.PAGE_SIZE == 0


def _row(batch, seq_len, hq, hkv, d, **ms):
    r = {"batch": batch, "seq_len": seq_len, "num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": d,
         "flops": bp.causal_flops(batch, seq_len, hq, d)}
    r.update(ms)
    return bp._finish_row(r)


def fake_result():
    rows = [
        _row(4, 4096, 32, 8, 128, paged_ms=4.0, contig_ms=3.5, flash_ms=5.0, cudnn_ms=3.0),
        _row(4, 4096, 16, 16, 256, paged_ms=8.0, contig_ms=None, contig_error="ValueError: no config",
             flash_ms=None, flash_error="RuntimeError: No available kernel", cudnn_ms=6.0),
    ]
    summary = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-01-01", "dtype": "bfloat16", "kv_dtype": "bfloat16",
               "page_size": 16, "mask": "causal", "reps": 20, "flops_formula": bp.FLOPS_FORMULA, "torch": "2.9.0",
               "peers_missing": None, "geomean_ratio_flash": 1.25, "geomean_ratio_cudnn": 0.75}
    return {"summary": summary, "rows": rows}


def test_finish_row_ratios_are_peer_time_over_cukv_time():
    r = fake_result()["rows"][0]
    assert r["ratio_flash"] == pytest.approx(5.0 / 4.0)  # > 1: cukv faster
    assert r["ratio_cudnn"] == pytest.approx(3.0 / 4.0)
    assert r["paged_tflops"] == pytest.approx(r["flops"] / 4e-3 / 1e12)
    r2 = fake_result()["rows"][1]
    assert r2["ratio_flash"] is None and r2["flash_tflops"] is None and r2["contig_tflops"] is None
    r3 = _row(1, 16, 1, 1, 64, paged_ms=None, paged_error="x", cudnn_ms=1.0)
    assert r3["ratio_cudnn"] is None  # no cukv time, no ratio
    json.dumps(fake_result())  # the result is plain JSON (None -> null)


def test_format_table_markdown():
    text = bp.format_table(fake_result())
    lines = text.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("| shape"))
    assert lines[header + 1].startswith("|---")
    ncols = lines[header].count("|")
    body = lines[header + 2:header + 4]
    assert all(ln.count("|") == ncols for ln in body), body
    cells = [c.strip() for c in body[0].strip("|").split("|")]
    assert cells[0] == "b4 L4096 h32/8 d128"
    assert cells[1] == "4.000" and float(cells[2]) == pytest.approx(fake_result()["rows"][0]["paged_tflops"], abs=0.05)
    assert cells[-2:] == ["1.25", "0.75"]
    cells = [c.strip() for c in body[1].strip("|").split("|")]
    assert cells[0] == "b4 L4096 h16/16 d256"
    assert cells[3] == "n/a" and cells[5] == "n/a" and cells[-2] == "n/a" and cells[-1] == "0.75"
    assert "No available kernel" in text and "no config" in text  # reasons are listed under the table
    assert "geomean(flash time / cukv paged time) = 1.250" in text
    assert "L * L / 2" in text and "NVIDIA H100" in text


def test_format_table_without_torch():
    res = fake_result()
    reason = "torch not importable (ModuleNotFoundError: No module named 'torch')"
    for r in res["rows"]:
        for p in bp.PEERS:
            r[f"{p}_ms"], r[f"{p}_error"] = None, reason
        bp._finish_row(r)
    res["summary"].update(peers_missing=reason, geomean_ratio_flash=None, geomean_ratio_cudnn=None)
    text = bp.format_table(res)
    assert text.count(reason) == 1  # said once, not once per cell
    assert "geomean" not in text


class FakeTimer:
    """Answers median_ms from a script of times per function and records the order of the calls."""

    def __init__(self, times):
        self.times, self.calls = {k: list(v) for k, v in times.items()}, []

    def median_ms(self, fn, reps=30, warmup=5):
        name = fn()
        self.calls.append((name, reps))
        return self.times[name].pop(0)


def test_interleaved_rounds_alternate_the_contenders():
    from cukv.bench.timing import interleaved_medians, interleaved_rounds

    t = FakeTimer({"a": [1.0, 9.0, 2.0], "b": [3.0, 4.0, 5.0]})
    got = interleaved_rounds(t, {"a": lambda: "a", "b": lambda: "b"}, reps=30, rounds=3)
    assert got == {"a": [1.0, 9.0, 2.0], "b": [3.0, 4.0, 5.0]}
    assert t.calls == [("a", 10), ("b", 10)] * 3  # round by round, reps split over the rounds
    t = FakeTimer({"a": [1.0, 9.0, 2.0], "b": [3.0, 4.0, 5.0]})
    assert interleaved_medians(t, {"a": lambda: "a", "b": lambda: "b"}, reps=6) == {"a": 2.0, "b": 4.0}
    assert t.calls[0] == ("a", 5)  # at least 5 calls a round


def test_fp8_bench_times_bf16_and_fp8_in_the_same_rounds():
    rounds = {"paged": [1.00, 1.04, 1.02], "fp8_fused": [1.20, 1.22, 1.21], "fp8_convert_once": [1.01, 1.00, 1.03]}
    t = FakeTimer(rounds)
    row = {"fp8_strategy": "convert_once"}
    bp._time_interleaved(row, t, {k: (lambda k=k: k) for k in rounds}, reps=3 * 8, rounds=3)
    assert [c[0] for c in t.calls] == list(rounds) * 3 and {c[1] for c in t.calls} == {8}
    assert row["paged_ms"] == 1.02 and row["fp8_fused_ms"] == 1.21 and row["fp8_ms"] == 1.01
    assert row["fp8_vs_bf16"] == pytest.approx(1.02 / 1.01)
    assert row["fp8_vs_bf16_rounds"] == pytest.approx([1.00 / 1.01, 1.04 / 1.00, 1.02 / 1.03])
    res = fake_result()
    res["summary"].update(kv_dtype="fp8_e4m3", scale_granularity="token", fp8_rounds=3)
    res["rows"][0].update(row, fp8_dequantize_first_ms=None, maxdiff_fp8_bf16=0.01, fp8_config="cfg")
    text = bp.format_table(res)
    assert "3 interleaved rounds" in text
    fp8_table = text[text.index("FP8 e4m3 cache"):]
    line = next(ln for ln in fp8_table.splitlines() if ln.startswith("| b4 L4096 h32/8 d128 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3:6] == ["1.01", "0.99-1.04", "convert_once"] and cells[7] == "n/a"


def test_fp8_run_flow_without_a_gpu(monkeypatch, tmp_path):
    """run()'s control flow with every GPU piece stubbed: contig is timed alone, bf16 paged with the FP8
    strategies in interleaved rounds, and the JSON and table carry the round ratios."""
    import types

    from cukv.bench import timing

    calls = []

    class Timer:
        def median_ms(self, fn, reps=30, warmup=5):
            calls.append((fn(), reps))
            return {"paged": 1.0, "contig": 1.1, "fp8_fused": 1.3, "fp8_convert_once": 0.9}[calls[-1][0]]

    def time_cukv(row, engine, timer, reps, warmup, *shape_and_data, fns=None):
        if fns is not None:
            fns[engine] = lambda: engine
        else:
            row[f"{engine}_ms"] = timer.median_ms(lambda: engine, reps=reps, warmup=warmup)
        return engine

    def fp8_fns(row, hq, hkv, d, data, granularity, fns):
        for s in ("fused", "convert_once"):
            fns[f"fp8_{s}"] = lambda s=s: f"fp8_{s}"
        row["fp8_strategy"], row["fp8_config"] = "convert_once", "cfg"
        return "fp8"

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        get_default_memory_pool=lambda: types.SimpleNamespace(free_all_blocks=lambda: None)))
    monkeypatch.setattr(timing, "Timer", Timer)
    monkeypatch.setattr(bp, "peer_torch", lambda: (None, "no torch here"))
    monkeypatch.setattr(bp, "_build", lambda *a: None)
    monkeypatch.setattr(bp, "_time_cukv", time_cukv)
    monkeypatch.setattr(bp, "_fp8_fns", fp8_fns)
    monkeypatch.setattr(bp, "_maxdiff", lambda a, b: 0.0)
    monkeypatch.setattr(bp, "_device_name", lambda: "stub")
    res = bp.run(str(tmp_path), reps=6, kv_dtype="fp8_e4m3", shapes=[(1, 64, 2, 1, 64)])
    assert calls[0] == ("contig", 6)
    assert calls[1:] == [(n, 6) for n in ("paged", "fp8_fused", "fp8_convert_once")] * bp.FP8_ROUNDS
    r = res["rows"][0]
    assert (r["paged_ms"], r["contig_ms"], r["fp8_ms"], r["fp8_fused_ms"]) == (1.0, 1.1, 0.9, 1.3)
    assert r["fp8_vs_bf16"] == pytest.approx(1 / 0.9) and len(r["fp8_vs_bf16_rounds"]) == bp.FP8_ROUNDS
    saved = json.load(open(tmp_path / "bench_prefill_fp8_e4m3.json"))
    assert saved["summary"]["fp8_rounds"] == bp.FP8_ROUNDS and saved["rows"][0]["fp8_vs_bf16_rounds"]


def test_failed_lists_cukv_errors_only():
    assert bp.failed(fake_result()) == ["b4 L4096 h16/16 d256 contig: ValueError: no config"]


def test_kv_dtype_domain():
    assert bp.check_kv_dtype("bfloat16") == "bfloat16"
    assert bp.check_kv_dtype("fp8_e4m3") == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_dtype='int8'.*accepted: bfloat16, fp8_e4m3"):
        bp.check_kv_dtype("int8")
    with pytest.raises(ValueError, match="not supported"):
        bp.run(kv_dtype="float16")  # refused before anything touches a GPU


def test_cli_parses_bench_prefill():
    p = cli.build_parser()
    a = p.parse_args(["bench", "prefill", "--quick", "--out", "somewhere"])
    assert (a.cmd, a.what, a.quick, a.out, a.kv_dtype, a.reps) == ("bench", "prefill", True, "somewhere", "bfloat16", None)
    a = p.parse_args(["bench", "prefill", "--kv-dtype", "fp8_e4m3", "--reps", "7"])
    assert (a.kv_dtype, a.reps, a.quick) == ("fp8_e4m3", 7, False)
    a = p.parse_args(["bench", "decode", "--sweep"])
    assert (a.what, a.sweep, a.kv_dtype) == ("decode", True, "bfloat16")
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "mla"])


def test_cli_rejects_unsupported_kv_dtype_without_a_gpu(capsys):
    assert cli.main(["bench", "prefill", "--kv-dtype", "int4"]) == 2
    err = capsys.readouterr().err
    assert "int4" in err and "bfloat16" in err and "fp8_e4m3" in err
    assert cli.main(["bench", "decode", "--kv-dtype", "int4"]) == 2
    assert "int4" in capsys.readouterr().err


def test_cli_bench_prefill_needs_a_gpu():
    from cukv.device import has_gpu
    from cukv.errors import NoGPUError

    if has_gpu():
        pytest.skip("a GPU is visible: the benchmark would run")
    with pytest.raises(NoGPUError, match="cukv bench"):
        cli.main(["bench", "prefill", "--quick"])


def _env():
    """This checkout first on the path of a child process."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(bp.__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def test_help_works_and_lists_prefill():
    env = _env()
    r = subprocess.run([sys.executable, "-m", "cukv", "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "cukv", "bench", "--help"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "prefill" in r.stdout and "--kv-dtype" in r.stdout and "--quick" in r.stdout


def test_importing_the_harness_pulls_in_no_gpu_library():
    code = ("import sys, cukv.bench.prefill as bp; "
            "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_spin_kernel_compiles_without_spills():
    """The Timer's spin kernel (it covers a timed call's host work, cukv/bench/timing.py) builds through the one
    compile path, off the GPU."""
    from cukv import compiler

    rep = compiler.build("spin.cu.j2", "cukv_spin", name="cukv_spin").functions["cukv_spin"]
    assert rep.spill_stores == 0 and rep.registers <= 64, rep


@pytest.mark.parametrize("variant", CEILING_VARIANTS, ids=str)
def test_read_ceiling_kernels_compile_without_spills(variant):
    """Every read-ceiling variant builds off the GPU, within its launch's registers and shared memory."""
    from cukv.bench.timing import ceiling_kernel

    name, mod, block, smem = ceiling_kernel(variant)
    rep = mod.functions[name]
    assert rep.spill_stores == 0 and rep.registers <= 65536 // block and smem <= 227 * 1024, rep


def test_mla_configs_parse_both_schedules():
    from cukv.bench.mla_decode import config_label, parse_mla_configs

    # no flag: the policy's choice per shape (schedule, copies, slices); "split" rules slices out
    assert parse_mla_configs("64x2") == ((64, 2, None, None, None),)
    assert parse_mla_configs("64x2:alternate, 32x4:split") == ((64, 2, "alternate", None, None),
                                                               (32, 4, "split", None, False))
    assert parse_mla_configs("64x2:tma,64x2:cpasync:alternate,64x2:narrow") == (
        (64, 2, None, True, None), (64, 2, "alternate", False, None), (64, 2, "narrow", None, None))
    assert parse_mla_configs("64x2:alternate:slices,64x2:slices:alternate:tma") == (
        (64, 2, "alternate", None, True), (64, 2, "alternate", True, True))
    assert config_label(64, 2, "alternate") == "cukv_n64s2_alternate" and config_label(32, 4) == "cukv_n32s4"
    assert config_label(64, 2, "split", True) == "cukv_n64s2_split_tma"
    assert config_label(64, 2, tma=True) == "cukv_n64s2_tma" and config_label(64, 2, tma=False) == "cukv_n64s2_cpasync"
    assert config_label(*parse_mla_configs("64x2:alternate:slices")[0]) == "cukv_n64s2_alternate_slices"
    for bad in ("64", "64x2:alt", "ax2", "64x2:tma:cpasync", "64x2:slices", "64x2:alternate:cpasync:slices",
                "64x2:alternate:slices:slices"):
        with pytest.raises(ValueError, match="--mla-configs entry"):
            parse_mla_configs(bad)
    a = cli.build_parser().parse_args(["bench", "mla-decode", "--mla-configs", "64x2,64x2:alternate"])
    assert a.mla_configs == "64x2,64x2:alternate"
    assert cli.main(["bench", "mla-decode", "--mla-configs", "64x2,64x2:alt"]) == 2


def test_l2_discard_kernel_compiles_without_spills():
    """The Timer's flush kernel (discard.global.L2 over the flush buffer, cukv/bench/timing.py) builds off the GPU."""
    from cukv import compiler

    rep = compiler.build("l2_discard.cu.j2", "cukv_l2_discard", name="cukv_l2_discard").functions["cukv_l2_discard"]
    assert rep.spill_stores == 0 and rep.registers <= 32, rep


def test_timer_refuses_an_unknown_flush():
    from cukv.bench.timing import Timer

    with pytest.raises(ValueError, match="flush must be 'discard' or 'write'; got 'read'"):
        Timer(flush="read")
