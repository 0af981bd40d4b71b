"""CUDA-event timing with an L2 flush before every call, medians, and the measured read ceiling."""
from __future__ import annotations

import numpy as np


class Timer:
    """CUDA-event medians with L2 flushed before every timed call.

    The flush writes a ``flush_bytes`` buffer (evicting L2's contents) and then discards the buffer's lines from L2
    (``discard.global.L2``, no write-back), so the timed call starts on an L2 that holds neither its inputs nor dirty
    lines whose write-back its first reads would pay (about 9-10 us a call on an H100 or H200: docs/tuning.md,
    "L2 flush"). ``flush="write"`` leaves the written lines in place (to compare with figures timed that way)."""

    def __init__(self, flush_bytes: int = 256 << 20, flush: str = "discard"):
        import cupy as cp

        from .. import compiler

        if flush not in ("discard", "write"):
            raise ValueError(f"flush must be 'discard' or 'write'; got {flush!r}")
        self.flush = flush
        buf = cp.empty(flush_bytes // 4, cp.int32)
        if flush == "write":
            self._flush = lambda: buf.fill(1)
        else:
            f = compiler.build("l2_discard.cu.j2", "cukv_l2_discard", name="cukv_l2_discard").function("cukv_l2_discard")
            lines = np.int64(flush_bytes // 128)

            def flush():
                buf.fill(1)
                f((1024,), (256,), (buf, lines))
            self._flush = flush
        self._start, self._end = cp.cuda.Event(), cp.cuda.Event()
        self._spin = compiler.build("spin.cu.j2", "cukv_spin", name="cukv_spin").function("cukv_spin")

    def median_ms(self, fn, reps: int = 30, warmup: int = 5, warmup_ms: float = 50.0) -> float:
        """Median of ``reps`` timed calls; L2 is flushed (outside the timed region) before each. Warm-up runs
        at least ``warmup`` calls and at least ``warmup_ms`` of GPU time (flushes included): after the host
        has built a new problem the GPU comes back from idle clocks, and a few short calls do not lift it.

        The start event is recorded before ``fn`` runs on the host, so host work (argument checks, tensor-map
        encoding) that outlasted the flush used to be timed as GPU time. A spin kernel between the flush and
        the start event now lasts twice the host time ``fn`` took in the warm-up (plus 50 us)."""
        import time

        t_end = time.perf_counter() + warmup_ms * 1e-3
        n, host = 0, []
        while n < warmup or time.perf_counter() < t_end:
            self._flush()
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
            n += 1
            if n % 8 == 0:
                self._end.record()
                self._end.synchronize()
        spin_ns = np.int64(2e9 * float(np.median(host)) + 50e3)
        times = []
        for _ in range(reps):
            self._flush()
            self._spin((1,), (32,), (spin_ns,))
            self._start.record()
            fn()
            self._end.record()
            self._end.synchronize()
            times.append(self._start_end())
        return float(np.median(times))

    def _start_end(self) -> float:
        import cupy as cp

        return cp.cuda.get_elapsed_time(self._start, self._end)


def interleaved_rounds(timer, fns: dict, reps: int, rounds: int = 3) -> dict:
    """Each function's median in each of ``rounds`` interleaved rounds (``reps`` calls in all, at least 5 a
    round): ``{name: [round medians]}``. A slow spell of the GPU (clocks, a neighbour) then lands on one round
    of every contender, not on one of them."""
    per = max(5, reps // rounds)
    got = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            got[k].append(timer.median_ms(fn, reps=per))
    return got


def interleaved_medians(timer, fns: dict, reps: int, rounds: int = 3) -> dict:
    """The median over :func:`interleaved_rounds`' rounds of each function's round medians."""
    return {k: float(np.median(v)) for k, v in interleaved_rounds(timer, fns, reps, rounds).items()}


#: the read-ceiling variants: ("ldg", threads, loads in flight per thread, blocks per SM) and ("bulk", bytes per
#: copy, copies in flight per block, blocks per SM); the ceiling is the fastest (docs/tuning.md "read ceiling")
CEILING_VARIANTS = (("ldg", 256, 4, 8), ("ldg", 256, 8, 8), ("ldg", 512, 8, 4), ("ldg", 256, 16, 4),
                    ("ldg", 1024, 4, 2), ("bulk", 16384, 8, 1), ("bulk", 32768, 6, 1), ("bulk", 16384, 6, 2),
                    ("bulk", 8192, 8, 3))


def ceiling_kernel(variant) -> tuple:
    """One :data:`CEILING_VARIANTS` entry's kernel: ``(entry name, compiled module, threads per block, dynamic
    shared memory bytes)`` (compiles without a GPU)."""
    from .. import compiler

    kind, a, b, _ = variant
    if kind == "ldg":
        name, params, block, smem = f"cukv_read_ceiling_ldg_t{a}_u{b}", dict(threads=a, unroll=b), a, 0
    else:
        name, params, block, smem = f"cukv_read_ceiling_bulk_c{a}_s{b}", dict(chunk=a, stages=b), 32, a * b
    params = {**dict(threads=0, unroll=0, chunk=0, stages=0), **params}
    return name, compiler.build("read_ceiling.cu.j2", name, name=name, kind=kind, **params), block, smem


def read_ceiling(timer: Timer, nbytes: int = 4 << 30, variants=CEILING_VARIANTS) -> tuple:
    """The GPU's read ceiling: TB/s of the fastest of ``variants``, kernels that read ``nbytes`` once (16-byte
    streaming loads with more or fewer in flight, or bulk copies into shared memory). Returns ``(best TB/s,
    {variant name: TB/s})``."""
    import cupy as cp

    from ..device import sm_count

    buf = cp.ones(nbytes // 4, cp.int32)
    out = cp.zeros(1, cp.uint32)
    n = np.int64(nbytes // 16)
    got = {}
    for v in variants:
        name, mod, block, smem = ceiling_kernel(v)
        f = mod.function(name, smem)
        ms = timer.median_ms(lambda: f((sm_count() * v[3],), (block,), (buf, n, out), shared_mem=smem), reps=10,
                             warmup=3)
        got[f"{name}_x{v[3]}"] = nbytes / (ms * 1e-3) / 1e12
    del buf
    return max(got.values()), got


def read_ceiling_tbs(timer: Timer, nbytes: int = 4 << 30) -> float:
    """TB/s of the fastest read-ceiling kernel (:func:`read_ceiling`)."""
    return read_ceiling(timer, nbytes)[0]


def geomean(xs) -> float:
    """Geometric mean of positive ratios (the benches' summary of time ratios)."""
    import numpy as np

    return float(np.exp(np.mean(np.log(np.asarray(list(xs), dtype=np.float64)))))


def write_json(out_dir: str, name: str, result) -> str:
    """``result`` as ``out_dir/name`` (indented JSON; the folder is made if missing); returns the path."""
    import json
    import os

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path
