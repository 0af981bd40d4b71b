"""``python -m cukv bench decode``: cukv paged decode beside PyTorch SDPA (cuDNN, flash) on the same K/V.

bf16, 32 query / 8 KV heads, d=128, page 16 in random physical order. Every call is timed with CUDA events
after an L2 flush; cukv and the peers are timed in three interleaved rounds of 10 calls, and each reports the
median of its round medians. Effective TB/s counts the K and V bytes read once. The peers see the
same values laid out contiguously ``[B, H_kv, L, D]`` (their best case).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

from ..device import device_name as _device_name
from . import peer_torch
from .timing import geomean, interleaved_medians, write_json  # also the probes' import (benchmarks/probe_*.py)

GRID_BATCH = (1, 8, 32, 128)
GRID_CTX = (512, 2048, 8192, 32768)
EXTRA = ((64, 4096), (16, 32768))  # the issue's bandwidth-bar cells
SWEEP_VARIANTS = ((4, 0), (4, 2), (4, 3), (4, 4), (2, 4), (2, 6), (8, 2), (8, 3))  # (num_warps, stages)


def _torch():
    """PyTorch when the SDPA peers can run, else None (why not: ``peer_torch``)."""
    return peer_torch()[0]


def _build(batch, ctx, hq, hkv, d, page_size, rng_seed=0):
    import cupy as cp

    import cukv

    pages_per = -(-ctx // page_size)
    num_pages = batch * pages_per
    cache = cukv.PagedKVCache(num_pages, page_size, hkv, d, dtype="bfloat16", layout="combined")
    rs = cp.random.RandomState(rng_seed)
    # random bf16 bit patterns of N(0,1) values, generated in slabs to bound float32 scratch
    flat = cache.storage.reshape(num_pages, -1)
    slab = max(1, (64 << 20) // flat.shape[1])
    for i in range(0, num_pages, slab):
        x = rs.standard_normal((min(slab, num_pages - i), flat.shape[1]), dtype=cp.float32)
        flat[i: i + slab] = (x.view(cp.uint32) >> 16).astype(cp.uint16)
    perm = np.random.default_rng(rng_seed).permutation(num_pages).astype(np.int32)
    table = perm.reshape(batch, pages_per)
    lengths = np.full(batch, ctx, np.int32)
    pt = cukv.PageTable(cp.asarray(table), cp.asarray(lengths), page_size)
    q = (rs.standard_normal((batch, hq, d), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
    return cache, pt, q, table


def _fp8_cache(batch, ctx, hkv, d, page_size, granularity, rng_seed=1):
    """An FP8 cache of the same geometry with random finite codes (never the NaN codes 0x7f/0xff) and
    random positive scales: the kernel's work does not depend on the values, but NaN or zeros would hide
    mistakes."""
    import cupy as cp

    import cukv

    pages_per = -(-ctx // page_size)
    num_pages = batch * pages_per
    cache = cukv.PagedKVCache(num_pages, page_size, hkv, d, dtype="fp8_e4m3", layout="combined",
                              scale_granularity=granularity)
    rs = cp.random.RandomState(rng_seed)
    flat = cache.storage.reshape(num_pages, -1)
    slab = max(1, (256 << 20) // flat.shape[1])
    for i in range(0, num_pages, slab):
        codes = rs.randint(0, 0x7E, size=(min(slab, num_pages - i), flat.shape[1]), dtype=cp.int32)
        sign = rs.randint(0, 2, size=codes.shape, dtype=cp.int32) << 7
        flat[i: i + slab] = (codes | sign).astype(cp.uint8)
    if cache.scale_block:
        cache.scale_storage[...] = rs.uniform(0.5 / 448, 4.0 / 448, cache.scale_storage.shape).astype(cp.float32)
    else:
        cache.set_tensor_scales(3.0 / 448, 3.0 / 448)
    return cache


def fp8_bytes(batch, ctx, hkv, d, scale_block) -> int:
    """Bytes an FP8 decode reads: codes plus scales (per tensor: two floats)."""
    scales = 2 * 4 * batch * ctx * hkv * (d // scale_block) if scale_block else 8
    return 2 * batch * ctx * hkv * d + scales


def _contiguous(cache, table, ctx):
    """[B, H_kv, L, D] copies of K and V in sequence order (for the peers)."""
    import cupy as cp

    pos = np.arange(ctx)
    rows = cp.asarray(table[:, pos // cache.page_size])           # [B, L]
    offs = cp.asarray(np.broadcast_to(pos % cache.page_size, rows.shape))
    k = cp.ascontiguousarray(cache.k[rows, offs].transpose(0, 2, 1, 3))
    v = cp.ascontiguousarray(cache.v[rows, offs].transpose(0, 2, 1, 3))
    return k, v


def run(out_dir: str | None = None, quick: bool = False, reps: int = 30, sweep: bool = False,
        kv_dtype: str = "bfloat16", scale_granularity="token") -> dict:
    """Time the grid; ``kv_dtype='fp8_e4m3'`` adds an FP8 cache (``scale_granularity``) beside bf16 in
    every cell, with its own TB/s (codes + scales) and its speed-up over bf16."""
    import cupy as cp

    import cukv
    from .timing import Timer, read_ceiling

    torch = _torch()
    hq, hkv, d, ps = 32, 8, 128, 16
    timer = Timer()
    ceiling, ceiling_variants = read_ceiling(timer)
    tiny = cp.empty(4096, cp.uint16)
    floor_ms = timer.median_ms(lambda: tiny.fill(0), reps=reps)  # one tiny kernel: the harness's own floor
    cells = [(b, c) for b in GRID_BATCH for c in GRID_CTX] + list(EXTRA)
    if quick:
        cells = [(1, 512), (64, 4096), (16, 32768), (128, 8192)]
    rows = []
    for batch, ctx in cells:
        cache, pt, q, table = _build(batch, ctx, hq, hkv, d, ps)
        nbytes = 2 * batch * ctx * hkv * d * 2
        dec = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16").plan(batch, ctx)
        out = cp.empty_like(q)
        fns = {"cukv": lambda: dec.run(q, cache, pt, out=out)}
        row = {"batch": batch, "ctx": ctx, "splits": dec.num_splits, "stages": dec.config.stages}
        if kv_dtype == "fp8_e4m3":
            fcache = _fp8_cache(batch, ctx, hkv, d, ps, scale_granularity)
            fdec = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16", kv_dtype="fp8_e4m3",
                                    scale_granularity=scale_granularity).plan(batch, ctx)
            fns["fp8"] = lambda: fdec.run(q, fcache, pt, out=out)
            row["fp8_splits"] = fdec.num_splits
        fns["cukv"]()  # `out` now holds cukv's answer, which each peer's output is compared with
        cp.cuda.Device().synchronize()
        peers = _peer_fns(torch, cache, table, q, out, batch, ctx, hq, d, row) if torch is not None else {}
        fns.update(peers)
        times = interleaved_medians(timer, fns, reps)
        ms = times["cukv"]
        row.update({"cukv_ms": ms, "cukv_tbs": nbytes / ms / 1e9, "pct_ceiling": 100 * nbytes / ms / 1e9 / ceiling})
        if "fp8" in times:
            from ..fp8 import scale_block

            fms = times["fp8"]
            fb = fp8_bytes(batch, ctx, hkv, d, scale_block(scale_granularity, d))
            row.update({"fp8_ms": fms, "fp8_tbs": fb / fms / 1e9, "fp8_pct_ceiling": 100 * fb / fms / 1e9 / ceiling,
                        "fp8_speedup": ms / fms})
        for name in peers:
            row[f"{name}_ms"] = times[name]
            row[f"ratio_{name}"] = times[name] / ms  # > 1: cukv faster
        if sweep:  # warps x staging (ring slots, 0 = registers) x split counts, to tune the defaults
            row["sweep"] = {}
            for nw, st in SWEEP_VARIANTS:
                try:
                    base = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16", num_warps=nw, stages=st).plan(batch, ctx)
                except ValueError:
                    continue
                for sp in sorted({max(1, base.num_splits // 2), base.num_splits, base.num_splits * 2}):
                    alt = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16", num_warps=nw, stages=st).plan(
                        batch, ctx, num_splits=sp)
                    row["sweep"][f"w{nw}_r{st}_s{sp}"] = timer.median_ms(lambda: alt.run(q, cache, pt, out=out), reps=10)
            best = min(row["sweep"], key=row["sweep"].get)
            print(f"   sweep best {best} {row['sweep'][best] * 1e3:.1f} us  "
                  + " ".join(f"{k}:{v * 1e3:.0f}" for k, v in row["sweep"].items()), flush=True)
        del fns, peers
        rows.append(row)
        del cache, pt, q, out, dec
        cp.get_default_memory_pool().free_all_blocks()
        print(_fmt_row(row), flush=True)
    grid = [r for r in rows if (r["batch"], r["ctx"]) not in EXTRA or (r["batch"] in GRID_BATCH and r["ctx"] in GRID_CTX)]
    summary = {"device": _device_name(), "date": time.strftime("%Y-%m-%d"), "l2_flush": timer.flush,
               "read_ceiling_tbs": ceiling,
               "read_ceiling_variants": ceiling_variants, "launch_floor_us": floor_ms * 1e3, "kv_dtype": kv_dtype, "scale_granularity": scale_granularity if kv_dtype == "fp8_e4m3" else None}
    ratios = [r["ratio_cudnn"] for r in grid if "ratio_cudnn" in r]
    if ratios:
        summary["geomean_ratio_cudnn"] = geomean(ratios)
        summary["min_ratio_cudnn"] = float(min(ratios))
    # every cell (the grid and the extra ones): where cuDNN is faster, and the lowest share of the read ceiling among
    # the cells that read at least as much K/V as 64 x 4096
    summary["cells_cudnn_faster"] = [f"{r['batch']} x {r['ctx']}" for r in rows if r.get("ratio_cudnn", 1.0) < 1.0]
    large = [r["pct_ceiling"] for r in rows if r["batch"] * r["ctx"] >= 64 * 4096]
    if large:
        summary["min_pct_ceiling_large"] = float(min(large))
    summary["load_ms"] = warm_load_ms()
    result = {"summary": summary, "rows": rows}
    if out_dir:
        tag = "" if kv_dtype == "bfloat16" else f"_{kv_dtype}"
        write_json(out_dir, f"bench_decode{tag}.json", result)
        _plot(rows, ceiling, os.path.join(out_dir, f"bench_decode{tag}.png"))
    print(format_table(result))
    return result


def _peer_fns(torch, cache, table, q, out, batch, ctx, hq, d, row) -> dict:
    """PyTorch SDPA (cuDNN, flash) on contiguous copies of the same K/V; a backend that cannot run the shape
    is recorded in ``row`` and left out."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    kc, vc = _contiguous(cache, table, ctx)
    tk = torch.from_dlpack(kc).view(torch.bfloat16)
    tv = torch.from_dlpack(vc).view(torch.bfloat16)
    tq = torch.from_dlpack(q).view(torch.bfloat16).reshape(batch, hq, 1, d)
    fns = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def fn(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
        try:
            peer_out = fn()
            torch.cuda.synchronize()
            # the same query against the same keys: cukv's output for this cell is checked against the peer's
            ref = torch.from_dlpack(out).view(torch.bfloat16).float()
            row[f"maxdiff_{name}"] = float((peer_out.float().reshape(batch, hq, d) - ref).abs().max())
            fns[name] = fn
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this shape is reported, not fatal
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:120]}"
    return fns


def warm_load_ms() -> float:
    """Milliseconds for a fresh process to get decode ready from the disk cache (CUKV_NO_COMPILE=1)."""
    code = ("import time,cupy;cupy.cuda.runtime.getDeviceCount();cupy.zeros(1);import cukv;t=time.perf_counter();"
            "cukv.BatchDecode(32,8,128,16,'bfloat16').plan(64,4096);cupy.cuda.Device().synchronize();"
            "print((time.perf_counter()-t)*1e3)")
    env = dict(os.environ, CUKV_NO_COMPILE="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    try:
        return float(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return float("nan")


def _fmt_row(r) -> str:
    s = f"{r['batch']:>5} x {r['ctx']:<6} splits {r['splits']:>2}  cukv {r['cukv_ms'] * 1e3:8.1f} us {r['cukv_tbs']:5.2f} TB/s ({r['pct_ceiling']:5.1f}%)"
    if "fp8_ms" in r:
        s += f"  fp8 {r['fp8_ms'] * 1e3:8.1f} us {r['fp8_tbs']:5.2f} TB/s ({r['fp8_pct_ceiling']:5.1f}%) x{r['fp8_speedup']:.2f}"
    for p in ("cudnn", "flash"):
        if f"{p}_ms" in r:
            s += f"  {p} {r[f'{p}_ms'] * 1e3:8.1f} us x{r[f'ratio_{p}']:.2f}"
        elif f"{p}_error" in r:
            s += f"  {p} n/a"
    return s


def format_table(result) -> str:
    s = result["summary"]
    lines = [f"decode bf16 32q/8kv d128 page16 on {s['device']} ({s['date']}); read ceiling {s['read_ceiling_tbs']:.2f} TB/s",
             "| batch x ctx | splits | cukv us | TB/s | % ceiling | cuDNN us | cuDNN/cukv | flash us | flash/cukv |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        def f(k, fmt, mult=1.0):
            return format(r[k] * mult, fmt) if k in r else "n/a"
        lines.append(f"| {r['batch']} x {r['ctx']} | {r['splits']} | {r['cukv_ms'] * 1e3:.1f} | {r['cukv_tbs']:.2f} | "
                     f"{r['pct_ceiling']:.1f} | {f('cudnn_ms', '.1f', 1e3)} | {f('ratio_cudnn', '.2f')} | "
                     f"{f('flash_ms', '.1f', 1e3)} | {f('ratio_flash', '.2f')} |")
    if any("fp8_ms" in r for r in result["rows"]):
        lines += ["", f"FP8 e4m3 cache (scale granularity {s.get('scale_granularity')!r}) beside bf16; TB/s counts codes + scales",
                  "| batch x ctx | bf16 us | fp8 us | fp8 speed-up | fp8 TB/s | fp8 % ceiling | cuDNN(bf16)/fp8 |",
                  "|---|---|---|---|---|---|---|"]
        for r in result["rows"]:
            if "fp8_ms" in r:
                cud = f"{r['cudnn_ms'] / r['fp8_ms']:.2f}" if "cudnn_ms" in r else "n/a"
                lines.append(f"| {r['batch']} x {r['ctx']} | {r['cukv_ms'] * 1e3:.1f} | {r['fp8_ms'] * 1e3:.1f} | "
                             f"{r['fp8_speedup']:.2f} | {r['fp8_tbs']:.2f} | {r['fp8_pct_ceiling']:.1f} | {cud} |")
    if "geomean_ratio_cudnn" in s:
        lines.append(f"geomean(cuDNN time / cukv time) over the 4x4 grid = {s['geomean_ratio_cudnn']:.3f}, "
                     f"min {s['min_ratio_cudnn']:.3f}")
    if "cells_cudnn_faster" in s:
        slow = s["cells_cudnn_faster"]
        lines.append(f"cells where cuDNN is faster: {', '.join(slow) if slow else 'none'}")
    if "min_pct_ceiling_large" in s:
        lines.append(f"lowest % of the read ceiling at 64 x 4096 tokens and above: {s['min_pct_ceiling_large']:.1f}")
    if "launch_floor_us" in s:
        lines.append(f"harness floor (one tiny kernel, same timing): {s['launch_floor_us']:.1f} us")
    lines.append(f"warm process: decode ready from the disk cache in {s['load_ms']:.1f} ms")
    return "\n".join(lines)


def _plot(rows, ceiling, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - plots are a convenience
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"{r['batch']}x{r['ctx']}" for r in rows]
    x = np.arange(len(rows))
    for i, (key, name) in enumerate((("cukv_ms", "cukv"), ("cudnn_ms", "SDPA cuDNN"), ("flash_ms", "SDPA flash"))):
        tb = [2 * r["batch"] * r["ctx"] * 8 * 128 * 2 / r[key] / 1e9 if key in r else 0 for r in rows]
        ax.bar(x + (i - 1) * 0.27, tb, 0.27, label=name)
    ax.axhline(ceiling, color="k", ls="--", lw=1, label="read ceiling")
    ax.set_xticks(x, labels, rotation=60, fontsize=8)
    ax.set_ylabel("effective TB/s (K+V bytes / time)")
    ax.set_title("paged decode, bf16, 32q/8kv, d128, page 16")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
