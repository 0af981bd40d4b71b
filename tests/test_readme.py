"""The README runs as written: every ```python block executes on a GPU (each in a fresh namespace, in order),
and on any machine each block compiles and every shell command it shows exists (Makefile targets, `python -m
cukv` subcommands and their flags)."""
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README, re.S | re.M)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
SHELL = [code for lang, code in BLOCKS if lang in ("bash", "sh", "")]


def _make_targets():
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, re.M))


def _commands():
    """Each shell line without its comment, split into words."""
    for block in SHELL:
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                yield line, shlex.split(line)


def test_readme_has_blocks():
    assert len(PYTHON) >= 2, "the README's tour and FP8 screen are ```python blocks"
    assert "make install demo" in README and "make install test" in README and "make gpu-check OUT=out" in README


@pytest.mark.parametrize("i", range(len(PYTHON)))
def test_python_block_compiles(i):
    compile(PYTHON[i], f"README.md python block {i}", "exec")


def test_shell_commands_exist():
    from cukv.cli import build_parser

    targets = _make_targets()
    seen = 0
    for line, words in _commands():
        if words[0] == "make":
            for w in words[1:]:
                if "=" not in w:
                    assert w in targets, f"README runs `{line}`, but the Makefile has no target {w!r}"
            seen += 1
        elif words[:3] == ["python", "-m", "cukv"]:
            try:
                build_parser().parse_args(words[3:])
            except SystemExit as e:  # argparse exits on an unknown subcommand or flag
                pytest.fail(f"README runs `{line}`, which `python -m cukv` rejects ({e})")
            seen += 1
    assert seen >= 5


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(len(PYTHON)))
def test_python_block_runs(i):
    exec(compile(PYTHON[i], f"README.md python block {i}", "exec"), {"__name__": "__readme__"})


def test_performance_page_is_generated():
    """docs/performance.md is what benchmarks/perf_tables.py writes from the checked-in bench JSON (docs/perf/)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("perf_tables", ROOT / "benchmarks" / "perf_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    want = mod.render(str(ROOT / "docs" / "perf"))
    assert (ROOT / "docs" / "performance.md").read_text() == want, (
        "docs/performance.md is out of date with docs/perf/*.json; run `python3 benchmarks/perf_tables.py`")
