"""Helpers the probes in this folder share (not part of the wheel): the FP8 probes' cases, a one-line interleaved
timing report, the tile probes' ``--unchecked`` switch and convert-once grid variants, a config compiled with probe
defines or replaced fields, and an MLA decode op built that way.

Probes run as scripts from the repository root (``python benchmarks/probe_x.py``), so this folder is on their path.
"""
from __future__ import annotations

from cukv.bench.prefill import DTYPE, PAGE_SIZE, _build, fp8_cache_like  # noqa: F401 - the probes' shared names


def probe_cases(shapes: str, granularity):
    """The FP8 probes' cases (benchmarks/probe_*.py): for each ``'BxLxHQxHKVxD'`` of the comma-separated ``shapes``,
    ``(shape, (batch, seq_len, hq, hkv, d), data, fcache, out)``: the bench's bf16 paged case (``_build``), the same
    tokens in an FP8 cache of ``granularity`` and an output buffer. The memory pool is emptied after each shape."""
    import cupy as cp

    for shape in shapes.split(","):
        dims = tuple(map(int, shape.split("x")))
        data = _build(*dims)
        yield shape, dims, data, fp8_cache_like(data, granularity), cp.empty_like(data[0])
        cp.get_default_memory_pool().free_all_blocks()


def probe_report(label: str, timer, fns: dict, rounds: int, diffs: dict | None = None, digits: int = 2,
                 reps: int = 20) -> dict:
    """Times ``fns`` (the first is the baseline) in ``rounds`` interleaved rounds of ``reps`` calls in all and prints
    one line: each one's median ms and baseline/it, then the largest differences in ``diffs``. Returns the medians."""
    from cukv.bench.timing import interleaved_medians

    med = interleaved_medians(timer, fns, reps=reps, rounds=rounds)
    base = next(iter(med.values()))
    print(f"{label}: " + "  ".join(f"{n} {m:.3f} ({base / m:.{digits}f})" for n, m in med.items())
          + ("  max|diff| " + " ".join(f"{n} {x:.3g}" for n, x in diffs.items()) if diffs else ""), flush=True)
    return med


def add_unchecked_option(ap) -> None:
    """The tile probes' ``--unchecked``: :func:`apply_unchecked` then skips the configs' measured domain rules."""
    ap.add_argument("--unchecked", action="store_true", help="skip the configs' measured rules (check_rule), to time "
                    "tiles they exclude; ptxas and the kernels' static_asserts still apply")


def apply_unchecked(args) -> None:
    """With ``--unchecked``, every ``check_rule`` of the prefill configs passes for the rest of the process (a probe's
    choice: the resource checks are then ptxas's and the kernels' own)."""
    if args.unchecked:
        from cukv.configs import prefill

        prefill.check_rule = lambda *a, **k: None


def once_variant(strategy: str):
    """A probe's strategy name to ``(fp8_prefill, once_persistent, max_blocks)`` (``BatchPrefill``'s arguments):
    ``'convert_once:np'`` runs convert-once on the launch-per-item grid, ``'convert_once:gN'`` on a persistent grid of
    N blocks (benchmarks/probe_prefill_once.py, benchmarks/ncu_launches.py prefill)."""
    return (strategy.split(":")[0], not strategy.endswith(":np"),
            int(strategy.split(":g")[1]) if ":g" in strategy else None)


def field_value(text: str):
    """A config field's value from the command line: ``true``/``false``, an integer, else the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return int(text) if text.lstrip("-").isdigit() else text


def compiled_with(cfg, defines: str = "", **fields):
    """A fresh copy of ``cfg`` with ``fields`` replaced, compiled now under ``defines`` (the ``CUKV_DEFINES`` form; a
    config object keeps the module it compiled), and that build's module (its probe globals:
    ``module.get_global(name)``)."""
    import dataclasses
    import os

    cfg = dataclasses.replace(cfg, **fields)
    os.environ["CUKV_DEFINES"] = defines
    try:
        mod = cfg.compiled.module()
    finally:
        os.environ["CUKV_DEFINES"] = ""
    return cfg, mod


def mla_op_with_defines(heads: int, lens, s_q: int, defines: str):
    """A ``BatchMLADecode`` planned for ``lens`` and ``s_q`` on the policy's config compiled with ``defines`` (the
    ``CUKV_DEFINES`` form), and that build's module (:func:`compiled_with`)."""
    from cukv.ops.mla_decode import BatchMLADecode

    dec = BatchMLADecode(heads).plan(lens, s_q)
    dec.config, mod = compiled_with(dec.config, defines)  # set by hand: plan keeps it
    dec.plan(lens, s_q)
    return dec, mod
