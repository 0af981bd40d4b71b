"""Every docstring example in the package runs: one case per docstring with ``>>>`` examples.

The docstrings are found by ``doctest.DocTestFinder`` over every module of ``cukv`` (``pkgutil.walk_packages``).
Each docstring runs in an empty namespace, so an example imports every name it uses.

Convention (the one place that says which examples need a GPU): **a docstring whose first example imports
CuPy** (``>>> import cupy as cp`` or ``>>> import cupy as cp, numpy as np, cukv``) allocates on a GPU or
launches a kernel; its case is marked ``gpu`` and skipped with a reason where no GPU is visible (tests/conftest.py),
and ``make gpu-check`` runs it. Every other docstring runs on any machine, here included: a CPU example that
touches the GPU fails here, which keeps the convention honest.
"""
import doctest
import importlib
import io
import pkgutil
import re
from pathlib import Path

import pytest

import cukv

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
ROOT = Path(cukv.__file__).resolve().parent
#: switches that change what an example does (compiles refused, extra defines, checked mode, tuned tiles)
ENV = ("CUKV_NO_COMPILE", "CUKV_DEFINES", "CUKV_DUMP_SOURCE", "CUKV_CHECK", "CUKV_AUTOTUNE")

#: the public entry points that must carry an example of their own (cukv/__init__.py's names, errors aside)
PUBLIC = ("BatchDecode", "BatchPrefill", "PagedKVCache", "SequenceTable", "PageTable", "PageAllocator", "append_kv",
          "merge_states", "merge_states_n", "dequantize_kv", "decode", "prefill", "DecodeConfig", "PrefillConfig",
          "KVBufferConfig", "AppendConfig", "MergeConfig", "DequantConfig", "MLAKVCache", "append_mla", "BatchMLADecode",
          "mla_decode", "MLADecodeConfig", "BatchMLAPrefill", "mla_prefill", "MLAPrefillConfig", "SparseMLA",
          "sparse_mla_prefill", "sparse_mla_decode", "sparse_indices")


def _modules():
    names = ["cukv"] + sorted(m.name for m in pkgutil.walk_packages(cukv.__path__, "cukv.")
                              if m.name != "cukv.__main__")  # __main__ runs the CLI on import
    return [importlib.import_module(n) for n in names]


def _doctests():
    finder = doctest.DocTestFinder(exclude_empty=True)
    seen, tests = set(), []
    for mod in _modules():
        for t in finder.find(mod, mod.__name__, globs={}):
            if t.examples and t.name not in seen:
                seen.add(t.name)
                tests.append(t)
    return sorted(tests, key=lambda t: t.name)


def needs_gpu(test: doctest.DocTest) -> bool:
    """The convention above: the first example imports CuPy."""
    return re.match(r"import cupy\b", test.examples[0].source.strip()) is not None


TESTS = _doctests()


@pytest.mark.parametrize("test", [pytest.param(t, id=t.name, marks=[pytest.mark.gpu] if needs_gpu(t) else [])
                                  for t in TESTS])
def test_docstring_examples(test, monkeypatch):
    for var in ENV:  # examples show the library's defaults, whatever switches the calling shell set
        monkeypatch.delenv(var, raising=False)
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    result = runner.run(test, out=out.write, clear_globs=True)
    if result.failed:
        pytest.fail(f"{result.failed} of {result.attempted} examples failed in {test.name} "
                    f"({test.filename}:{test.lineno}):\n{out.getvalue()}", pytrace=False)


def test_both_kinds_are_collected():
    gpu = [t for t in TESTS if needs_gpu(t)]
    assert len(gpu) >= 8, [t.name for t in gpu]
    assert len(TESTS) - len(gpu) >= 8, [t.name for t in TESTS if not needs_gpu(t)]


def test_no_skipped_examples():
    """No example opts out of running."""
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        assert "+SKIP" not in text, f"{path.relative_to(ROOT.parent)} skips a doctest example; make it run"


@pytest.mark.parametrize("name", PUBLIC)
def test_public_names_have_examples(name):
    obj = getattr(cukv, name)
    assert ">>>" in (obj.__doc__ or ""), f"cukv.{name} has no example in its docstring"


def test_gpu_examples_import_cupy_first():
    """An example that uses ``cp.`` is a GPU example, so it says so by importing CuPy first."""
    for t in TESTS:
        if not needs_gpu(t):
            uses = [e.source for e in t.examples if re.search(r"\bcp\.", e.source)]
            assert not uses, f"{t.name} uses CuPy ({uses[0].strip()!r}) but its first example does not import cupy"
