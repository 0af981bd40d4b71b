"""The one compile path: Jinja2 render -> NVRTC -> cubin -> content-hashed disk cache -> CuPy module.

Everything up to the cubin works on a machine with no GPU (NVRTC and the CUDA headers come from the
``nvidia-cuda-nvrtc`` / ``nvidia-cuda-runtime`` wheels), which is how CI checks every shipped
specialization's resource report.

Environment switches
--------------------
CUKV_CACHE_DIR     where cubins live (default ``$XDG_CACHE_HOME/cukv`` or ``~/.cache/cukv``).
CUKV_ARCH          target, e.g. ``sm_90a`` (default: the GPU's, or ``sm_90a`` with no GPU).
CUKV_DUMP_SOURCE   a directory: every failing compile writes its source and headers there.
CUKV_NO_COMPILE    ``1``: raise :class:`CompileForbidden` instead of compiling (proves a warm run
                   is served from the cache).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile
import threading
import time
from functools import lru_cache
from pathlib import Path

import jinja2

from ._version import __version__
from .errors import CompileError, CompileForbidden

#: Bump when the cache layout or the meaning of a cached file changes.
CACHE_SCHEMA = 1

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
_lock = threading.Lock()
_modules: dict[str, object] = {}


# ----------------------------------------------------------------------------------------------
# locations


@lru_cache(maxsize=None)
def template_dir() -> Path:
    """The folder holding ``*.cu.j2`` and ``*.cuh`` (the repo's ``templates/`` or the wheel's copy)."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "templates", here / "templates"):
        if (cand / "common.cuh").is_file():
            return cand
    raise FileNotFoundError(f"cukv templates not found next to {here}")


def cache_dir() -> Path:
    env = os.environ.get("CUKV_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cukv"


@lru_cache(maxsize=None)
def cuda_include_dir() -> str | None:
    """Directory holding ``cuda_bf16.h`` and friends, or None when NVRTC's built-ins must do."""
    try:
        from cuda import pathfinder  # ships with cupy 14

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            return str(found)
    except Exception:  # noqa: BLE001 - any failure means: look elsewhere
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(env)
        if root and os.path.isfile(os.path.join(root, "include", "cuda_bf16.h")):
            return os.path.join(root, "include")
    if os.path.isfile("/usr/local/cuda/include/cuda_bf16.h"):
        return "/usr/local/cuda/include"
    return None


@lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    from cupy.cuda import nvrtc

    return tuple(nvrtc.getVersion())


@lru_cache(maxsize=None)
def target_arch() -> str:
    env = os.environ.get("CUKV_ARCH")
    if env:
        return env
    from .device import gpu_capability

    cc = gpu_capability()
    if cc is None or cc == (9, 0):
        return "sm_90a"  # wgmma/setmaxnreg need the arch-specific target
    return f"sm_{cc[0]}{cc[1]}"


# ----------------------------------------------------------------------------------------------
# rendering


@lru_cache(maxsize=None)
def _jinja_env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(template: str, **params) -> str:
    """Render ``templates/<template>`` with StrictUndefined: a missing parameter is an error."""
    return _jinja_env().get_template(template).render(**params)


def _headers_of(source: str) -> dict[str, str]:
    """Every ``#include "x"`` reachable from source, resolved in the template dir, by name."""
    out: dict[str, str] = {}
    todo = _INCLUDE_RE.findall(source)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        path = template_dir() / name
        if not path.is_file():
            continue  # a system header; NVRTC reports it if it is really missing
        text = path.read_text()
        out[name] = text
        todo.extend(_INCLUDE_RE.findall(text))
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------------------------
# compiling


@dataclasses.dataclass(frozen=True)
class FunctionReport:
    """ptxas's resource report for one kernel."""

    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    static_smem: int

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


@dataclasses.dataclass(frozen=True)
class CompiledModule:
    """A cubin on disk with its report. ``module()`` loads it on the current GPU (cached per process)."""

    name: str
    key: str
    cubin_path: Path
    functions: dict
    compile_seconds: float
    cache_hit: bool
    log: str

    def module(self):
        with _lock:
            mod = _modules.get(self.key)
            if mod is None:
                import cupy as cp

                mod = cp.RawModule(path=str(self.cubin_path))
                _modules[self.key] = mod
            return mod

    def function(self, entry: str, dynamic_smem: int = 0):
        fn = self.module().get_function(entry)
        if dynamic_smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < dynamic_smem:
            fn.max_dynamic_shared_size_bytes = dynamic_smem
        return fn


def compile_options(arch: str) -> list[str]:
    opts = ["-std=c++17", f"-arch={arch}", "--ptxas-options=-v", "-default-device", "-lineinfo",
            f"-I{template_dir()}"]
    inc = cuda_include_dir()
    if inc:
        opts.append(f"-I{inc}")
    return opts


def cache_key_fields(source: str, arch: str, options: list[str]) -> dict:
    """The named dict whose sha256 is the cache key (paths are left out so a moved checkout hits)."""
    stable_opts = [o for o in options if not o.startswith("-I")]
    return {
        "schema": CACHE_SCHEMA,
        "cukv": __version__,
        "nvrtc": list(nvrtc_version()),
        "arch": arch,
        "options": stable_opts,
        "source": source,
        "headers": {k: hashlib.sha256(v.encode()).hexdigest() for k, v in _headers_of(source).items()},
    }


def cache_key(source: str, arch: str | None = None) -> str:
    arch = arch or target_arch()
    fields = cache_key_fields(source, arch, compile_options(arch))
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


_PTXAS_FN = re.compile(r"Function properties for (\S+)")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas(log: str) -> dict[str, FunctionReport]:
    """Pull registers, spills, stack and static shared memory per function out of a ptxas -v log."""
    out: dict[str, FunctionReport] = {}
    cur, stack = None, (0, 0, 0)
    for line in log.splitlines():
        m = _PTXAS_FN.search(line)
        if m:
            cur, stack = m.group(1), (0, 0, 0)
            continue
        m = _PTXAS_STACK.search(line)
        if m and cur:
            stack = tuple(int(x) for x in m.groups())
            continue
        m = _PTXAS_REGS.search(line)
        if m and cur:
            out[cur] = FunctionReport(cur, int(m.group(1)), stack[1], stack[2], stack[0], int(m.group(2) or 0))
            cur = None
    return out


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the whole new one
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _dump(name: str, source: str) -> None:
    where = os.environ.get("CUKV_DUMP_SOURCE")
    if not where:
        return
    d = Path(where)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.cu").write_text(source)
    for hname, text in _headers_of(source).items():
        (d / hname).write_text(text)


def compile_source(name: str, source: str, arch: str | None = None) -> CompiledModule:
    """Compile (or find in the disk cache) one rendered module. Needs no GPU."""
    arch = arch or target_arch()
    options = compile_options(arch)
    fields = cache_key_fields(source, arch, options)
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    stem = cache_dir() / f"{name}-{key[:20]}"
    cubin, meta = stem.with_suffix(".cubin"), stem.with_suffix(".json")
    if cubin.is_file() and meta.is_file():
        try:
            info = json.loads(meta.read_text())
            if info.get("key") == key:
                return CompiledModule(name, key, cubin, {k: FunctionReport(**v) for k, v in info["functions"].items()},
                                      info["compile_seconds"], True, info.get("log", ""))
        except (ValueError, KeyError, TypeError):
            pass  # a damaged entry is rebuilt below
    if os.environ.get("CUKV_NO_COMPILE", "") not in ("", "0"):
        raise CompileForbidden(f"CUKV_NO_COMPILE is set and {name} (key {key[:20]}) is not in {cache_dir()}")

    from cupy.cuda import nvrtc

    t0 = time.perf_counter()
    prog = nvrtc.createProgram(source, f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(prog)
            _dump(name, source)
            raise CompileError(name, log, source) from None
        log = nvrtc.getProgramLog(prog)
        data = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    seconds = time.perf_counter() - t0
    functions = parse_ptxas(log)
    info = {"key": key, "name": name, "arch": arch, "nvrtc": list(nvrtc_version()), "cukv": __version__,
            "compile_seconds": seconds, "functions": {k: dataclasses.asdict(v) for k, v in functions.items()},
            "log": log}
    _atomic_write(cubin, data)
    _atomic_write(meta, json.dumps(info, indent=1).encode())
    return CompiledModule(name, key, cubin, functions, seconds, False, log)


def build(template: str, module_name: str, **params) -> CompiledModule:
    """Render ``template`` with params and compile it under the readable ``module_name``."""
    return compile_source(module_name, render(template, **params))
