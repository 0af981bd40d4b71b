"""The package's import graph: no cycle (module- and function-level imports alike), and the layering rule
(ops -> configs/policy -> compiler/operand -> leaves; ``autotune``, ``bench`` and ``cli`` on top, imported by nothing
below them; ``reference`` imports nothing of cukv). Read with ``ast``: no module is imported."""
import ast
import functools
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "cukv"
#: modules on top: nothing else in the package may import them
TOP = ("cukv.autotune", "cukv.bench", "cukv.cli", "cukv.__main__")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict) -> set:
    """The cukv modules ``name`` imports anywhere in its body: ``import cukv.x``, ``from cukv.x import y``, relative
    forms; ``from pkg import y`` counts as ``pkg.y`` where that is a module, else as ``pkg``."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else list(here)
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # import cukv.a.b -> the deepest module that exists
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


@functools.lru_cache(maxsize=None)
def _graph() -> dict:
    """module -> the cukv modules it imports (parsed once per session; the tests only read it)."""
    modules = _modules()
    return {n: _imports(n, p, modules) for n, p in modules.items()}


def _cycles(graph: dict) -> list:
    """Every strongly connected component of more than one module (or a module importing itself)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _edges_within(graph, comp):
    return [f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in comp]


def test_the_graph_sees_the_package():
    g = _graph()
    assert {"cukv", "cukv.ops.prefill", "cukv.configs.prefill", "cukv.policy.prefill", "cukv.tuned"} <= set(g)
    assert "cukv.configs.prefill" in g["cukv.ops.prefill"]
    assert "cukv.ops.prefill" in g["cukv.autotune"]  # a function-level import counts


def test_no_import_cycle():
    g = _graph()
    cycles = _cycles(g)
    assert not cycles, "import cycles:\n" + "\n".join(
        f"  {' <-> '.join(c)}:\n    " + "\n    ".join(_edges_within(g, c)) for c in cycles)


def _is(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_nothing_below_imports_the_top():
    g = _graph()
    bad = [f"{a} -> {b}" for a, deps in sorted(g.items()) if not any(_is(a, t) for t in TOP)
           for b in sorted(deps) if any(_is(b, t) for t in TOP)]
    assert not bad, "modules below autotune/bench/cli import them:\n  " + "\n  ".join(bad)


def test_reference_imports_nothing_of_cukv():
    assert _graph()["cukv.reference"] == set()


@pytest.mark.parametrize("below,above", [
    ("cukv.configs", "cukv.ops"), ("cukv.policy", "cukv.ops"), ("cukv.configs", "cukv.policy"),
    ("cukv.tuned", "cukv.ops"), ("cukv.compiler", "cukv.configs"), ("cukv.kvcache", "cukv.ops"),
])
def test_layers(below, above):
    """Lower layers never import higher ones (configs sit below policy: a policy builds configs)."""
    g = _graph()
    bad = [f"{a} -> {b}" for a, deps in sorted(g.items()) if _is(a, below) for b in sorted(deps) if _is(b, above)]
    assert not bad, "\n  ".join(bad)


def test_no_module_shadowed_by_a_name():
    """``cukv.prefill`` and ``cukv.decode`` are functions; no top-level module of that name exists."""
    names = {p.stem for p in PKG.glob("*.py")} | {p.name for p in PKG.iterdir() if p.is_dir()}
    import cukv

    shadowed = [n for n in cukv.__all__ if n in names]
    assert not shadowed, shadowed
