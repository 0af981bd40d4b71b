"""The compile cache without a GPU: defines in the key, CUKV_DEFINES, integrity of cached cubins, the per-key lock
across processes, and kernels loaded once per device."""
import hashlib
import json
import multiprocessing
import uuid

import pytest

from cukv import CompileError, compiler
from cukv.errors import CukvError

ARCH = "sm_90a"

NEEDS_X = """#ifndef CUKV_X
#error CUKV_X must be defined
#endif
extern "C" __global__ void {name}(float* x) {{ x[threadIdx.x] = CUKV_X; }}
"""


def needs_x(name="cukv_test_needs_x"):
    return NEEDS_X.format(name=name)


def tiny(name="cukv_test_tiny", value="1.0"):
    return f'extern "C" __global__ void {name}(float* x) {{ x[threadIdx.x] = {value}f; }}\n'


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "kcache"
    monkeypatch.setenv("CUKV_CACHE_DIR", str(d))
    for var in ("CUKV_NO_COMPILE", "CUKV_DUMP_SOURCE", "CUKV_DEFINES"):
        monkeypatch.delenv(var, raising=False)
    return d


@pytest.fixture(autouse=True)
def _no_env_defines(monkeypatch):
    monkeypatch.delenv("CUKV_DEFINES", raising=False)


# ----------------------------------------------------------------------------------------------
# defines


def test_defines_change_the_key():
    k = compiler.cache_key(tiny(), ARCH)
    k1 = compiler.cache_key(tiny(), ARCH, {"CUKV_X": 1})
    assert k1 != k
    assert compiler.cache_key(tiny(), ARCH, {"CUKV_X": 2}) not in (k, k1)
    assert compiler.cache_key(tiny(), ARCH, {"CUKV_X": None}) not in (k, k1)
    # spelling does not matter: the same defines give the same key
    assert compiler.cache_key(tiny(), ARCH, ["CUKV_X=1"]) == k1
    assert compiler.cache_key(tiny(), ARCH, [("CUKV_X", "1")]) == k1
    assert compiler.cache_key(tiny(), ARCH, "CUKV_X=1") == k1
    two = compiler.cache_key(tiny(), ARCH, {"CUKV_A": 1, "CUKV_B": 2})
    assert compiler.cache_key(tiny(), ARCH, {"CUKV_B": 2, "CUKV_A": 1}) == two
    assert compiler.cache_key(tiny(), ARCH, {}) == compiler.cache_key(tiny(), ARCH, None) == k


def test_key_fields_name_the_defines():
    opts = compiler.compile_options(ARCH) + ["-DCUKV_X=1", "-DCUKV_Y"]
    f = compiler.cache_key_fields(tiny(), ARCH, opts)
    assert f["defines"] == ["CUKV_X=1", "CUKV_Y"]
    assert f["schema"] == compiler.CACHE_SCHEMA >= 2


def test_env_defines_are_keyed_and_explicit_ones_win(monkeypatch):
    k = compiler.cache_key(tiny(), ARCH)
    monkeypatch.setenv("CUKV_DEFINES", "CUKV_X=1")
    assert compiler.cache_key(tiny(), ARCH) != k
    assert compiler.cache_key(tiny(), ARCH) == compiler.cache_key(tiny(), ARCH, {"CUKV_X": 1})
    assert compiler.resolve_defines({"CUKV_X": 5, "CUKV_A": None}) == ("CUKV_A", "CUKV_X=5")
    monkeypatch.setenv("CUKV_DEFINES", "  CUKV_WAIT_STATS=1   CUKV_Y\tCUKV_Z=-3 ")
    assert compiler.resolve_defines() == ("CUKV_WAIT_STATS=1", "CUKV_Y", "CUKV_Z=-3")
    monkeypatch.setenv("CUKV_DEFINES", "")
    assert compiler.resolve_defines() == ()
    assert compiler.cache_key(tiny(), ARCH) == k


def test_parse_defines_forms():
    p = compiler.parse_defines
    assert p(None) == {} and p("") == {} and p([]) == {}
    want = {"A": "1", "B": None, "C": "1", "D": "0", "E": "x"}
    assert p({"A": 1, "B": None, "C": True, "D": False, "E": "x"}) == want
    assert p(["A", "B=2", ("C", 3)]) == {"A": None, "B": "2", "C": "3"}
    assert p("A B=2 C=") == {"A": None, "B": "2", "C": ""}
    assert p({"_A9": 1.5}) == {"_A9": "1.5"}


@pytest.mark.parametrize("bad", ["1X", "A-B", "A.B", "=1", "A B=1 9Z=2"])
def test_bad_env_define_names_the_variable_and_token(monkeypatch, bad):
    monkeypatch.setenv("CUKV_DEFINES", bad)
    with pytest.raises(ValueError, match="CUKV_DEFINES") as e:
        compiler.resolve_defines()
    token = [t for t in bad.split() if not t.split("=")[0].isidentifier()][0].split("=")[0]
    assert repr(token) in str(e.value)
    with pytest.raises(ValueError, match="CUKV_DEFINES"):
        compiler.cache_key(tiny(), ARCH)


@pytest.mark.parametrize("bad,exc,text", [
    ({"A B": 1}, ValueError, "'A B'"),
    ({"A": "x y"}, ValueError, "whitespace"),
    ({"A": [1]}, ValueError, "value of A"),
    ({"A": float("nan")}, ValueError, "value of A"),
    ({1: 2}, ValueError, "1"),
    (5, TypeError, "defines=5"),
    ([3], TypeError, "entry 3"),
    ([("A", 1, 2)], TypeError, "entry"),
])
def test_bad_defines_argument(bad, exc, text):
    with pytest.raises(exc, match="defines") as e:
        compiler.parse_defines(bad)
    assert text in str(e.value)


def test_define_reaches_the_kernel(cache):
    with pytest.raises(CompileError, match="CUKV_X must be defined"):
        compiler.compile_source("cukv_test_needs_x", needs_x(), arch=ARCH)
    m = compiler.compile_source("cukv_test_needs_x", needs_x(), arch=ARCH, defines={"CUKV_X": 3})
    assert not m.cache_hit and "cukv_test_needs_x" in m.functions
    assert m.defines == ("CUKV_X=3",) and m.arch == ARCH
    meta = json.loads(m.cubin_path.with_suffix(".json").read_text())
    assert meta["defines"] == ["CUKV_X=3"]
    assert compiler.compile_source("cukv_test_needs_x", needs_x(), arch=ARCH, defines={"CUKV_X": 3}).cache_hit
    other = compiler.compile_source("cukv_test_needs_x", needs_x(), arch=ARCH, defines={"CUKV_X": 4})
    assert not other.cache_hit and other.key != m.key and other.cubin_path != m.cubin_path


def test_env_define_reaches_the_kernel(cache, monkeypatch):
    monkeypatch.setenv("CUKV_DEFINES", "CUKV_X=3")
    m = compiler.compile_source("cukv_test_needs_x", needs_x(), arch=ARCH)
    assert m.defines == ("CUKV_X=3",)
    monkeypatch.delenv("CUKV_DEFINES")
    # the same defines passed explicitly find the entry CUKV_DEFINES made
    assert compiler.compile_source("cukv_test_needs_x", needs_x(), arch=ARCH, defines=["CUKV_X=3"]).cache_hit


# ----------------------------------------------------------------------------------------------
# integrity of cached entries


def _meta(m):
    return json.loads(m.cubin_path.with_suffix(".json").read_text())


def test_metadata_records_the_cubin_hash(cache):
    m = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    data = m.cubin_path.read_bytes()
    info = _meta(m)
    assert info["cubin_sha256"] == hashlib.sha256(data).hexdigest() and info["cubin_bytes"] == len(data)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "missing", "swap"])
def test_corrupt_cubin_is_rebuilt(cache, damage):
    a = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    good = a.cubin_path.read_bytes()
    if damage == "flip":
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0x40
        a.cubin_path.write_bytes(bytes(bad))
    elif damage == "truncate":
        a.cubin_path.write_bytes(good[: len(good) // 3])
    elif damage == "empty":
        a.cubin_path.write_bytes(b"")
    elif damage == "missing":
        a.cubin_path.unlink()
    else:  # another entry's (well-formed) cubin under this name
        other = compiler.compile_source("cukv_test_tiny", tiny(value="7.0"), arch=ARCH)
        a.cubin_path.write_bytes(other.cubin_path.read_bytes())
    b = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    assert not b.cache_hit and b.key == a.key
    assert hashlib.sha256(b.cubin_path.read_bytes()).hexdigest() == _meta(b)["cubin_sha256"]
    assert compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH).cache_hit


@pytest.mark.parametrize("damage", ["truncate", "empty", "not_a_dict", "no_hash", "wrong_types", "missing"])
def test_damaged_metadata_is_rebuilt(cache, damage):
    a = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    meta = a.cubin_path.with_suffix(".json")
    text = meta.read_text()
    info = json.loads(text)
    if damage == "truncate":
        meta.write_text(text[: len(text) // 2])
    elif damage == "empty":
        meta.write_text("")
    elif damage == "not_a_dict":
        meta.write_text("[1, 2]")
    elif damage == "no_hash":
        del info["cubin_sha256"]
        meta.write_text(json.dumps(info))
    elif damage == "wrong_types":
        info["functions"] = {"cukv_test_tiny": {"bogus": 1}}
        meta.write_text(json.dumps(info))
    else:
        meta.unlink()
    b = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    assert not b.cache_hit and b.key == a.key
    assert compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH).cache_hit


def test_no_compile_treats_a_corrupt_entry_as_missing(cache, monkeypatch):
    from cukv import CompileForbidden

    a = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    a.cubin_path.write_bytes(a.cubin_path.read_bytes()[:100])
    monkeypatch.setenv("CUKV_NO_COMPILE", "1")
    with pytest.raises(CompileForbidden):
        compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)


# ----------------------------------------------------------------------------------------------
# one compile for many processes


def _compile_in_child(args):
    cache_dir, source, barrier = args
    import os

    os.environ["CUKV_CACHE_DIR"] = cache_dir
    barrier.wait()  # all ask at once
    m = compiler.compile_source("cukv_test_race", source, arch=ARCH)
    return m.cache_hit, m.key, hashlib.sha256(m.cubin_path.read_bytes()).hexdigest(), sorted(m.functions), os.getpid()


def test_processes_asking_for_one_key_compile_it_once(cache):
    ctx = multiprocessing.get_context("fork")
    n = 4
    # a key no earlier run has compiled
    source = tiny("cukv_test_race", value=f"{int(uuid.uuid4().int % 10**6)}.0")
    with ctx.Manager() as manager, ctx.Pool(n) as pool:
        barrier = manager.Barrier(n)
        results = pool.map(_compile_in_child, [(str(cache), source, barrier)] * n)
    compiled = [r for r in results if not r[0]]
    assert len(compiled) == 1, results  # exactly one NVRTC compile; the others waited and read its entry
    assert len({r[1] for r in results}) == 1 and len({r[2] for r in results}) == 1
    assert all(r[3] == ["cukv_test_race"] for r in results)
    assert len({r[4] for r in results}) == n  # four distinct processes
    info = json.loads(next(cache.glob("cukv_test_race-*.json")).read_text())
    assert info["pid"] == compiled[0][4] and info["cubin_sha256"] == results[0][2]
    assert len(list(cache.glob("*.cubin"))) == 1 and not list(cache.glob("*.tmp"))


def test_the_lock_waits_for_the_holder(cache, monkeypatch):
    """A caller that finds the key missing takes the lock and then re-reads: an entry written while it waited is
    a hit, not a second compile."""
    import threading

    source = tiny(value="11.0")
    key = compiler.cache_key(source, ARCH)
    lock = cache / f"cukv_test_tiny-{key[:20]}.lock"
    calls = []
    real = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda *a: calls.append(1) or real(*a))
    results = []
    with compiler._key_lock(lock):
        t = threading.Thread(
            target=lambda: results.append(compiler.compile_source("cukv_test_tiny", source, arch=ARCH)))
        t.start()
        t.join(0.5)
        assert t.is_alive()  # blocked on the lock
        real("cukv_test_tiny", source, ARCH, compiler.compile_options(ARCH), (), key,
             lock.with_suffix(".cubin"), lock.with_suffix(".json"))
    t.join(30)
    assert results and results[0].cache_hit and not calls


# ----------------------------------------------------------------------------------------------
# kernels per device (fakes: this machine has no GPU)


class _FakeFn:
    def __init__(self, dev, entry):
        self.dev, self.entry, self.calls = dev, entry, []
        self.max_dynamic_shared_size_bytes = 48 * 1024
        self.num_regs = 40 + dev

    def __call__(self, grid, block, args, **kw):
        self.calls.append((grid, kw))


class _FakeModule:
    def __init__(self, dev):
        self.dev, self.fns = dev, {}

    def get_function(self, entry):
        return self.fns.setdefault(entry, _FakeFn(self.dev, entry))


@pytest.fixture
def fake_devices(cache, monkeypatch):
    import contextlib

    import cupy

    state = {"dev": 0, "loaded": []}
    monkeypatch.setattr(compiler, "_current_device", lambda: state["dev"])
    monkeypatch.setattr(cupy.cuda, "Device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(compiler, "_modules", {})
    monkeypatch.setattr(compiler, "_functions", {})
    mods = {}

    def module(self, device=None):
        dev = state["dev"] if device is None else device
        if dev not in mods:
            state["loaded"].append(dev)
            mods[dev] = _FakeModule(dev)
        return mods[dev]

    monkeypatch.setattr(compiler.CompiledModule, "module", module)
    state["mods"] = mods
    return state


def test_function_is_loaded_once_per_device(fake_devices):
    m = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    fn = m.function("cukv_test_tiny", 100_000)
    assert m.function("cukv_test_tiny", 100_000) is fn
    for dev in (0, 1, 0, 1, 2):
        fake_devices["dev"] = dev
        fn((1,), (32,), (), shared_mem=100_000)
    assert fake_devices["loaded"] == [0, 1, 2]
    for dev, calls in ((0, 2), (1, 2), (2, 1)):
        f = fake_devices["mods"][dev].fns["cukv_test_tiny"]
        assert len(f.calls) == calls and f.max_dynamic_shared_size_bytes == 100_000  # the opt-in on each device
    fake_devices["dev"] = 1
    assert fn.num_regs == 41  # attributes come from the current device's copy
    assert fn.on_device(2).dev == 2


def test_a_larger_dynamic_smem_reaches_every_device(fake_devices):
    m = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    fn = m.function("cukv_test_tiny", 60_000)
    for dev in (0, 1):
        fake_devices["dev"] = dev
        fn((1,), (32,), ())
    assert m.function("cukv_test_tiny", 200_000) is fn and fn.dynamic_smem == 200_000
    assert m.function("cukv_test_tiny", 1_000).dynamic_smem == 200_000  # never lowered
    for dev in (0, 1):
        fake_devices["dev"] = dev
        fn((1,), (32,), ())
        assert fake_devices["mods"][dev].fns["cukv_test_tiny"].max_dynamic_shared_size_bytes == 200_000


def test_a_device_of_another_arch_is_refused(cache, monkeypatch):
    from cukv import device

    m = compiler.compile_source("cukv_test_tiny", tiny(), arch=ARCH)
    monkeypatch.setattr(device, "gpu_capability", lambda dev=None: (8, 0))
    with pytest.raises(CukvError, match=r"sm_90a.*device 1 \(sm_80\).*CUKV_ARCH=sm_80"):
        m.module(1)
    monkeypatch.setattr(device, "gpu_capability", lambda dev=None: (9, 0))
    m._check_device(1)  # fine
    assert compiler._arch_capability("sm_90a") == ((9, 0), True)
    assert compiler._arch_capability("sm_86") == ((8, 6), False)
    assert compiler._arch_capability("compute_90") is None


def test_plan_and_run_on_different_devices_is_refused(monkeypatch):
    from cukv import device
    from cukv.errors import DeviceMismatchError

    monkeypatch.setattr(device, "current_device", lambda: 1)
    device.check_same_device("BatchDecode", 1)
    device.check_same_device("BatchDecode", None)
    with pytest.raises(DeviceMismatchError, match=r"BatchDecode was planned on device 0 and is run on device 1"):
        device.check_same_device("BatchDecode", 0)
    assert issubclass(DeviceMismatchError, (CukvError, ValueError))


def test_device_queries_without_a_gpu():
    from cukv import device

    if device.device_count():
        pytest.skip("this machine has a GPU")
    assert device.gpus() == [] and device.gpu_capability() is None and device.gpu_capability(3) is None
    assert device.sm_count() == 132 and not device.has_gpu()
