import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=40, deadline=None)
settings.register_profile("gpu", max_examples=8, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

#: processes that compile kernels ahead of the tests that check them (CI has two cores)
COMPILE_JOBS = max(1, min(2, os.cpu_count() or 1))


def _has_gpu():
    from cukv.device import has_gpu

    return has_gpu()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "compile_ahead(build=fn, **compile_kwargs): fn(**the test's parameters) returns the config(s) the "
                   "test compiles, each alone or as (config, compile_source keyword arguments); they are compiled "
                   "into the fresh kernel cache before the module's first test, COMPILE_JOBS at a time")


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU visible to this process (GPU tests run with `make gpu-check` on an H100)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    import numpy as np

    # fresh inputs per test, reproducible per test name
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# ----------------------------------------------------------------------------------------------
# kernels: one fresh cache per session, compiled ahead in parallel


@pytest.fixture(scope="session")
def kernel_cache_dir(tmp_path_factory):
    """A cubin cache folder that is empty when the session starts."""
    return tmp_path_factory.mktemp("cukv_cache")


@pytest.fixture(scope="module")
def fresh_kernel_cache(kernel_cache_dir):
    """``CUKV_CACHE_DIR`` for a module that checks resource reports: the session's cache, empty at its start, so
    every report the module reads was compiled by this run's NVRTC. The modules share it: a kernel that several of
    them check (a shipped specialization is also checked by its family's module) compiles once per session."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUKV_CACHE_DIR", str(kernel_cache_dir))
        mp.delenv("CUKV_NO_COMPILE", raising=False)
        yield kernel_cache_dir


def _ahead_jobs(items, module):
    """(config, compile_source keyword arguments) for each selected test of ``module`` marked compile_ahead."""
    jobs = []
    for item in items:
        mark = item.get_closest_marker("compile_ahead")
        if mark is None or getattr(item, "module", None) is not module:
            continue
        # by keyword: a lone callable argument would make the mark decorate it instead
        assert not mark.args and "build" in mark.kwargs, f"{item.nodeid}: use compile_ahead(build=fn, ...)"
        common = {k: v for k, v in mark.kwargs.items() if k != "build"}
        params = getattr(item, "callspec", None)
        try:
            built = mark.kwargs["build"](**(params.params if params else {}))
        except Exception:  # noqa: BLE001 - an invalid point: the test itself says what is wrong
            continue
        for b in built if isinstance(built, list) else [built]:
            cfg, kw = b if isinstance(b, tuple) else (b, {})
            jobs.append((cfg, {**common, **kw}))
    return jobs


def _compile_job(cfg, kw):
    from cukv import compiler

    try:
        compiler.compile_source(cfg.name, cfg.render(), **kw)
    except Exception:  # noqa: BLE001 - left to the test, which compiles it again and reports the error
        pass


@pytest.fixture(scope="module", autouse=True)
def _compile_ahead(request):
    """Compile the kernels of this module's selected compile_ahead tests into the fresh kernel cache, COMPILE_JOBS
    processes at a time; the tests then read them from the cache. A failure here is left to the test that compiles
    that kernel again (and reports it)."""
    jobs = _ahead_jobs(request.session.items, request.module)
    if not jobs:
        return
    request.getfixturevalue("fresh_kernel_cache")
    seen, unique = set(), []
    for cfg, kw in jobs:
        key = (cfg.name, repr(sorted(kw.items())))
        if key not in seen:
            seen.add(key)
            unique.append((cfg, kw))
    from concurrent.futures import ProcessPoolExecutor

    try:
        with ProcessPoolExecutor(COMPILE_JOBS) as ex:
            list(ex.map(_compile_job, *zip(*unique)))
    except Exception:  # noqa: BLE001 - a worker that died: the tests compile what is missing themselves
        pass
