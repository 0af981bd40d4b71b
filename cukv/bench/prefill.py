"""``python -m cukv bench prefill``: cukv prefill beside PyTorch SDPA (flash, cuDNN) on the same data.

Pure causal prefill in bf16: every sequence has ``q_len = kv_len = L`` (no cached prefix). For each shape
the same Q/K/V are timed four ways:

- cukv paged: ``BatchPrefill(page_size=16)`` over a ``PagedKVCache`` whose pages sit in random physical
  order, filled by ``cukv.append_kv``;
- cukv contiguous: ``BatchPrefill(page_size=None)`` over ``k/v[total_kv, H_kv, D]`` with ``kv_offsets``;
- PyTorch SDPA with ``SDPBackend.FLASH_ATTENTION`` and with ``SDPBackend.CUDNN_ATTENTION``, ``is_causal=True``
  (``enable_gqa=True`` when ``H_q != H_kv``), q/k/v contiguous ``[B, H, L, D]`` bf16 (their best case).

Every call is timed with CUDA events after an L2 flush; medians of ``reps``. With ``kv_dtype='fp8_e4m3'``, bf16
paged and every FP8 strategy are timed together in ``FP8_ROUNDS`` interleaved rounds of ``reps`` calls each
(medians of the round medians), and the bf16/FP8 ratio is also reported round by round. A peer that cannot run
(no torch, no kernel for the shape) is recorded as null with the reason.

FLOPs count only the causal half of the score matrix: ``flops = 4 * B * H_q * D * L * L / 2``
(QK^T and PV are 2 * L * L * D multiply-adds each per head; causal keeps half). TFLOP/s = flops / time.
Ratios are time ratios ``peer_ms / cukv_paged_ms``: above 1 means cukv is faster.

Nothing here imports CuPy or PyTorch, or compiles a kernel, at import time, so ``python -m cukv --help`` and the
CPU tests work on a machine without a GPU. The probes' own helpers live in benchmarks/probe_lib.py.
"""
from __future__ import annotations

import os
import time

import numpy as np

from ..device import device_name as _device_name
from ..ops.prefill import causal_flops  # noqa: F401 - the bench's flop count (FLOPS_FORMULA)
from . import peer_torch
from .timing import geomean, interleaved_rounds, write_json

#: (batch, seq_len, num_qo_heads, num_kv_heads, head_dim)
SHAPES = (
    (4, 4096, 32, 8, 128),
    (1, 16384, 32, 8, 128),
    (8, 2048, 32, 32, 128),
    (4, 4096, 16, 16, 256),
    (8, 2048, 32, 8, 64),
)
QUICK_SHAPES = (SHAPES[0], SHAPES[4])
PAGE_SIZE = 16
DTYPE = "bfloat16"
SUPPORTED_KV_DTYPES = ("bfloat16", "fp8_e4m3")
FLOPS_FORMULA = "flops = 4 * B * Hq * D * L * L / 2 (causal half of QK^T and PV)"
PEERS = ("flash", "cudnn")
ENGINES = ("paged", "contig")


def tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None or not ms > 0 else flops / (ms * 1e-3) / 1e12


def check_kv_dtype(kv_dtype: str) -> str:
    """Only bf16 K/V for now (the option exists so FP8 caches can join later)."""
    if kv_dtype not in SUPPORTED_KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r} is not supported by the prefill benchmark yet; "
                         f"accepted: {', '.join(SUPPORTED_KV_DTYPES)}")
    return kv_dtype


def shape_label(r) -> str:
    return f"b{r['batch']} L{r['seq_len']} h{r['num_qo_heads']}/{r['num_kv_heads']} d{r['head_dim']}"


def _bits(rs, shape):
    """Random N(0, 1) values as bf16 bit patterns (uint16), generated on the device."""
    import cupy as cp

    return (rs.standard_normal(shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)


def _as_float(bits):
    import cupy as cp

    return (bits.astype(cp.uint32) << 16).view(cp.float32)


def _maxdiff(a_bits, b_bits) -> float:
    return float(abs(_as_float(a_bits) - _as_float(b_bits)).max())


def _err(e: BaseException) -> str:
    """One line: the exception type and the first line of its message."""
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg.splitlines()[0][:200]}" if msg else type(e).__name__


def _slots(table, seq_len, page_size):
    """Cache slots of every sequence's tokens 0..seq_len-1, row by row of the host page table."""
    pos = np.arange(seq_len)
    return (table[:, pos // page_size] * page_size + pos % page_size).reshape(-1).astype(np.int64)


def _build(batch, seq_len, hq, hkv, d, seed=0, page_size=PAGE_SIZE):
    """Q, K, V (bf16 bits), the paged cache filled by append_kv in random page order, its table, offsets."""
    import cupy as cp

    import cukv

    rs = cp.random.RandomState(seed)
    total = batch * seq_len
    q = _bits(rs, (total, hq, d))
    k = _bits(rs, (total, hkv, d))
    v = _bits(rs, (total, hkv, d))
    pages_per = -(-seq_len // page_size)
    num_pages = batch * pages_per
    cache = cukv.PagedKVCache(num_pages, page_size, hkv, d, dtype=DTYPE)
    table = np.random.default_rng(seed).permutation(num_pages).astype(np.int32).reshape(batch, pages_per)
    cukv.append_kv(cache, k, v, cp.asarray(_slots(table, seq_len, page_size)))
    lengths = np.full(batch, seq_len, np.int32)
    pt = cukv.PageTable(cp.asarray(table), cp.asarray(lengths), page_size)
    offsets = (np.arange(batch + 1) * seq_len).astype(np.int32)
    return q, k, v, cache, pt, offsets, lengths


def _time_cukv(row, engine, timer, reps, warmup, batch, seq_len, hq, hkv, d, data, fns=None):
    """cukv ``engine`` on the shape: its output; timed now, or (``fns`` given) its call added to ``fns`` for
    :func:`_time_interleaved`."""
    import cupy as cp

    import cukv

    q, k, v, cache, pt, offsets, lengths = data
    pf = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE if engine == "paged" else None, dtype=DTYPE)
    pf.plan(offsets, lengths, mask="causal")
    kv = (cache, pt) if engine == "paged" else (k, v, cp.asarray(offsets))
    out = cp.empty_like(q)
    pf.run(q, kv, out=out)
    cp.cuda.Device().synchronize()
    fn = lambda: pf.run(q, kv, out=out)  # noqa: E731
    if fns is not None:
        fns[engine] = fn
    else:
        row[f"{engine}_ms"] = timer.median_ms(fn, reps=reps, warmup=warmup)
    return out


def _time_peers(row, torch, timer, reps, warmup, batch, seq_len, hq, hkv, d, data, ref):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = data[:3]

    def bhld(x, h):  # [B*L, H, D] bf16 bits -> contiguous [B, H, L, D] torch bf16 (a copy)
        return torch.from_dlpack(x).view(torch.bfloat16).reshape(batch, seq_len, h, d).transpose(1, 2).contiguous()

    tq, tk, tv = bhld(q, hq), bhld(k, hkv), bhld(v, hkv)
    kwargs = {"is_causal": True}
    if hq != hkv:
        kwargs["enable_gqa"] = True
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    for name in PEERS:
        try:
            with sdpa_kernel(backends[name]):
                fn = lambda: F.scaled_dot_product_attention(tq, tk, tv, **kwargs)  # noqa: E731
                peer = fn()
                torch.cuda.synchronize()
                row[f"{name}_ms"] = timer.median_ms(fn, reps=reps, warmup=warmup)
            if ref is not None:
                po = peer.transpose(1, 2).reshape(batch * seq_len, hq, d).float()
                ro = torch.from_dlpack(ref).view(torch.bfloat16).float()
                row[f"maxdiff_{name}"] = float((po - ro).abs().max())
            del peer
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this shape is reported, not fatal
            row[f"{name}_ms"] = None
            row[f"{name}_error"] = _err(e)


def _finish_row(row):
    for key in ENGINES + PEERS:
        row.setdefault(f"{key}_ms", None)
        row[f"{key}_tflops"] = tflops(row["flops"], row[f"{key}_ms"])
    base = row["paged_ms"]
    for p in PEERS:
        pm = row[f"{p}_ms"]
        row[f"ratio_{p}"] = pm / base if pm is not None and base else None
    return row


def fp8_cache_like(data, granularity):
    """The K/V of ``_build``'s data quantized by append_kv into an FP8 cache with the same page table."""
    import cupy as cp

    import cukv

    q, k, v, cache, pt, offsets, lengths = data
    fcache = cukv.PagedKVCache(cache.num_pages, cache.page_size, cache.num_kv_heads, cache.head_dim, dtype="fp8_e4m3",
                               scale_granularity=granularity)
    if granularity == "tensor":
        fcache.set_tensor_scales(5.0 / 448, 5.0 / 448)  # N(0,1) data: 5 sigma saturates
    slots = _slots(pt.block_table.get(), int(lengths[0]), cache.page_size)
    cukv.append_kv(fcache, k, v, cp.asarray(slots))
    return fcache


#: FP8 bench: bf16 paged and every FP8 strategy are timed in this many interleaved rounds (cukv.bench.timing), so a
#: slow spell of the GPU lands on a round of each; the bf16/FP8 ratio is also given per round (its spread says how
#: far one call's ratio can be trusted; docs/tuning.md)
FP8_ROUNDS = 5


def _fp8_fns(row, hq, hkv, d, data, granularity, fns):
    """The same K/V quantized by append_kv into an FP8 cache (same page table): every ``fp8_prefill`` strategy
    that can run it, each run once and added to ``fns`` as ``fp8_<strategy>``; ``row['fp8_strategy']`` is the one
    'auto' (the default) takes, and its output is returned."""
    import cupy as cp

    import cukv

    q, k, v, cache, pt, offsets, lengths = data
    fcache = fp8_cache_like(data, granularity)
    out = cp.empty_like(q)
    chosen = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE, kv_dtype="fp8_e4m3",
                               scale_granularity=granularity).plan(offsets, lengths, mask="causal").strategy
    for strategy in ("fused", "dequantize_first", "convert_once"):
        try:
            pf = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE, kv_dtype="fp8_e4m3",
                                   scale_granularity=granularity, fp8_prefill=strategy)
        except ValueError:  # convert_once where its kernel does not fit (d256 with 32- or 64-dim blocks)
            row[f"fp8_{strategy}_ms"] = None
            continue
        pf.plan(offsets, lengths, mask="causal")
        o = out if strategy == chosen else cp.empty_like(q)
        pf.run(q, (fcache, pt), out=o)
        cp.cuda.Device().synchronize()
        fns[f"fp8_{strategy}"] = lambda pf=pf, o=o: pf.run(q, (fcache, pt), out=o)
        if strategy == "fused":
            row["fp8_config"] = pf.config.name
        if strategy == chosen:
            row["fp8_kernel"] = pf.kernel_config.name
    row["fp8_strategy"] = chosen
    return out


def _time_interleaved(row, timer, fns, reps, rounds=FP8_ROUNDS):
    """Time ``fns`` (bf16 ``paged`` and ``fp8_<strategy>``) in ``rounds`` interleaved rounds: each ``<name>_ms`` is
    the median of its round medians, ``fp8_ms`` the strategy 'auto' takes, ``fp8_vs_bf16`` bf16/FP8 of those, and
    ``fp8_vs_bf16_rounds`` the same ratio round by round."""
    got = interleaved_rounds(timer, fns, reps, rounds)
    for name, ms in got.items():
        row[f"{name}_ms"] = float(np.median(ms))
    auto = f"fp8_{row['fp8_strategy']}"
    row["fp8_ms"] = row[f"{auto}_ms"]
    if "paged" in got:
        row["fp8_vs_bf16"] = row["paged_ms"] / row["fp8_ms"]
        row["fp8_vs_bf16_rounds"] = [b / f for b, f in zip(got["paged"], got[auto])]


def run(out_dir: str | None = None, quick: bool = False, reps: int | None = None, kv_dtype: str = "bfloat16",
        shapes=None, scale_granularity="token") -> dict:
    """Time every shape; ``kv_dtype='fp8_e4m3'`` adds cukv paged over an FP8 cache holding the same tokens
    (quantized by append_kv) and its speed ratio against the bf16 cache (> 1: FP8 faster)."""
    check_kv_dtype(kv_dtype)
    import cupy as cp

    from .timing import Timer

    torch, no_torch = peer_torch()
    reps = reps or (5 if quick else 20)
    warmup = 2 if quick else 3
    shapes = tuple(shapes) if shapes is not None else (QUICK_SHAPES if quick else SHAPES)
    timer = Timer()
    rows = []
    for batch, seq_len, hq, hkv, d in shapes:
        row = {"batch": batch, "seq_len": seq_len, "num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": d,
               "flops": causal_flops(batch, seq_len, hq, d)}
        data = _build(batch, seq_len, hq, hkv, d)
        outs = {}
        fp8 = kv_dtype == "fp8_e4m3"
        interleaved = {}  # FP8: bf16 paged and the FP8 strategies, timed together below
        for engine in ENGINES:
            try:
                outs[engine] = _time_cukv(row, engine, timer, reps, warmup, batch, seq_len, hq, hkv, d, data,
                                          fns=interleaved if fp8 and engine == "paged" else None)
            except Exception as e:  # noqa: BLE001 - recorded; the other cells still run
                row[f"{engine}_ms"] = None
                row[f"{engine}_error"] = _err(e)
        if "paged" in outs and "contig" in outs:
            row["maxdiff_paged_contig"] = _maxdiff(outs["paged"], outs["contig"])
        if fp8:
            try:
                fo = _fp8_fns(row, hq, hkv, d, data, scale_granularity, interleaved)
                if "paged" in outs:
                    row["maxdiff_fp8_bf16"] = _maxdiff(fo, outs["paged"])
                _time_interleaved(row, timer, interleaved, FP8_ROUNDS * reps)
            except Exception as e:  # noqa: BLE001
                row["fp8_ms"], row["fp8_error"] = None, _err(e)
                if "paged" in interleaved and row.get("paged_ms") is None:  # bf16 still gets its time
                    row["paged_ms"] = timer.median_ms(interleaved["paged"], reps=reps, warmup=warmup)
        if torch is None:
            for p in PEERS:
                row[f"{p}_ms"], row[f"{p}_error"] = None, no_torch
        else:
            try:
                _time_peers(row, torch, timer, reps, warmup, batch, seq_len, hq, hkv, d, data,
                            outs.get("paged", outs.get("contig")))
            except Exception as e:  # noqa: BLE001 - e.g. the DLPack hand-over itself failed
                for p in PEERS:
                    if f"{p}_ms" not in row:
                        row[f"{p}_ms"], row[f"{p}_error"] = None, _err(e)
            torch.cuda.empty_cache()  # the peers' [B, H, L, D] copies are gone with _time_peers' frame
        rows.append(_finish_row(row))
        del data, outs
        cp.get_default_memory_pool().free_all_blocks()
        print(_fmt_row(row), flush=True)
    summary = {"device": _device_name(), "date": time.strftime("%Y-%m-%d"), "dtype": DTYPE, "kv_dtype": kv_dtype,
               "scale_granularity": scale_granularity if kv_dtype == "fp8_e4m3" else None,
               "page_size": PAGE_SIZE, "mask": "causal", "reps": reps,
               "fp8_rounds": FP8_ROUNDS if kv_dtype == "fp8_e4m3" else None, "flops_formula": FLOPS_FORMULA,
               "torch": getattr(torch, "__version__", None), "peers_missing": no_torch}
    for p in PEERS:
        ratios = [r[f"ratio_{p}"] for r in rows if r[f"ratio_{p}"]]
        if ratios:
            summary[f"geomean_ratio_{p}"] = geomean(ratios)
    result = {"summary": summary, "rows": rows}
    if out_dir:
        # the default granularity keeps the historical file names; others get their own files
        tag = "" if kv_dtype == "bfloat16" else f"_{kv_dtype}" + ("" if scale_granularity == "token" else
                                                                   f"_{scale_granularity}")
        write_json(out_dir, f"bench_prefill{tag}.json", result)
        _plot(rows, summary, os.path.join(out_dir, f"bench_prefill{tag}.png"))
    print(format_table(result))
    return result


def failed(result) -> list[str]:
    """Shapes where a cukv engine raised (peers failing is not a cukv failure)."""
    return [f"{shape_label(r)} {e}: {r[f'{e}_error']}" for r in result["rows"] for e in ENGINES if f"{e}_error" in r]


def _num(x, fmt) -> str:
    return "n/a" if x is None else format(x, fmt)


def _fmt_row(r) -> str:
    s = f"{shape_label(r):<26}"
    for key in ENGINES + PEERS:
        ms = r.get(f"{key}_ms")
        s += f"  {key} " + (f"{ms:8.3f} ms {r[f'{key}_tflops']:6.1f} TF/s" if ms is not None else "n/a")
        if key in PEERS and r.get(f"ratio_{key}") is not None:
            s += f" x{r[f'ratio_{key}']:.2f}"
    return s


def format_table(result) -> str:
    """Markdown table of a result from :func:`run` (missing cells read ``n/a``; reasons listed below)."""
    s = result["summary"]
    lines = [f"prefill {s['dtype']} causal, q_len = kv_len = L, page {s['page_size']} (random page order) on "
             f"{s['device']} ({s['date']}); medians of {s['reps']}; {s['flops_formula']}",
             "| shape | cukv paged ms | TFLOP/s | cukv contig ms | TFLOP/s | flash ms | TFLOP/s | cuDNN ms | TFLOP/s "
             "| flash/cukv | cuDNN/cukv |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in result["rows"]:
        cells = [shape_label(r)]
        for key in ENGINES + PEERS:
            cells += [_num(r.get(f"{key}_ms"), ".3f"), _num(r.get(f"{key}_tflops"), ".1f")]
            if r.get(f"{key}_error"):
                notes.append(f"{shape_label(r)}: {key} n/a: {r[f'{key}_error']}")
        cells += [_num(r.get("ratio_flash"), ".2f"), _num(r.get("ratio_cudnn"), ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    for p, name in (("flash", "flash"), ("cudnn", "cuDNN")):
        if s.get(f"geomean_ratio_{p}") is not None:
            lines.append(f"geomean({name} time / cukv paged time) = {s[f'geomean_ratio_{p}']:.3f}")
    if any("fp8_ms" in r for r in result["rows"]):
        rounds = s.get("fp8_rounds")
        lines += ["", f"FP8 e4m3 cache (scales {s.get('scale_granularity')!r}, same tokens, quantized by append_kv) vs the "
                  "bf16 cache, cukv paged; fp8 ms is the strategy fp8_prefill='auto' takes"
                  + (f"; bf16 and every strategy timed in {rounds} interleaved rounds (medians of the round medians)"
                     if rounds else ""),
                  "| shape | bf16 ms | fp8 ms | bf16/fp8 (>= 1: FP8 no slower) | rounds' bf16/fp8 | strategy | fused ms | "
                  "dequantize_first ms | convert_once ms | max |fp8-bf16| | kernel 'auto' runs |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["rows"]:
            if "fp8_ms" in r:
                per = r.get("fp8_vs_bf16_rounds")
                spread = f"{min(per):.2f}-{max(per):.2f}" if per else "n/a"
                lines.append(f"| {shape_label(r)} | {_num(r.get('paged_ms'), '.3f')} | {_num(r.get('fp8_ms'), '.3f')} | "
                             f"{_num(r.get('fp8_vs_bf16'), '.2f')} | {spread} | {r.get('fp8_strategy', '')} | "
                             f"{_num(r.get('fp8_fused_ms'), '.3f')} | {_num(r.get('fp8_dequantize_first_ms'), '.3f')} | "
                             f"{_num(r.get('fp8_convert_once_ms'), '.3f')} | {_num(r.get('maxdiff_fp8_bf16'), '.3f')} | "
                             f"{r.get('fp8_kernel', r.get('fp8_config', r.get('fp8_error', '')))} |")
    if s.get("peers_missing"):
        lines.append(f"peers: {s['peers_missing']}")
        notes = [n for n in notes if s["peers_missing"] not in n]
    lines += notes
    return "\n".join(lines)


def _plot(rows, summary, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - plots are a convenience
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = np.arange(len(rows))
    series = (("paged", "cukv paged"), ("contig", "cukv contiguous"), ("flash", "SDPA flash"), ("cudnn", "SDPA cuDNN"))
    w = 0.8 / len(series)
    for i, (key, name) in enumerate(series):
        ax.bar(x + (i - (len(series) - 1) / 2) * w, [r.get(f"{key}_tflops") or 0 for r in rows], w, label=name)
    ax.set_xticks(x, [shape_label(r) for r in rows], rotation=20, fontsize=8)
    ax.set_ylabel("TFLOP/s (causal half counted)")
    ax.set_title(f"causal prefill, bf16, page {summary['page_size']}, on {summary['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
