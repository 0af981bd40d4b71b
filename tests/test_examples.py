"""Every example runs to completion and says OK (without a GPU: its reference path, kernels still compiled)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_there_are_examples():
    assert EXAMPLES, "examples/*.py is empty"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path, tmp_path):
    # this checkout's cukv, not an installed one
    env = dict(os.environ, CUKV_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("CUKV_NO_COMPILE", None)
    p = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, f"{path.name} exited {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    lines = p.stdout.strip().splitlines()
    assert lines, f"{path.name} printed nothing; stderr:\n{p.stderr}"
    assert "OK" in lines[-1], f"{path.name}: last line is {lines[-1]!r}"
