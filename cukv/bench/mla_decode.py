"""``python -m cukv bench mla-decode``: absorbed MLA decode (bf16, page 64) beside FlashMLA's dense decode
(SM90 legacy kernels, when ``flash_mla`` imports) in the same process, L2 flushed before every call, CUDA
events, medians. FLOPs = ``2 B H s_q ctx (576 + 512)``; bytes = cache rows read + Q + O."""
from __future__ import annotations

import time

import numpy as np

from ..device import device_name
from .timing import Timer, geomean, read_ceiling, write_json

PAGE = 64
# (name, batch, heads, s_q, lengths or ctx)
SHAPES = [("b128 h128 ctx4096", 128, 128, 1, 4096), ("b128 h128 ctx8192", 128, 128, 1, 8192),
          ("b128 h128 ctx16384", 128, 128, 1, 16384), ("b128 h128 ctx32768", 128, 128, 1, 32768),
          ("b128 h128 s_q2 ctx8192", 128, 128, 2, 8192), ("b128 h64 ctx8192", 128, 64, 1, 8192),
          ("b128 h16 ctx8192", 128, 16, 1, 8192), ("b16 h16 ctx32768", 16, 16, 1, 32768),
          ("b1 h128 ctx32768", 1, 128, 1, 32768), ("skewed b32 h128 (64K + 1-4K)", 32, 128, 1, "skewed")]
QUICK = ["b128 h128 ctx8192", "b128 h16 ctx8192", "b1 h128 ctx32768", "skewed b32 h128 (64K + 1-4K)"]


def _lengths(batch, ctx):
    if ctx == "skewed":
        rng = np.random.default_rng(7)
        return np.array([65536] + list(rng.integers(1024, 4097, batch - 1)), np.int32)
    return np.full(batch, ctx, np.int32)


def _flash_mla():
    try:
        import flash_mla
        import torch

        if not flash_mla.has_legacy():
            return None, None, "flash_mla has no legacy SM90 kernels"
        return flash_mla, torch, None
    except Exception as e:  # noqa: BLE001 - the peer is optional
        return None, None, f"flash_mla not importable ({type(e).__name__}: {str(e)[:80]})"


def _problem(batch, heads, s_q, lens, seed=0):
    """A page-64 bf16 cache holding the batch in shuffled pages, a table, and the query (CuPy, bf16 bits)."""
    import cupy as cp

    from ..mla_cache import MLAKVCache

    pages_per = [-(-int(n) // PAGE) for n in lens]
    width = max(pages_per)
    num_pages = sum(pages_per)
    rng = cp.random.default_rng(seed)
    cache = MLAKVCache(num_pages, PAGE, "bfloat16")
    block = min(num_pages, 256)
    vals = rng.standard_normal((block, PAGE, 576), dtype=cp.float32)
    bits = (vals.view(cp.uint32) >> 16).astype(cp.uint16)  # truncation is fine for timing data
    for p0 in range(0, num_pages, block):
        n = min(block, num_pages - p0)
        cache.data[p0:p0 + n] = bits[:n]
    perm = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
    table = np.zeros((batch, width), np.int32)
    k = 0
    for i, n in enumerate(pages_per):
        table[i, :n] = perm[k:k + n]
        k += n
    q = (rng.standard_normal((batch, s_q, heads, 576), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
    return cache, cp.asarray(table), q


def _fp8_copy(cache):
    """The same rows as an FP8 cache (656-byte rows, FlashMLA-style power-of-two scales), same page ids."""
    import cupy as cp

    from ..mla_cache import MLAKVCache
    from ..ops.mla_append import append_mla

    fp8 = MLAKVCache(cache.num_pages, PAGE, "fp8_e4m3")
    rows = cache.data.reshape(-1, 576)
    append_mla(fp8, rows[:, :512], rows[:, 512:], cp.arange(rows.shape[0], dtype=cp.int64), pow2_scales=True,
               dtype="bfloat16")
    return fp8


def parse_mla_configs(text: str) -> tuple:
    """``--mla-configs``: comma-separated ``BNxS`` with optional ``:schedule``, ``:tma`` or ``:cpasync``, and
    ``:slices`` (per-slice ring barriers, ``slice_release``; with ``:alternate``) (``64x2``, ``64x2:alternate``,
    ``64x2:cpasync``, ``64x2:alternate:slices``) -> ``((block_n, num_kv_stages, schedule, tma, slice_release), ...)``,
    ``schedule``, ``tma`` and ``slice_release`` None (the policy's choice, per shape) unless a flag sets them; a
    malformed entry is a ValueError naming it.

    >>> from cukv.bench.mla_decode import parse_mla_configs
    >>> parse_mla_configs("64x2,64x2:split,64x2:alternate:cpasync,64x2:alternate:slices")
    ((64, 2, None, None, None), (64, 2, 'split', None, False), (64, 2, 'alternate', False, None), (64, 2, 'alternate', None, True))
    """
    from ..configs.mla_decode import SCHEDULES

    flags_ok = SCHEDULES + ("tma", "cpasync", "slices")
    out = []
    for entry in text.split(","):
        tile, *flags = entry.strip().split(":")
        bn, _, st = tile.partition("x")
        schedules = [f for f in flags if f in SCHEDULES]
        copies = [f for f in flags if f in ("tma", "cpasync")]
        slices = "slices" in flags
        if not (bn.isdigit() and st.isdigit()) or len(schedules) > 1 or len(copies) > 1 or any(
                f not in flags_ok for f in flags) or len(flags) != len(set(flags)) or (
                slices and (schedules != ["alternate"] or copies == ["cpasync"])):
            raise ValueError(f"--mla-configs entry {entry!r} is not valid; expected BNxS with optional :schedule "
                             f"(one of {', '.join(SCHEDULES)}), :tma or :cpasync, and :slices (with :alternate, not "
                             ":cpasync), e.g. 64x2,64x2:alternate,64x2:cpasync,64x2:alternate:slices")
        sched = schedules[0] if schedules else None
        out.append((int(bn), int(st), sched, {"tma": True, "cpasync": False}[copies[0]] if copies else None,
                    True if slices else (False if sched == "split" else None)))
    return tuple(out)


def config_label(block_n: int, num_kv_stages: int, schedule: str | None = None, tma: bool | None = None,
                 slice_release: bool | None = None) -> str:
    """The bench's name for a cukv config other than the first: ``cukv_n64s2``, ``cukv_n64s2_split``,
    ``cukv_n64s2_alternate_cpasync``, ``cukv_n64s2_alternate_slices`` (None: the policy's choice, unnamed)."""
    return (f"cukv_n{block_n}s{num_kv_stages}" + ("" if schedule is None else f"_{schedule}")
            + {None: "", True: "_tma", False: "_cpasync"}[tma] + ("_slices" if slice_release else ""))


def run(out_dir: str | None = None, quick: bool = False, reps: int = 30, check: bool = True,
        configs=((64, 2, None, None, None),), fp8: bool = False) -> dict:
    """Time every shape; ``configs`` lists (block_n, num_kv_stages[, schedule[, tma[, slice_release]]]) of cukv to
    time in one process
    (the first is the one FlashMLA is compared with, reported as ``cukv``; the others as ``config_label(...)``,
    each with its largest difference from the first's output)."""
    import cupy as cp

    from ..ops.mla_decode import BatchMLADecode

    configs = tuple((c[0], c[1], c[2] if len(c) > 2 else None, c[3] if len(c) > 3 else None,
                     c[4] if len(c) > 4 else None) for c in configs)

    timer = Timer()
    ceiling, ceiling_variants = read_ceiling(timer)
    fm, torch, why = _flash_mla()
    rows = []
    for name, batch, heads, s_q, ctx in SHAPES:
        if quick and name not in QUICK:
            continue
        lens = _lengths(batch, ctx)
        cache, table, q = _problem(batch, heads, s_q, lens)
        decs = [BatchMLADecode(heads, block_n=bn, num_kv_stages=st, schedule=sc, tma=tm,
                               slice_release=sl).plan(lens, s_q) for bn, st, sc, tm, sl in configs]
        dec = decs[0]
        out = cp.empty((batch, s_q, heads, 512), cp.uint16)
        lse = cp.empty((batch, s_q, heads), cp.float32)
        fns = {"cukv": lambda: dec.run(q, cache, table, out=out, lse=lse)}
        diffs = {}
        if len(configs) > 1:  # every other config against the first, on this shape's data
            dec.run(q, cache, table, out=out, lse=lse)
            want = _bf16_float(out)
            for c, d in zip(configs[1:], decs[1:]):
                got = _bf16_float(d.run(q, cache, table))
                diffs[config_label(*c)] = float(cp.nan_to_num(cp.abs(got - want), nan=cp.inf).max())
        for c, d in zip(configs[1:], decs[1:]):
            fns[config_label(*c)] = lambda d=d: d.run(q, cache, table, out=out, lse=lse)
        if fp8:  # opt-in: the FP8 path's timing beside bf16 (reported as cukv_fp8, and its ratio to cukv bf16)
            fcache = _fp8_copy(cache)
            fdec = BatchMLADecode(heads, kv_dtype="fp8_e4m3").plan(lens, s_q)
            fns["cukv_fp8"] = lambda: fdec.run(q, fcache, table, out=out, lse=lse)
        err = None
        if fm is not None:
            kc = torch.from_dlpack(cache.data).view(torch.bfloat16).view(cache.num_pages, PAGE, 1, 576)
            tq = torch.from_dlpack(q).view(torch.bfloat16)
            tt = torch.from_dlpack(table)
            tl = torch.from_dlpack(cp.asarray(lens))
            meta, _ = fm.get_mla_metadata()
            call = lambda: fm.flash_mla_with_kvcache(tq, kc, tt, tl, 512, meta, None, 576 ** -0.5,  # noqa: E731
                                                      causal=s_q > 1, use_legacy=True)
            fo, flse = call()  # plans its schedule once, outside the timing
            fns["flashmla"] = call
            if check:
                dec.run(q, cache, table, out=out, lse=lse)
                mine = torch.from_dlpack(out).view(torch.bfloat16).float()
                err = float((mine - fo.float()).abs().max())
        ms = {k: timer.median_ms(f, reps=reps) for k, f in fns.items()}
        flops = 2.0 * heads * s_q * float(lens.sum()) * (576 + 512)
        nbytes = float(lens.sum()) * 576 * 2 + batch * s_q * heads * (576 + 512) * 2
        r = {"shape": name, "batch": batch, "heads": heads, "s_q": s_q, "tokens": int(lens.sum()),
             "items": dec.num_items, "chunk_tiles": dec.chunk_tiles, "config": dec.config.name,
             "max_abs_diff_vs_flashmla": err}
        if fp8:
            r["fp8_config"] = fdec.config.name
        for k, v in diffs.items():
            r[f"{k}_max_abs_diff_vs_cukv"] = v
        for k, t in ms.items():
            r[f"{k}_ms"] = t
            r[f"{k}_tflops"] = flops / (t * 1e-3) / 1e12
            r[f"{k}_tbs"] = nbytes / (t * 1e-3) / 1e12
            r[f"{k}_pct_ceiling"] = 100.0 * r[f"{k}_tbs"] / ceiling
        if "flashmla_ms" in r:
            r["flashmla_over_cukv"] = r["flashmla_ms"] / r["cukv_ms"]
        if "cukv_fp8_ms" in r:
            r["cukv_bf16_over_fp8"] = r["cukv_ms"] / r["cukv_fp8_ms"]
        for c in configs[1:]:
            r[f"{config_label(*c)}_over_cukv"] = r["cukv_ms"] / r[f"{config_label(*c)}_ms"]
        rows.append(r)
        print(_fmt(r), flush=True)
        fns = cache = table = q = out = lse = dec = decs = fcache = fdec = None  # free this shape's buffers
        cp.get_default_memory_pool().free_all_blocks()
    result = {"device": device_name(), "date": time.strftime("%Y-%m-%d"),
              "read_ceiling_tbs": ceiling, "read_ceiling_variants": ceiling_variants, "flashmla": why or "imported",
              "cukv": sorted({r["config"] for r in rows}), "rows": rows}
    h128 = [r["flashmla_over_cukv"] for r in rows if r["heads"] == 128 and "flashmla_over_cukv" in r]
    if h128:
        result["geomean_flashmla_over_cukv_h128"] = geomean(h128)
    for c in configs[1:]:  # above 1: that config is faster than the first
        ratios = [r[f"{config_label(*c)}_over_cukv"] for r in rows]
        if ratios:
            result[f"geomean_{config_label(*c)}_over_cukv"] = geomean(ratios)
    print(format_table(result))
    if out_dir:
        write_json(out_dir, "bench_mla_decode.json", result)
    return result


def _bf16_float(x):
    """bf16 bits (a CuPy uint16 array) -> float32."""
    import cupy as cp

    return (x.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)


def _fmt(r) -> str:
    s = f"{r['shape']:<30} cukv {r['cukv_ms']:8.3f} ms {r['cukv_tflops']:6.1f} TF/s {r['cukv_tbs']:5.2f} TB/s " \
        f"({r['cukv_pct_ceiling']:4.0f}%)"
    if "flashmla_ms" in r:
        s += f" | FlashMLA {r['flashmla_ms']:8.3f} ms {r['flashmla_tflops']:6.1f} TF/s {r['flashmla_tbs']:5.2f} TB/s" \
             f" | FlashMLA/cukv {r['flashmla_over_cukv']:.3f}"
    for k in r:
        if (k.startswith("cukv_n") or k == "cukv_fp8_ms") and k.endswith("_ms"):
            s += f" | {k[:-3]} {r[k]:8.3f} ms"
            if f"{k[:-3]}_over_cukv" in r:
                s += f" (cukv/this {r[f'{k[:-3]}_over_cukv']:.3f}, diff {r[f'{k[:-3]}_max_abs_diff_vs_cukv']:.1e})"
    if "cukv_bf16_over_fp8" in r:
        s += f" (bf16/fp8 {r['cukv_bf16_over_fp8']:.2f})"
    if r.get("max_abs_diff_vs_flashmla") is not None:
        s += f" | diff {r['max_abs_diff_vs_flashmla']:.1e}"
    return s


def format_table(result) -> str:
    lines = [f"{result['device']}; read ceiling {result['read_ceiling_tbs']:.2f} TB/s; FlashMLA: {result['flashmla']}"]
    lines += [_fmt(r) for r in result["rows"]]
    if "geomean_flashmla_over_cukv_h128" in result:
        lines.append(f"geomean FlashMLA/cukv over h128 shapes: {result['geomean_flashmla_over_cukv_h128']:.3f}")
    for k, v in result.items():
        if k.startswith("geomean_cukv_"):
            lines.append(f"geomean cukv/{k[len('geomean_'):-len('_over_cukv')]} over all shapes: {v:.3f}")
    return "\n".join(lines)
