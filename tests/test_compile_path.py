"""The compile path without a GPU: cache keys, the disk cache, the environment switches, errors, ptxas
reports, strict rendering and atomic writes."""
import json
import os
import pickle
import re
import shutil

import jinja2
import pytest

from cukv import AppendConfig, CompileError, CompileForbidden, DecodeConfig, compiler
from cukv.policy.decode import decode_config
from cukv.errors import CukvError

ARCH = "sm_90a"

TINY = """extern "C" __global__ void {name}(float* x) {{ x[threadIdx.x] = {value}f; }}
"""
WITH_HEADER = """#include "common.cuh"
extern "C" __global__ void hdr_kernel(float* x) { x[threadIdx.x] = 2.f; }
"""


def tiny(name="cukv_test_tiny", value="1.0"):
    return TINY.format(name=name, value=value)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory; compiler functions read the environment at call time."""
    d = tmp_path / "kcache"
    monkeypatch.setenv("CUKV_CACHE_DIR", str(d))
    monkeypatch.delenv("CUKV_NO_COMPILE", raising=False)
    monkeypatch.delenv("CUKV_DUMP_SOURCE", raising=False)
    return d


# ----------------------------------------------------------------------------------------------
# cache keys


def test_cache_key_is_stable():
    src = tiny()
    k = compiler.cache_key(src, ARCH)
    assert re.fullmatch(r"[0-9a-f]{64}", k)
    assert compiler.cache_key(src, ARCH) == k
    assert compiler.cache_key(str(src), ARCH) == k


def test_cache_key_changes_with_source_and_arch():
    k = compiler.cache_key(tiny(), ARCH)
    assert compiler.cache_key(tiny(value="2.0"), ARCH) != k
    assert compiler.cache_key(tiny() + "\n", ARCH) != k  # any byte counts
    assert compiler.cache_key(tiny(), "sm_80") != k


def test_cache_key_changes_with_options(monkeypatch):
    k = compiler.cache_key(tiny(), ARCH)
    real = compiler.compile_options
    monkeypatch.setattr(compiler, "compile_options", lambda arch: real(arch) + ["-DCUKV_EXTRA=1"])
    assert compiler.cache_key(tiny(), ARCH) != k
    monkeypatch.setattr(compiler, "compile_options", lambda arch: [o for o in real(arch) if o != "-lineinfo"])
    assert compiler.cache_key(tiny(), ARCH) != k


def test_cache_key_ignores_include_paths():
    """-I paths are left out so a moved checkout (or another venv) still hits."""
    opts = compiler.compile_options(ARCH)
    moved = [o if not o.startswith("-I") else "-I/somewhere/else" for o in opts]
    assert compiler.cache_key_fields(tiny(), ARCH, opts) == compiler.cache_key_fields(tiny(), ARCH, moved)
    f = compiler.cache_key_fields(tiny(), ARCH, opts)
    assert not any(o.startswith("-I") for o in f["options"])
    assert {"schema", "cukv", "nvrtc", "arch", "options", "source", "headers"} <= set(f)


def test_cache_key_covers_included_headers(tmp_path, monkeypatch):
    tdir = tmp_path / "templates"
    shutil.copytree(compiler.template_dir(), tdir)
    monkeypatch.setattr(compiler, "template_dir", lambda: tdir)
    fields = compiler.cache_key_fields(WITH_HEADER, ARCH, compiler.compile_options(ARCH))
    assert "common.cuh" in fields["headers"]
    k = compiler.cache_key(WITH_HEADER, ARCH)
    (tdir / "common.cuh").write_text((tdir / "common.cuh").read_text() + "\n// edited\n")
    assert compiler.cache_key(WITH_HEADER, ARCH) != k


def test_decode_source_key_covers_its_headers():
    fields = compiler.cache_key_fields(decode_config().render(), ARCH, compiler.compile_options(ARCH))
    # everything the decode kernel includes from templates/ is hashed (transitively)
    assert {"decode.cuh", "common.cuh", "kv_operand.cuh"} <= set(fields["headers"])


# ----------------------------------------------------------------------------------------------
# the disk cache


def test_second_compile_is_a_cache_hit(cache):
    a = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    assert not a.cache_hit
    assert a.cubin_path.is_file() and a.cubin_path.parent == cache
    assert a.cubin_path.read_bytes()[:4] == b"\x7fELF"
    meta = json.loads(a.cubin_path.with_suffix(".json").read_text())
    assert meta["key"] == a.key and meta["arch"] == ARCH
    b = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    assert b.cache_hit
    assert b.key == a.key and b.cubin_path == a.cubin_path
    assert b.functions == a.functions
    assert "cukv_test_tiny" in b.functions
    assert len(list(cache.glob("*.cubin"))) == 1
    c = compiler.compile_source("cukv_test_tiny", tiny(value="3.0"), arch=ARCH)
    assert not c.cache_hit and c.key != a.key
    assert len(list(cache.glob("*.cubin"))) == 2


def test_damaged_cache_entry_is_rebuilt(cache):
    a = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    a.cubin_path.with_suffix(".json").write_text("{not json")
    b = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    assert not b.cache_hit
    assert compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH).cache_hit
    # a metadata file whose key does not match is not trusted either
    meta = a.cubin_path.with_suffix(".json")
    info = json.loads(meta.read_text())
    info["key"] = "0" * 64
    meta.write_text(json.dumps(info))
    assert not compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH).cache_hit


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("CUKV_CACHE_DIR", str(tmp_path / "a"))
    assert compiler.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("CUKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compiler.cache_dir() == tmp_path / "xdg" / "cukv"


def test_no_compile_forbids_misses_and_serves_hits(cache, monkeypatch):
    hit = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    monkeypatch.setenv("CUKV_NO_COMPILE", "1")
    again = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    assert again.cache_hit and again.key == hit.key
    with pytest.raises(CompileForbidden, match="cukv_test_other") as ei:
        compiler.compile_source("cukv_test_other", tiny("cukv_test_other"), arch=ARCH)
    assert isinstance(ei.value, CukvError)
    assert str(cache) in str(ei.value)
    assert len(list(cache.glob("*.cubin"))) == 1  # nothing new was written
    monkeypatch.setenv("CUKV_NO_COMPILE", "0")  # "0" means off
    assert not compiler.compile_source("cukv_test_other", tiny("cukv_test_other"), arch=ARCH).cache_hit


# ----------------------------------------------------------------------------------------------
# errors

BROKEN = """extern "C" __global__ void cukv_test_broken(float* x) {
  x[threadIdx.x] = 1.f
}
"""


def test_syntax_error_raises_compile_error(cache):
    with pytest.raises(CompileError) as ei:
        compiler.compile_source("cukv_test_broken", BROKEN, arch=ARCH)
    e = ei.value
    assert isinstance(e, CukvError)
    assert e.name == "cukv_test_broken"
    assert e.log.strip()
    assert "error" in e.log
    assert "cukv_test_broken.cu(" in e.log  # NVRTC's line references name the module
    lines = e.source.splitlines()
    assert len(lines) == len(BROKEN.splitlines())
    assert re.match(r"^\s+1  extern \"C\"", lines[0])
    assert re.match(r"^\s+2    x\[threadIdx\.x\] = 1\.f$", lines[1])
    assert "CUKV_DUMP_SOURCE" in str(e) and e.log.strip().splitlines()[0] in str(e)
    assert not list(cache.glob("*.cubin")) and not list(cache.glob("*.json"))  # nothing cached for a failure
    # it crosses process boundaries intact (`python -m cukv compile --jobs N` runs compiles in worker processes)
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), back.name, back.log, back.source, str(back)) == (CompileError, e.name, e.log, e.source, str(e))


def test_dump_source_on_error(cache, tmp_path, monkeypatch):
    dump = tmp_path / "dump"
    monkeypatch.setenv("CUKV_DUMP_SOURCE", str(dump))
    compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)  # success: nothing dumped
    assert not dump.exists() or not list(dump.iterdir())
    src = '#include "common.cuh"\n' + BROKEN
    with pytest.raises(CompileError):
        compiler.compile_source("cukv_test_broken", src, arch=ARCH)
    assert (dump / "cukv_test_broken.cu").read_text() == src
    assert (dump / "common.cuh").read_text() == (compiler.template_dir() / "common.cuh").read_text()


def test_strict_undefined_rendering(monkeypatch):
    seen = {}
    real = compiler.render

    def spy(template, **params):
        seen.update(template=template, params=params)
        return real(template, **params)

    monkeypatch.setattr(compiler, "render", spy)
    decode_config().render()
    assert seen["template"] == "decode.cu.j2"
    params = dict(seen["params"])
    assert compiler._jinja_env().undefined is jinja2.StrictUndefined
    for missing in ("name", "head_dim", "smem_bytes", "num_mmas"):
        p = {k: v for k, v in params.items() if k != missing}
        with pytest.raises(jinja2.UndefinedError, match=missing):
            real("decode.cu.j2", **p)


# ----------------------------------------------------------------------------------------------
# ptxas reports

SAMPLE_PTXAS = """ptxas info    : 89 bytes gmem
ptxas info    : Compiling entry function 'kern_a' for 'sm_90a'
ptxas info    : Function properties for kern_a
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 202 registers, used 1 barriers, 2720 bytes smem
ptxas info    : Compile time = 217.196 ms
ptxas info    : Compiling entry function 'kern_b' for 'sm_90a'
ptxas info    : Function properties for kern_b
ptxas         .     208 bytes stack frame, 268 bytes spill stores, 296 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 208 bytes cumulative stack size, 1568 bytes smem
ptxas info    : Compiling entry function 'kern_c' for 'sm_90a'
ptxas info    : Function properties for kern_c
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers
\x00"""


def test_parse_ptxas_sample():
    r = compiler.parse_ptxas(SAMPLE_PTXAS)
    assert set(r) == {"kern_a", "kern_b", "kern_c"}
    a, b, c = r["kern_a"], r["kern_b"], r["kern_c"]
    assert (a.registers, a.spill_stores, a.spill_loads, a.stack_frame, a.static_smem) == (202, 0, 0, 0, 2720)
    assert (b.registers, b.spill_stores, b.spill_loads, b.stack_frame, b.static_smem) == (128, 268, 296, 208, 1568)
    assert b.spills == 564
    assert (c.registers, c.spills, c.stack_frame, c.static_smem) == (32, 0, 0, 0)
    assert compiler.parse_ptxas("") == {}


def test_parse_ptxas_of_a_real_compile(cache):
    src = """extern "C" __global__ void cukv_test_smem(float* x) {
  __shared__ float buf[256];
  buf[threadIdx.x] = x[threadIdx.x];
  __syncthreads();
  x[threadIdx.x] = buf[255 - threadIdx.x];
}
"""
    m = compiler.compile_source("cukv_test_smem", src, arch=ARCH)
    r = m.functions["cukv_test_smem"]
    assert r.static_smem == 1024 and r.spills == 0 and r.stack_frame == 0 and r.registers > 0
    if compiler.parse_ptxas(m.log):  # some NVRTC builds return an empty log; the report then comes from the cubin
        assert "cukv_test_smem" in m.log and r.source == "ptxas"
    else:
        assert r.source == "elf"


# ----------------------------------------------------------------------------------------------
# the report read back from the cubin (ELF .nv.info attributes, .nv.shared.<kernel> sizes)

# name -> (source, expected static smem, expected stack frame): frame and smem are fixed by the source
ELF_KERNELS = {
    "cukv_t_none": ('extern "C" __global__ void cukv_t_none(float* x) { x[threadIdx.x] = 1.f; }', 0, 0),
    "cukv_t_smem4": ('extern "C" __global__ void cukv_t_smem4(float* x) { __shared__ float b[1]; '
                     'if (threadIdx.x == 0) b[0] = x[0]; __syncthreads(); x[threadIdx.x] = b[0]; }', 4, 0),
    "cukv_t_align": ('extern "C" __global__ void cukv_t_align(float* x) { __shared__ __align__(1024) float b[40]; '
                     'b[threadIdx.x % 40] = x[threadIdx.x]; __syncthreads(); x[threadIdx.x] = b[39 - threadIdx.x % 40]; }',
                     160, 0),
    "cukv_t_dyn": ('extern "C" __global__ void cukv_t_dyn(float* x) { extern __shared__ float b[]; '
                   'b[threadIdx.x] = x[threadIdx.x]; __syncthreads(); x[threadIdx.x] = b[255 - threadIdx.x]; }', 0, 0),
    "cukv_t_big": ('extern "C" __global__ void cukv_t_big(float* x) { __shared__ float b[12000]; '
                   'for (int i = threadIdx.x; i < 12000; i += blockDim.x) b[i] = x[i]; __syncthreads(); '
                   'x[threadIdx.x] = b[11999 - threadIdx.x]; }', 48000, 0),
    # a local array indexed at run time lives in the stack frame (256 bytes)
    "cukv_t_local": ('extern "C" __global__ void cukv_t_local(float* x, int n) { float loc[64]; '
                     'for (int i = 0; i < 64; i++) loc[i] = x[i * n]; float s = 0; '
                     'for (int i = 0; i < n; i++) s += loc[(i * 7) % 64]; x[threadIdx.x] = s; }', 0, 256),
}
TWO_KERNELS = """extern "C" __global__ void cukv_t_two_a(float* x) { __shared__ float b[100];
  b[threadIdx.x % 100] = x[threadIdx.x]; __syncthreads(); x[threadIdx.x] = b[0]; }
extern "C" __global__ void cukv_t_two_b(float* x) { __shared__ double c[300];
  c[threadIdx.x % 300] = x[threadIdx.x]; __syncthreads(); x[threadIdx.x] = c[1]; }
__device__ __noinline__ float cukv_t_helper(float* x, int n) { float loc[64];
  for (int i = 0; i < 64; i++) loc[i] = x[i * n]; float s = 0; for (int i = 0; i < n; i++) s += loc[(i * 7) % 64];
  return s; }
extern "C" __global__ void cukv_t_two_c(float* x, int n) { x[threadIdx.x] = cukv_t_helper(x, n); }
"""


def _agree(log_rep, elf_rep):
    assert set(elf_rep) == set(log_rep), (sorted(log_rep), sorted(elf_rep))
    for k, a in log_rep.items():
        b = elf_rep[k]
        assert b.source == "elf" and a.source == "ptxas"
        assert (b.registers, b.stack_frame, b.static_smem) == (a.registers, a.stack_frame, a.static_smem), (a, b)


# sm_80 cubins size .nv.shared.<kernel> to the kernel's bytes; sm_90+ ones add the 1 KB reserved prefix
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("name", sorted(ELF_KERNELS))
def test_parse_cubin_matches_ptxas(cache, arch, name):
    src, smem, frame = ELF_KERNELS[name]
    m = compiler.compile_source(name, src + "\n", arch=arch)
    elf = compiler.parse_cubin(m.cubin_path.read_bytes())
    r = elf[name]
    assert set(elf) == {name}
    assert (r.static_smem, r.stack_frame, r.spills, r.source) == (smem, frame, 0, "elf")
    assert 0 < r.registers <= 255
    log = compiler.parse_ptxas(m.log)
    if log:
        _agree(log, elf)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_parse_cubin_several_kernels(cache, arch):
    m = compiler.compile_source("cukv_t_two", TWO_KERNELS, arch=arch)
    elf = compiler.parse_cubin(m.cubin_path.read_bytes())
    assert set(elf) == {"cukv_t_two_a", "cukv_t_two_b", "cukv_t_two_c"}  # entries only, not the device helper
    assert [elf[k].static_smem for k in sorted(elf)] == [400, 2400, 0]
    assert elf["cukv_t_two_c"].stack_frame == 256  # the non-inlined helper's frame, as ptxas reports it
    log = compiler.parse_ptxas(m.log)
    if log:
        _agree(log, elf)


SHIPPED_SAMPLE = [decode_config("bfloat16", d, g, 16) for d in (64, 96, 128, 256) for g in (1, 16)] + \
    [decode_config("float16", 128, 4, 16), AppendConfig("bfloat16", 128, 16)]


@pytest.mark.compile_ahead(build=lambda cfg: cfg, arch=ARCH)
@pytest.mark.parametrize("cfg", SHIPPED_SAMPLE, ids=lambda c: c.name)
def test_parse_cubin_matches_ptxas_on_shipped_kernels(fresh_kernel_cache, cfg):
    m = compiler.compile_source(cfg.name, cfg.render(), arch=ARCH)
    elf = compiler.parse_cubin(m.cubin_path.read_bytes())
    assert cfg.name in elf and elf[cfg.name].registers > 0
    if isinstance(cfg, DecodeConfig):
        assert elf[cfg.name].static_smem == cfg.smem_bytes
    log = compiler.parse_ptxas(m.log)
    if log:
        _agree(log, elf)


def _empty_log(monkeypatch, how="empty"):
    from cupy.cuda import nvrtc

    real = nvrtc.getProgramLog
    calls = []

    def fake(prog):
        calls.append(prog)
        if how == "raise":
            raise nvrtc.NVRTCError(1)
        return "" if how == "empty" else "\x00"

    monkeypatch.setattr(nvrtc, "getProgramLog", fake)
    return real, calls


@pytest.mark.parametrize("how", ["empty", "nul", "raise"])
def test_compile_with_an_empty_log_reports_from_the_cubin(cache, monkeypatch, how):
    """NVRTC 13.0 on the GPU machine returned an empty log for small sources: the report must not vanish."""
    src, smem, frame = ELF_KERNELS["cukv_t_big"]
    want = compiler.compile_source("cukv_t_big", src + "\n", arch=ARCH).functions["cukv_t_big"]
    monkeypatch.setenv("CUKV_CACHE_DIR", str(cache / "second"))
    _, calls = _empty_log(monkeypatch, how)
    m = compiler.compile_source("cukv_t_big", src + "\n", arch=ARCH)
    assert calls and not m.cache_hit
    r = m.functions["cukv_t_big"]
    assert r.source == "elf"
    assert (r.registers, r.stack_frame, r.static_smem) == (want.registers, want.stack_frame, want.static_smem) \
        == (want.registers, frame, smem)
    again = compiler.compile_source("cukv_t_big", src + "\n", arch=ARCH)  # the stored report survives a hit
    assert again.cache_hit and again.functions == m.functions


def test_cache_hit_repairs_an_empty_stored_report(cache):
    a = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    meta = a.cubin_path.with_suffix(".json")
    info = json.loads(meta.read_text())
    info["functions"], info["log"] = {}, ""  # what a compile with an empty log stored before the ELF fallback
    meta.write_text(json.dumps(info))
    b = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    assert b.cache_hit
    r = b.functions["cukv_test_tiny"]
    assert r.source == "elf" and r.registers == a.functions["cukv_test_tiny"].registers


def test_old_cache_entries_without_a_source_field_load(cache):
    a = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    meta = a.cubin_path.with_suffix(".json")
    info = json.loads(meta.read_text())
    for v in info["functions"].values():
        v.pop("source", None)
    meta.write_text(json.dumps(info))
    b = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    assert b.cache_hit and b.functions["cukv_test_tiny"].source == "ptxas"


def test_parse_cubin_rejects_garbage_and_report_falls_back_to_the_log(cache):
    for bad in (b"", b"hello", b"\x7fELF" + b"\0" * 10, b"\x7fELF\x02\x01" + b"\xff" * 100):
        with pytest.raises(ValueError):
            compiler.parse_cubin(bad)
    rep = compiler.resource_report(SAMPLE_PTXAS, b"not a cubin")
    assert set(rep) == {"kern_a", "kern_b", "kern_c"} and all(r.source == "ptxas" for r in rep.values())
    data = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH).cubin_path.read_bytes()
    with pytest.raises(ValueError):
        compiler.parse_cubin(data[: len(data) // 2])  # section headers sit at the end
    assert compiler.resource_report("", data)["cukv_test_tiny"].source == "elf"


def test_resource_report_prefers_the_log(cache):
    data = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH).cubin_path.read_bytes()
    fake_log = SAMPLE_PTXAS.replace("kern_c", "cukv_test_tiny")
    rep = compiler.resource_report(fake_log, data)
    assert rep["cukv_test_tiny"].registers == 32 and rep["cukv_test_tiny"].source == "ptxas"
    assert rep["kern_a"].registers == 202


def test_nv_info_records_walk_the_4_byte_grid():
    blob = bytes([0x01, 0x35, 0, 0,               # NVAL
                  0x02, 0x4C, 1, 0,               # BVAL
                  0x03, 0x1B, 0xFF, 0,            # HVAL
                  0x04, 0x2F, 8, 0, 7, 0, 0, 0, 40, 0, 0, 0,   # SVAL REGCOUNT(sym 7, 40)
                  0x04, 0x11, 8, 0, 7, 0, 0, 0, 0, 1, 0, 0])   # SVAL FRAME_SIZE(sym 7, 256)
    recs = list(compiler._nv_info_attrs(blob))
    assert [(a, f) for a, f, _ in recs] == [(0x35, 1), (0x4C, 2), (0x1B, 3), (0x2F, 4), (0x11, 4)]
    assert recs[3][2] == bytes([7, 0, 0, 0, 40, 0, 0, 0])


# ----------------------------------------------------------------------------------------------
# atomic writes


def test_compile_leaves_no_tmp_files(cache):
    compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    compiler.compile_source("cukv_test_tiny2", tiny("cukv_test_tiny2"), arch=ARCH)
    names = sorted(p.name for p in cache.iterdir())
    assert not [n for n in names if n.endswith(".tmp")], names
    # an entry is its cubin and metadata, plus the empty lock file its compile held (kept: removing it would race)
    assert len(names) == 6 and {n.rsplit(".", 1)[1] for n in names} == {"cubin", "json", "lock"}


def test_atomic_write_replaces_and_cleans_up(tmp_path, monkeypatch):
    target = tmp_path / "sub" / "f.bin"
    compiler._atomic_write(target, b"one")
    compiler._atomic_write(target, b"two")
    assert target.read_bytes() == b"two"
    assert os.listdir(target.parent) == ["f.bin"]

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(compiler.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        compiler._atomic_write(target, b"three")
    assert target.read_bytes() == b"two"  # the old file is intact
    assert os.listdir(target.parent) == ["f.bin"]  # and the temporary is gone


def test_trace_build_is_opt_in(cache, monkeypatch):
    """benchmarks/trace_prefill.py compiles with the define CUKV_TRACE=1: that build exports the timestamp buffer,
    while the shipped headers keep the switch off (trace_mark compiles to nothing)."""
    import sys
    from pathlib import Path

    shipped = (compiler.template_dir() / "debug.cuh").read_text()
    assert re.search(r"^#define CUKV_TRACE 0$", shipped, re.M)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        import trace_prefill
    finally:
        sys.path.pop(0)
    m = re.search(r"kTraceBlocks = (\d+), kTraceWarps = (\d+), kTraceIters = (\d+), kTraceEvents = (\d+);", shipped)
    assert m and tuple(map(int, m.groups())) == trace_prefill.TRACE_SHAPE  # the host views the buffer with it
    monkeypatch.setenv("CUKV_DEFINES", "")  # recorded, so the define traced_build() adds is undone after the test
    trace_prefill.traced_build()
    assert os.environ["CUKV_DEFINES"] == "CUKV_TRACE=1"
    _assert_timing_build(b"cukv_trace")


def _assert_timing_build(symbol: bytes):
    """The d64 bf16 prefill compiled with the timing define in CUKV_DEFINES exports ``symbol``, and does not spill
    (the launch-per-item grid: on the persistent one the wait-stats build spills 24 bytes at d64, a timing aid's
    cost); the shipped build does not export it."""
    import dataclasses

    from cukv.policy.prefill import default_config

    cfg = dataclasses.replace(default_config("bfloat16", 64, 16), persistent=False)
    mod = compiler.compile_source(cfg.name, cfg.render())
    assert symbol + b"\x00" in mod.cubin_path.read_bytes()
    assert mod.functions[cfg.name].spills == 0
    defines = os.environ.pop("CUKV_DEFINES")
    try:
        assert symbol + b"\x00" not in compiler.compile_source(cfg.name, cfg.render()).cubin_path.read_bytes()
    finally:
        os.environ["CUKV_DEFINES"] = defines


def test_timing_macros_are_off_and_the_wait_stats_build_compiles(cache, monkeypatch):
    """The prefill header's timing aids ship off, and the CUKV_WAIT_STATS=1 build benchmarks/probe_waits.py runs
    (through benchmarks/ab_macros.sh, which passes it in CUKV_DEFINES) exports its counters without spilling."""
    shipped = (compiler.template_dir() / "debug.cuh").read_text()
    for macro in ("CUKV_WAIT_STATS", "CUKV_ONCE_STATS", "CUKV_ONCE_UB", "CUKV_TRACE"):
        assert re.search(rf"^#ifndef {macro}\n#define {macro} 0$", shipped, re.M), macro
    monkeypatch.setenv("CUKV_DEFINES", "CUKV_WAIT_STATS=1")
    _assert_timing_build(b"cukv_wait_stats")

