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
CUKV_DEFINES       extra preprocessor defines for every compile, ``NAME`` or ``NAME=VALUE`` separated by
                   spaces (``CUKV_DEFINES="CUKV_WAIT_STATS=1 CUKV_X"``): how a probe or an A/B experiment
                   flips a switch without editing a tracked file. They join the NVRTC options and the cache
                   key, as do the ``defines=`` of :func:`compile_source` (which win over the variable's).

The disk cache
--------------
An entry is ``<name>-<key>.cubin`` plus ``<name>-<key>.json`` (the report, and the cubin's sha256 and size).
The key is the sha256 of :func:`cache_key_fields`: the source, every header it includes, the options
(defines included), the arch, the NVRTC and cukv versions and :data:`CACHE_SCHEMA`. A cubin that does not
match its recorded hash (truncated, corrupt, missing) or unreadable metadata is a miss and is rebuilt.
Processes that ask for the same missing key take a file lock (``<name>-<key>.lock``): one compiles, the
others wait and then read its entry. Files are written to a temporary name and renamed, cubin first and
metadata last, so a reader never sees half a file.

Devices
-------
A :class:`CompiledModule` loads its cubin once per GPU it runs on; :meth:`CompiledModule.function`
returns a :class:`KernelFunction` that launches the current device's copy (with that copy's dynamic
shared-memory opt-in), so one op object's kernels run on any GPU of the host.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import struct
import tempfile
import threading
import time
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process lock (each process may compile a missing entry itself)
    fcntl = None

import jinja2

from ._version import __version__
from .errors import CompileError, CompileForbidden, CukvError

#: Bump when the cache layout or the meaning of a cached file changes.
#: 2: defines in the key, the cubin's sha256 and size in the metadata.
CACHE_SCHEMA = 2

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
_DEFINE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_lock = threading.Lock()
_modules: dict[tuple, object] = {}      # (key, cubin path, device id) -> cupy.RawModule
_functions: dict[tuple, object] = {}    # (key, cubin path, entry) -> KernelFunction


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
    """Render ``templates/<template>`` with StrictUndefined: a missing parameter is an error.

    Examples
    --------
    >>> from cukv import compiler
    >>> from cukv.configs import MergeConfig
    >>> cfg = MergeConfig("float16", head_dim=128)
    >>> src = compiler.render(cfg.template, **cfg.render_params())      # what cfg.render() does
    >>> src == cfg.render() and cfg.name in src
    True
    >>> compiler.render(cfg.template)
    Traceback (most recent call last):
    ...
    jinja2.exceptions.UndefinedError: 'name' is undefined
    """
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


def _arch_capability(arch: str) -> tuple[tuple[int, int], bool] | None:
    """``sm_90a`` -> ((9, 0), True); None for a target this check does not read."""
    m = re.fullmatch(r"sm_(\d+)(\d)([af]?)", arch or "")
    return ((int(m.group(1)), int(m.group(2))), bool(m.group(3))) if m else None


_get_device = None  # cupy.cuda.runtime.getDevice, looked up once: it runs at every launch


def _current_device() -> int:
    global _get_device
    if _get_device is None:
        from cupy.cuda import runtime

        _get_device = runtime.getDevice
    return _get_device()


class KernelFunction:
    """One kernel of a :class:`CompiledModule`, launched like a ``cupy.RawKernel`` on whichever GPU is current.

    The cubin is loaded once per device (the first launch there) and that device's copy gets the dynamic
    shared-memory opt-in; ``kf(grid, block, args, shared_mem=...)`` costs one device-id query more than a
    bare ``RawKernel``. Attributes other than the call (``num_regs``, ``max_dynamic_shared_size_bytes``...)
    are read from the current device's copy.
    """

    __slots__ = ("_module", "entry", "dynamic_smem", "_by_device")

    def __init__(self, module: "CompiledModule", entry: str, dynamic_smem: int = 0):
        self._module = module
        self.entry = entry
        self.dynamic_smem = int(dynamic_smem)
        self._by_device: dict[int, object] = {}

    def _need(self, dynamic_smem: int) -> None:
        if dynamic_smem > self.dynamic_smem:
            with _lock:
                self.dynamic_smem = int(dynamic_smem)
                self._by_device = {}  # each device's copy gets the larger opt-in at its next launch

    def on_device(self, device: int | None = None):
        """The ``cupy.RawKernel`` loaded on ``device`` (default: the current one), opt-in applied."""
        dev = _current_device() if device is None else int(device)
        fn = self._by_device.get(dev)
        if fn is None:
            fn = self._load(dev)
        return fn

    def _load(self, dev: int):
        import cupy as cp

        with cp.cuda.Device(dev):
            fn = self._module.module(dev).get_function(self.entry)
            # the default cap is 48 KB minus the static shared memory, so any dynamic size may need the opt-in
            if self.dynamic_smem > 0 and fn.max_dynamic_shared_size_bytes < self.dynamic_smem:
                fn.max_dynamic_shared_size_bytes = self.dynamic_smem
        with _lock:
            self._by_device[dev] = fn
        return fn

    def __call__(self, grid, block, args, **kwargs):
        dev = _current_device()
        fn = self._by_device.get(dev)
        if fn is None:
            fn = self._load(dev)
        fn(grid, block, args, **kwargs)

    def __getattr__(self, name):
        if name.startswith("_"):  # our own slots before __init__ (copy, pickle): never the device's copy
            raise AttributeError(name)
        return getattr(self.on_device(), name)

    def __repr__(self):
        return (f"KernelFunction({self.entry!r}, dynamic_smem={self.dynamic_smem}, "
                f"loaded on devices {sorted(self._by_device)})")


@dataclasses.dataclass(frozen=True)
class CompiledModule:
    """A cubin on disk with its report. ``module()``/``function()`` load it on the current GPU, once per device
    per process."""

    name: str
    key: str
    cubin_path: Path
    functions: dict
    compile_seconds: float
    cache_hit: bool
    log: str
    arch: str = ""
    defines: tuple = ()

    def module(self, device: int | None = None):
        """The ``cupy.RawModule`` of this cubin on ``device`` (default: the current one)."""
        dev = _current_device() if device is None else int(device)
        with _lock:
            mod = _modules.get((self.key, str(self.cubin_path), dev))
        if mod is not None:
            return mod
        self._check_device(dev)
        import cupy as cp

        with cp.cuda.Device(dev):
            mod = cp.RawModule(path=str(self.cubin_path))  # CuPy loads it on dev at the first get_function
        with _lock:
            return _modules.setdefault((self.key, str(self.cubin_path), dev), mod)

    def function(self, entry: str, dynamic_smem: int = 0) -> KernelFunction:
        """The kernel ``entry``, callable on any GPU (see :class:`KernelFunction`). One object per entry: a
        larger ``dynamic_smem`` than an earlier call's raises the opt-in on every device."""
        with _lock:
            at = (self.key, str(self.cubin_path), entry)
            kf = _functions.get(at)
            if kf is None:
                kf = _functions[at] = KernelFunction(self, entry, dynamic_smem)
        kf._need(int(dynamic_smem))
        return kf

    def _check_device(self, dev: int) -> None:
        want = _arch_capability(self.arch)
        if want is None:
            return
        from .device import gpu_capability

        cc = gpu_capability(dev)
        if cc is None:
            return  # let CuPy report whatever is wrong with the device
        (major, minor), specific = want
        ok = cc == (major, minor) if specific else (cc[0] == major and cc[1] >= minor)
        if not ok:
            raise CukvError(
                f"{self.name} was compiled for {self.arch}, which device {dev} (sm_{cc[0]}{cc[1]}) cannot run; "
                f"set CUKV_ARCH=sm_{cc[0]}{cc[1]}{'a' if cc[0] >= 9 else ''} (the cache keeps both) or run on a "
                f"device of compute capability {major}.{minor}")


# ----------------------------------------------------------------------------------------------
# defines


def parse_defines(defines, what: str = "defines") -> dict[str, str | None]:
    """Preprocessor defines as ``{NAME: VALUE or None}`` (None: a bare ``-DNAME``).

    Accepts a mapping (``{"CUKV_FOO": 1, "CUKV_BAR": None}``; True/False become 1/0), a sequence of
    ``"NAME"``/``"NAME=VALUE"`` strings or ``(name, value)`` pairs, or one string of such tokens separated by
    whitespace (the form of ``CUKV_DEFINES``). ``what`` names the source in errors.

    Examples
    --------
    >>> from cukv.compiler import parse_defines
    >>> parse_defines("CUKV_WAIT_STATS=1 CUKV_X")
    {'CUKV_WAIT_STATS': '1', 'CUKV_X': None}
    >>> parse_defines({"CUKV_FOO": True})
    {'CUKV_FOO': '1'}
    >>> parse_defines("1X=2")
    Traceback (most recent call last):
    ...
    ValueError: defines: '1X' is not a macro name (a C identifier: letters, digits, '_', not starting with a digit); expected NAME or NAME=VALUE
    """
    if defines is None:
        return {}
    if isinstance(defines, str):
        items = [tuple(t.split("=", 1)) if "=" in t else (t, None) for t in defines.split()]
    elif isinstance(defines, Mapping):
        items = list(defines.items())
    else:
        try:
            seq = list(defines)
        except TypeError:
            raise TypeError(f"{what}={defines!r} must be a mapping NAME -> value, a sequence of 'NAME' or "
                            "'NAME=VALUE' strings, or None") from None
        items = []
        for t in seq:
            if isinstance(t, str):
                items.append(tuple(t.split("=", 1)) if "=" in t else (t, None))
            elif isinstance(t, tuple) and len(t) == 2:
                items.append(t)
            else:
                raise TypeError(f"{what}: entry {t!r} must be 'NAME', 'NAME=VALUE' or a (name, value) pair")
    out: dict[str, str | None] = {}
    for name, value in items:
        if not isinstance(name, str) or not _DEFINE_NAME.match(name):
            raise ValueError(f"{what}: {name!r} is not a macro name (a C identifier: letters, digits, '_', "
                             "not starting with a digit); expected NAME or NAME=VALUE")
        if value is not None:
            if isinstance(value, bool):
                value = int(value)
            if not isinstance(value, (str, int, float)) or isinstance(value, float) and value != value:
                raise ValueError(f"{what}: the value of {name} is {value!r}; expected a string or a number")
            value = str(value)
            if any(c.isspace() for c in value):
                raise ValueError(f"{what}: the value of {name} is {value!r}; whitespace is not allowed")
        out[name] = value
    return out


def env_defines() -> dict[str, str | None]:
    """The defines ``CUKV_DEFINES`` asks for (read at each call)."""
    return parse_defines(os.environ.get("CUKV_DEFINES", ""), "CUKV_DEFINES")


def resolve_defines(defines=None) -> tuple[str, ...]:
    """``CUKV_DEFINES`` merged with ``defines`` (which wins on a shared name), as sorted ``NAME[=VALUE]``."""
    merged = {**env_defines(), **parse_defines(defines)}
    return tuple(n if v is None else f"{n}={v}" for n, v in sorted(merged.items()))


def compile_options(arch: str) -> list[str]:
    opts = ["-std=c++17", f"-arch={arch}", "--ptxas-options=-v", "-default-device", "-lineinfo",
            f"-I{template_dir()}"]
    inc = cuda_include_dir()
    if inc:
        opts.append(f"-I{inc}")
    return opts


def cache_key_fields(source: str, arch: str, options: list[str]) -> dict:
    """The named dict whose sha256 is the cache key (paths are left out so a moved checkout hits; defines
    are in ``options`` and, for reading, in ``defines``)."""
    stable_opts = [o for o in options if not o.startswith("-I")]
    return {
        "schema": CACHE_SCHEMA,
        "cukv": __version__,
        "nvrtc": list(nvrtc_version()),
        "arch": arch,
        "options": stable_opts,
        "defines": [o[2:] for o in stable_opts if o.startswith("-D")],
        "source": source,
        "headers": {k: hashlib.sha256(v.encode()).hexdigest() for k, v in _headers_of(source).items()},
    }


def _options_and_key(source: str, arch: str, defines) -> tuple[list[str], tuple[str, ...], str]:
    defs = resolve_defines(defines)
    options = compile_options(arch) + [f"-D{d}" for d in defs]
    fields = cache_key_fields(source, arch, options)
    return options, defs, hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def cache_key(source: str, arch: str | None = None, defines=None) -> str:
    """The key :func:`compile_source` files this source under (``CUKV_DEFINES`` included)."""
    return _options_and_key(source, arch or target_arch(), defines)[2]


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


@contextlib.contextmanager
def _key_lock(path: Path):
    """An exclusive ``flock`` on ``path`` (created if missing) for the body; none where fcntl is missing."""
    if fcntl is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock; the lock file stays (removing it would race a waiter)


def _read_entry(name: str, key: str, cubin: Path, meta: Path, arch: str, defines: tuple) -> CompiledModule | None:
    """The cached entry if its metadata parses, names this key and its cubin matches the recorded sha256 and
    size; None (a miss, to be rebuilt) otherwise."""
    try:
        info = json.loads(meta.read_text())
        if info.get("key") != key:
            return None
        data = cubin.read_bytes()
        if len(data) != info["cubin_bytes"] or hashlib.sha256(data).hexdigest() != info["cubin_sha256"]:
            return None
        functions = {k: FunctionReport(**v) for k, v in info["functions"].items()}
        if not functions:  # a compile whose log was empty: read the report from the cubin
            functions = resource_report(info.get("log", ""), data)
        return CompiledModule(name, key, cubin, functions, info["compile_seconds"], True, info.get("log", ""),
                              arch, defines)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def compile_source(name: str, source: str, arch: str | None = None, defines=None) -> CompiledModule:
    """Compile (or find in the disk cache) one rendered module. Needs no GPU.

    ``defines`` (see :func:`parse_defines`) are added to ``CUKV_DEFINES``'s, passed to NVRTC as ``-D`` and
    keyed. Concurrent callers (threads or processes) of one missing key compile it once.

    Examples
    --------
    >>> from cukv import compiler
    >>> from cukv.configs import MergeConfig
    >>> cfg = MergeConfig("float16", head_dim=128)
    >>> mod = compiler.compile_source(cfg.name, cfg.render())           # NVRTC for sm_90a, or the disk cache
    >>> mod.functions[cfg.name].registers > 0                           # the resource report
    True
    >>> src = cfg.render()                                              # an experiment's define is its own entry
    >>> compiler.cache_key(src) != compiler.cache_key(src, defines={"CUKV_EXPERIMENT": 1})
    True
    """
    arch = arch or target_arch()
    options, defs, key = _options_and_key(source, arch, defines)
    stem = cache_dir() / f"{name}-{key[:20]}"
    cubin, meta = stem.with_suffix(".cubin"), stem.with_suffix(".json")
    hit = _read_entry(name, key, cubin, meta, arch, defs)
    if hit is not None:
        return hit
    if os.environ.get("CUKV_NO_COMPILE", "") not in ("", "0"):
        raise CompileForbidden(f"CUKV_NO_COMPILE is set and {name} (key {key[:20]}) is not in {cache_dir()}")
    with _key_lock(stem.with_suffix(".lock")):
        hit = _read_entry(name, key, cubin, meta, arch, defs)  # another process compiled it while we waited
        if hit is not None:
            return hit
        return _compile(name, source, arch, options, defs, key, cubin, meta)


def _compile(name, source, arch, options, defs, key, cubin: Path, meta: Path) -> CompiledModule:
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
    info = {"key": key, "name": name, "arch": arch, "defines": list(defs), "nvrtc": list(nvrtc_version()),
            "cukv": __version__, "compile_seconds": seconds, "compiled_at": time.time(), "pid": os.getpid(),
            "cubin_sha256": hashlib.sha256(data).hexdigest(), "cubin_bytes": len(data),
            "functions": {k: dataclasses.asdict(v) for k, v in functions.items()}, "log": log}
    _atomic_write(cubin, data)  # cubin first, metadata last: an entry with metadata is complete
    _atomic_write(meta, json.dumps(info, indent=1).encode())
    return CompiledModule(name, key, cubin, functions, seconds, False, log, arch, defs)


def build(template: str, module_name: str, defines=None, **params) -> CompiledModule:
    """Render ``template`` with params and compile it under the readable ``module_name``."""
    return compile_source(module_name, render(template, **params), defines=defines)
