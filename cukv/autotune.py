"""The prefill autotuner: times candidate tiles on the GPU and stores the fastest (:mod:`cukv.tuned` holds the store).

:func:`tune_prefill` times the valid candidates around the documented default (``cukv.policy.prefill.DEFAULTS``,
one ``(BM, BN, BK, stages)`` per head dim) on the current GPU (a causal prefill of a fixed shape), checks each
candidate's output against the default's, and stores the fastest with :func:`cukv.tuned.save_record`; from then on
every ``BatchPrefill`` built without ``config=`` on a device of the same name runs it (:func:`cukv.tuned.lookup`).
Nothing here imports CuPy at import time.
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import os

from . import compiler, tuned
from .tuned import (ENV, FIELDS, FILE_NAME, SCHEMA, AutotuneWarning, autotune_path, device_name,  # noqa: F401
                    enabled, load_records, lookup, record_key, save_record)

#: the candidate grid of a full tuning run (BK: every value the config rules allow for the head dim)
BM_CHOICES = (64, 128, 192)
BN_CHOICES = tuple(range(16, 129, 16))
STAGE_CHOICES = tuple(range(2, 7))
BK_CHOICES = (64, 128, 192, 256)


# ----------------------------------------------------------------------------------------------
# candidates


def default_prefill_config(dtype: str, head_dim: int, page_size: int):
    """The documented default (``cukv.policy.prefill.DEFAULTS``), ignoring any tuned record."""
    from .policy.prefill import default_config

    return default_config(dtype, head_dim, page_size)


def candidate_configs(dtype: str, head_dim: int, page_size: int, *, quick: bool = False) -> list:
    """Valid configs around the default, the default first. Full grid: BM in 64/128/192, BN in 16..128 step
    16, stages 2..6, every BK the rules allow; ``quick``: the default's BK, BM in 64/128, BN in 64/96/128,
    stages 2..4 (plus the default's own values). Invalid combinations (``ValueError``) are left out."""
    from .policy.prefill import tile_config

    base = default_prefill_config(dtype, head_dim, page_size)
    if quick:
        grid = (sorted({64, 128, base.BM}), sorted({64, 96, 128, base.BN}), (base.BK,),
                sorted({2, 3, 4, base.stages}))
    else:
        grid = (BM_CHOICES, BN_CHOICES, BK_CHOICES, STAGE_CHOICES)
    out, seen = [base], {base}
    for bm, bn, bk, st in itertools.product(*grid):
        try:
            cfg = tile_config(dtype, head_dim, page_size, bm, bn, bk, st)
        except ValueError:
            continue
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)
    return out


def defaults_table() -> str:
    """Markdown table of ``cukv.policy.prefill.DEFAULTS`` with the derived threads and shared memory (README)."""
    from .policy.prefill import DEFAULTS

    lines = ["| head dim | BM | BN | BK | stages | threads | smem (bytes) |", "|---|---|---|---|---|---|---|"]
    for d in sorted(DEFAULTS):
        c = default_prefill_config("bfloat16", d, 16)
        lines.append(f"| {d} | {c.BM} | {c.BN} | {c.BK} | {c.stages} | {c.num_threads} | {c.smem_bytes} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# tuning


@dataclasses.dataclass
class TuneResult:
    """One candidate: ``status`` is ``ok``, ``spills``, ``compile error``, ``mismatch`` (output differs from
    the default config's), ``error`` (failed to run) or ``invalid`` (a user-given shape the rules reject)."""

    config: object
    status: str
    ms: float | None = None
    tflops: float | None = None
    max_diff: float | None = None
    registers: int | None = None
    detail: str = ""
    is_default: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _compile_one(cfg, arch):
    """(name, FunctionReport or None, error or None); runs in a worker process (NVRTC only, no GPU)."""
    from .errors import CompileError

    try:
        mod = compiler.compile_source(cfg.name, cfg.render(), arch=arch)
    except CompileError as e:  # the first error line of the log says why (a static_assert, usually)
        errs = [ln.strip() for ln in e.log.splitlines() if "error" in ln]
        return cfg.name, None, (errs[0] if errs else str(e).splitlines()[0])[:300]
    except Exception as e:  # noqa: BLE001 - reported per candidate
        return cfg.name, None, f"{type(e).__name__}: {str(e).strip()[:200]}"
    return cfg.name, mod.functions.get(cfg.name), None


def _compile_reports(configs, jobs: int | None = None) -> dict:
    """Compile every config into the disk cache (in parallel; NVRTC needs no GPU) -> {name: (report, error)}."""
    arch = compiler.target_arch()
    jobs = max(1, min(jobs or os.cpu_count() or 1, 16, len(configs)))
    if jobs == 1:
        results = [_compile_one(c, arch) for c in configs]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn: the parent may hold a CUDA context, which a forked child must not inherit
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
            results = list(ex.map(_compile_one, configs, itertools.repeat(arch)))
    return {name: (rep, err) for name, rep, err in results}


class _Problem:
    """A causal prefill on the GPU: ``batch`` sequences of ``seq_len`` new tokens each (no cached prefix),
    K/V in a paged cache in random page order (``page_size > 0``) or contiguous (``page_size == 0``)."""

    def __init__(self, dtype, head_dim, page_size, num_qo_heads, num_kv_heads, seq_len, batch, seed=0):
        import cupy as cp
        import numpy as np

        from .bench.timing import Timer
        from .kvcache import PagedKVCache, PageTable
        from .ops.append import append_kv
        from .ops.prefill import causal_flops

        self.dtype, self.head_dim, self.page_size = dtype, head_dim, page_size
        self.hq, self.hkv = num_qo_heads, num_kv_heads
        rs = cp.random.RandomState(seed)
        total = batch * seq_len

        def rnd(shape):
            x = rs.standard_normal(shape, dtype=cp.float32)
            return (x.view(cp.uint32) >> 16).astype(cp.uint16) if dtype == "bfloat16" else x.astype(cp.float16)

        self.q = rnd((total, num_qo_heads, head_dim))
        k, v = rnd((total, num_kv_heads, head_dim)), rnd((total, num_kv_heads, head_dim))
        self.q_offsets = (np.arange(batch + 1) * seq_len).astype(np.int32)
        self.kv_lens = np.full(batch, seq_len, np.int32)
        if page_size:
            pages_per = -(-seq_len // page_size)
            cache = PagedKVCache(batch * pages_per, page_size, num_kv_heads, head_dim, dtype=dtype)
            table = np.random.default_rng(seed).permutation(batch * pages_per).astype(np.int32)
            table = table.reshape(batch, pages_per)
            pos = np.arange(seq_len)
            slots = (table[:, pos // page_size].astype(np.int64) * page_size + pos % page_size).reshape(-1)
            append_kv(cache, k, v, cp.asarray(slots))
            self.kv = (cache, PageTable(cp.asarray(table), cp.asarray(self.kv_lens), page_size))
        else:
            self.kv = (k, v, cp.asarray(self.q_offsets))
        self.flops = causal_flops(batch, seq_len, num_qo_heads, head_dim)
        self.timer = Timer()

    def run(self, cfg):
        """(runner, output) of one config; ``runner()`` repeats the call into the same output."""
        import cupy as cp

        from .ops.prefill import BatchPrefill

        pf = BatchPrefill(self.hq, self.hkv, self.head_dim, self.page_size or None, self.dtype, config=cfg)
        pf.plan(self.q_offsets, self.kv_lens, mask="causal")
        out = cp.empty_like(self.q)
        pf.run(self.q, self.kv, out=out)
        cp.cuda.get_current_stream().synchronize()
        return (lambda: pf.run(self.q, self.kv, out=out)), out

    def max_diff(self, out, ref) -> float:
        """Largest ``|out - ref| / (atol + rtol |ref|)`` (1.0 = at the tolerance); inf on NaN."""
        import cupy as cp

        from .testing import TOLERANCE

        def f(x):
            return (x.astype(cp.uint32) << 16).view(cp.float32) if self.dtype == "bfloat16" else x.astype(cp.float32)

        a, r = f(out), f(ref)
        atol, rtol = TOLERANCE[self.dtype]
        ratio = cp.abs(a - r) / (2 * atol + 2 * rtol * cp.abs(r))  # two kernels' rounding, each within tolerance
        return float(cp.where(cp.isnan(ratio), cp.inf, ratio).max())

    def time_ms(self, runner, reps: int) -> float:
        return self.timer.median_ms(runner, reps=reps, warmup=3)


def _make_problem(*args, **kwargs):
    return _Problem(*args, **kwargs)


def _as_config(c, dtype, head_dim, page_size):
    from .configs.prefill import PrefillConfig
    from .policy.prefill import tile_config

    if isinstance(c, PrefillConfig):
        if (c.dtype, c.head_dim, c.page_size) != (dtype, head_dim, page_size):
            raise ValueError(f"candidate {c.name} is not for dtype={dtype}, head_dim={head_dim}, page_size={page_size}")
        return c
    bm, bn, bk, st = c
    return tile_config(dtype, head_dim, page_size, bm, bn, bk, st)


def tune_prefill(dtype="bfloat16", head_dim=128, page_size=16, *, num_qo_heads=32, num_kv_heads=8, seq_len=4096,
                 batch=2, candidates=None, reps=10, quick=False, jobs=None, persist=True, on_result=None):
    """Time prefill tile shapes on the current GPU and return (and, with ``persist``, store) the fastest.

    The problem is a causal prefill of ``batch`` sequences of ``seq_len`` tokens with ``num_qo_heads`` /
    ``num_kv_heads`` heads over a paged cache of ``page_size`` (0: contiguous K/V). ``candidates``:
    ``PrefillConfig`` objects or ``(BM, BN, BK, stages)`` tuples; by default :func:`candidate_configs`
    (``quick`` narrows it). Every candidate is compiled first (in ``jobs`` processes); one whose report
    shows spills or a stack frame is skipped. Each survivor runs once and its output is checked against the
    default config's (the sanity check: a wrong kernel cannot win), then it is timed (CUDA events, L2
    flushed, median of ``reps``). ``on_result(TuneResult)`` is called for every candidate as it finishes.

    Raises :class:`cukv.NoGPUError` without a GPU and RuntimeError when no candidate ran correctly.
    """
    from ._version import __version__
    from .arrays import canonical_dtype
    from .errors import NoGPUError

    dtype = canonical_dtype(dtype)
    head_dim, page_size = int(head_dim), int(page_size)
    base = default_prefill_config(dtype, head_dim, page_size)
    report = on_result or (lambda r: None)
    cfgs, results = [], []
    for c in (candidate_configs(dtype, head_dim, page_size, quick=quick) if candidates is None else candidates):
        try:
            cfg = _as_config(c, dtype, head_dim, page_size)
        except (ValueError, TypeError) as e:
            r = TuneResult(c, "invalid", detail=str(e))
            results.append(r)
            report(r)
            continue
        if cfg not in cfgs:
            cfgs.append(cfg)
    if not cfgs:
        raise ValueError("no valid candidate to time")
    device = tuned.device_name()
    if device is None:
        raise NoGPUError("autotuning needs a CUDA GPU and this process sees none (see `python -m cukv doctor`)")

    reports = _compile_reports([base] + [c for c in cfgs if c != base], jobs)
    runnable = []
    for cfg in cfgs:
        rep, err = reports[cfg.name]
        regs = rep.registers if rep is not None else None
        if err is not None:
            r = TuneResult(cfg, "compile error", registers=regs, detail=err, is_default=cfg == base)
        elif rep is not None and (rep.spills or rep.stack_frame):
            r = TuneResult(cfg, "spills", registers=regs, is_default=cfg == base,
                           detail=f"{rep.spills} spill bytes, {rep.stack_frame} bytes stack frame")
        else:
            runnable.append((cfg, regs))
            continue
        results.append(r)
        report(r)

    if reports[base.name][1] is not None:
        raise RuntimeError(f"the default config {base.name} does not compile: {reports[base.name][1]}")
    problem = _make_problem(dtype, head_dim, page_size, num_qo_heads, num_kv_heads, seq_len, batch)
    _, ref = problem.run(base)  # the reference every candidate's output is compared with
    for cfg, regs in runnable:
        r = TuneResult(cfg, "ok", registers=regs, is_default=cfg == base)
        try:
            runner, out = problem.run(cfg)
            r.max_diff = problem.max_diff(out, ref)
            if not r.max_diff <= 1.0:
                r.status, r.detail = "mismatch", f"output differs from {base.name}'s ({r.max_diff:.3g}x the tolerance)"
            else:
                r.ms = problem.time_ms(runner, reps)
                r.tflops = problem.flops / (r.ms * 1e-3) / 1e12 if r.ms > 0 else None
        except Exception as e:  # noqa: BLE001 - a candidate that cannot run is reported, not fatal
            r.status, r.detail = "error", f"{type(e).__name__}: {str(e)[:200]}"
        results.append(r)
        report(r)

    timed = [r for r in results if r.ok]
    if not timed:
        raise RuntimeError(f"no candidate ran correctly for {dtype} head_dim={head_dim} page_size={page_size}: "
                           + "; ".join(f"{r.config.name if hasattr(r.config, 'name') else r.config}: {r.status}"
                                       for r in results[:5]))
    best = min(timed, key=lambda r: r.ms)
    default_ms = next((r.ms for r in timed if r.is_default), None)
    if persist:
        save_record(best.config, device, ms=best.ms, tflops=best.tflops, default_ms=default_ms,
                    problem={"num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads, "seq_len": seq_len,
                             "batch": batch, "mask": "causal", "reps": reps},
                    candidates_timed=len(timed), cukv=__version__, arch=compiler.target_arch(),
                    date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    return best.config
