"""The one compile path: Jinja2 render -> NVRTC -> cubin -> content-hashed disk cache -> CuPy module.

Everything up to the cubin works on a machine with no GPU (NVRTC and the CUDA headers come from the
``nvidia-cuda-nvrtc`` / ``nvidia-cuda-runtime`` wheels), which is how CI checks every shipped
specialization's resource report. The report comes from ptxas's ``-v`` log; where NVRTC returns no log
(reported with NVRTC 13.0 on the GPU machine) registers, stack frame and static shared memory are read back
from the cubin's ELF sections instead (:func:`parse_cubin`; spill counts exist only in the log).

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
import struct
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
    """The resource report for one kernel.

    ``source`` says where it came from: ``"ptxas"`` (the ``--ptxas-options=-v`` log NVRTC returned) or
    ``"elf"`` (read back from the cubin's ``.nv.info`` attributes and ``.nv.shared.<kernel>`` section, used
    when the log lacks the kernel). Registers, stack frame and static shared memory agree between the two;
    spill byte counts exist only in the log, so an ``"elf"`` report carries 0 there (a nonzero
    ``stack_frame`` still shows local memory, spills included).
    """

    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    static_smem: int
    source: str = "ptxas"

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
        # the default cap is 48 KB minus the static shared memory, so any dynamic size may need the opt-in
        if dynamic_smem > 0 and fn.max_dynamic_shared_size_bytes < dynamic_smem:
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


# ----------------------------------------------------------------------------------------------
# the resource report from the cubin itself (when the ptxas log lacks it)

_EIFMT_SVAL = 0x04          # u8 fmt, u8 attr, u16 size, then size bytes; every other format is 4 bytes in all
_EIATTR_FRAME_SIZE = 0x11   # SVAL (u32 symbol index, u32 bytes): ptxas's "bytes stack frame"
_EIATTR_REGCOUNT = 0x2F     # SVAL (u32 symbol index, u32 registers)
_STT_FUNC = 2
_STO_CUDA_ENTRY = 0x10      # st_other bit of a __global__ function
_SHT_SYMTAB = 2
#: sm_90+ cubins start each kernel's ``.nv.shared.<kernel>`` with the 1 KB per block the driver reserves
#: (``cudaDevAttrReservedSharedMemoryPerBlock``); ptxas's "bytes smem" leaves it out. sm_100+ cubins name
#: the size in the ``.nv.reservedSmem.cap`` symbol; sm_90 cubins only reference ``.nv.reservedSmem.offset0``.
_RESERVED_SMEM_DEFAULT = 1024


def _elf_sections(data: bytes) -> list[tuple]:
    """(name, type, offset, size, link) for every section of a little-endian ELF64 file."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file (cubin)")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shentsize < 64 or shoff + shnum * shentsize > len(data) or shstrndx >= shnum:
        raise ValueError("cubin section header table is out of bounds")
    raw = [struct.unpack_from("<IIQQQQII", data, shoff + i * shentsize) for i in range(shnum)]
    str_off = raw[shstrndx][4]
    out = []
    for name_off, typ, _flags, _addr, off, size, link, _info in raw:
        end = data.index(b"\0", str_off + name_off)
        out.append((data[str_off + name_off:end].decode(), typ, off, size, link))
    return out


def _nv_info_attrs(blob: bytes):
    """(attr, fmt, payload) of each EIATTR record in a ``.nv.info*`` section (records sit on a 4-byte grid)."""
    p = 0
    while p + 4 <= len(blob):
        fmt, attr = blob[p], blob[p + 1]
        if fmt == _EIFMT_SVAL:
            size, = struct.unpack_from("<H", blob, p + 2)
            yield attr, fmt, blob[p + 4:p + 4 + size]
            p += 4 + size
            p += -p % 4
        else:  # NVAL / BVAL / HVAL: the value (if any) sits in the 2 bytes after fmt and attr
            yield attr, fmt, blob[p + 2:p + 4]
            p += 4


def parse_cubin(data: bytes) -> dict[str, FunctionReport]:
    """Registers, stack frame and static shared memory of every kernel in a cubin, from its ELF sections.

    Registers: EIATTR_REGCOUNT and stack: EIATTR_FRAME_SIZE in ``.nv.info`` (keyed by the kernel's symbol
    index; a per-kernel ``.nv.info.<kernel>`` copy is read too); static shared memory: the size of
    ``.nv.shared.<kernel>`` less the reserved prefix of sm_90+ cubins. Spills are not in the ELF: 0.
    Raises ValueError on a file that is not a well-formed cubin.
    """
    try:
        return _parse_cubin(data)
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed cubin: {e}") from None


def _parse_cubin(data: bytes) -> dict[str, FunctionReport]:
    secs = _elf_sections(data)
    by_name = {s[0]: s for s in secs}
    symtab = next((s for s in secs if s[1] == _SHT_SYMTAB), None)
    if symtab is None:
        raise ValueError("cubin has no symbol table")
    _, _, sym_off, sym_size, str_link = symtab
    str_off = secs[str_link][2]
    syms = []  # (name, info, other, value)
    for i in range(sym_size // 24):
        st_name, st_info, st_other, _shndx, st_value, _st_size = struct.unpack_from("<IBBHQQ", data, sym_off + 24 * i)
        end = data.index(b"\0", str_off + st_name)
        syms.append((data[str_off + st_name:end].decode(), st_info, st_other, st_value))
    kernels = {i: n for i, (n, info, other, _v) in enumerate(syms)
               if n and info & 0xF == _STT_FUNC and (other & _STO_CUDA_ENTRY or f".nv.info.{n}" in by_name)}

    regs: dict[int, int] = {}
    frame: dict[int, int] = {}

    def take(blob, sym_default=None):
        for attr, fmt, payload in _nv_info_attrs(blob):
            if attr not in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE):
                continue
            if fmt == _EIFMT_SVAL and len(payload) >= 8:
                sym, value = struct.unpack_from("<II", payload)
            elif fmt != _EIFMT_SVAL and sym_default is not None:
                sym, value = sym_default, struct.unpack("<H", payload)[0]
            else:
                continue
            (regs if attr == _EIATTR_REGCOUNT else frame)[sym] = value

    if ".nv.info" in by_name:
        _, _, off, size, _ = by_name[".nv.info"]
        take(data[off:off + size])
    for idx, name in kernels.items():
        sec = by_name.get(f".nv.info.{name}")
        if sec is not None:
            take(data[sec[2]:sec[2] + sec[3]], sym_default=idx)

    reserved = 0
    names = {n: v for n, _i, _o, v in syms}
    if ".nv.reservedSmem.cap" in names:
        reserved = names[".nv.reservedSmem.cap"]
    elif ".nv.reservedSmem.offset0" in names or any(n.startswith(".nv.shared.reserved.") for n in by_name):
        reserved = _RESERVED_SMEM_DEFAULT

    out: dict[str, FunctionReport] = {}
    for idx, name in kernels.items():
        if idx not in regs:
            continue  # not a function ptxas allocated registers for (a declaration, a stub)
        shared = by_name.get(f".nv.shared.{name}")
        smem = max(0, shared[3] - reserved) if shared is not None else 0
        out[name] = FunctionReport(name, regs[idx], 0, 0, frame.get(idx, 0), smem, "elf")
    return out


def resource_report(log: str, cubin: bytes) -> dict[str, FunctionReport]:
    """Per-kernel report: ptxas's log where it names the kernel, the cubin's ELF attributes otherwise."""
    out = parse_ptxas(log or "")
    try:
        from_elf = parse_cubin(cubin)
    except ValueError:
        return out  # the log is all there is
    for name, rep in from_elf.items():
        out.setdefault(name, rep)
    return dict(sorted(out.items()))


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


def _program_log(nvrtc, prog) -> str:
    """NVRTC's log after a successful compile; some NVRTC builds return it empty, or fail to return it."""
    try:
        log = nvrtc.getProgramLog(prog)
    except Exception:  # noqa: BLE001 - the report falls back to the cubin
        return ""
    if isinstance(log, bytes):
        log = log.decode(errors="replace")
    return log or ""


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
                functions = {k: FunctionReport(**v) for k, v in info["functions"].items()}
                if not functions:  # stored by a compile whose log was empty (before the ELF fallback)
                    functions = resource_report(info.get("log", ""), cubin.read_bytes())
                return CompiledModule(name, key, cubin, functions, info["compile_seconds"], True, info.get("log", ""))
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
        log = _program_log(nvrtc, prog)
        data = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    seconds = time.perf_counter() - t0
    functions = resource_report(log, data)
    info = {"key": key, "name": name, "arch": arch, "nvrtc": list(nvrtc_version()), "cukv": __version__,
            "compile_seconds": seconds, "functions": {k: dataclasses.asdict(v) for k, v in functions.items()},
            "log": log}
    _atomic_write(cubin, data)
    _atomic_write(meta, json.dumps(info, indent=1).encode())
    return CompiledModule(name, key, cubin, functions, seconds, False, log)


def build(template: str, module_name: str, **params) -> CompiledModule:
    """Render ``template`` with params and compile it under the readable ``module_name``."""
    return compile_source(module_name, render(template, **params))
