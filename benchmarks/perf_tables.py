"""Write docs/performance.md from the checked-in bench JSON (docs/perf/bench_*.json).

    python3 benchmarks/perf_tables.py [--perf-dir docs/perf] [--out docs/performance.md]

To refresh the page after a GPU run: copy `$OUT/bench_*.json` (and the PNGs) from `make gpu-check OUT=out` into
docs/perf/ under a name that ends in the device (`bench_prefill_h100.json`), then run this script. One table per
JSON file: decode (`bench decode`, bf16 or FP8), prefill (`bench prefill`), FP8 prefill (`--kv-dtype fp8_e4m3`), MLA decode (`bench mla-decode`), MLA prefill (`bench mla-prefill`),
sparse MLA (`bench sparse-mla`).
The script reads nothing but the JSON, so the page always says what the files hold.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _names(v):
    """A bench's cukv kernel name, or its names (one per policy choice over the shapes)."""
    return ", ".join(f"`{x}`" for x in v) if isinstance(v, list) else str(v)


def _f(x, nd=3):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _us(ms):
    return "-" if ms is None else f"{ms * 1e3:.1f}"


def _geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _head(name, s):
    gran = s.get("scale_granularity")
    kind = s.get("kv_dtype", "bfloat16") + (f", scales: {gran}" if gran else "")
    return [f"### `{name}`", "", f"{s['device']}, {s['date']}; cache {kind}.", ""]


def decode_table(name, d):
    s, rows = d["summary"], d["rows"]
    fp8 = "fp8_ms" in rows[0]
    out = _head(name, s)
    flush = {"discard": "a 256 MB write, then its lines discarded from L2",
             "write": "a 256 MB write"}.get(s.get("l2_flush", "write"))
    out.append(f"Read ceiling {s['read_ceiling_tbs']:.2f} TB/s (the fastest streaming kernel). L2 flushed by {flush} "
               "before each call. Ratios are peer time / cukv time (above 1: cukv is faster), bf16 cache.")
    out.append("")
    cols = ["batch x ctx", "splits", "cukv us", "% of ceiling", "cuDNN us", "cuDNN/cukv", "flash/cukv"]
    if fp8:
        cols += ["FP8 us", "FP8 % of ceiling", "bf16/FP8"]
    out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{r['batch']} x {r['ctx']}", str(r.get("splits", "-")), _us(r["cukv_ms"]), _f(r["pct_ceiling"], 1),
                 _us(r.get("cudnn_ms")), _f(r.get("ratio_cudnn"), 2), _f(r.get("ratio_flash"), 2)]
        if fp8:
            cells += [_us(r["fp8_ms"]), _f(r["fp8_pct_ceiling"], 1), _f(r["fp8_speedup"], 2)]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", f"Geomean cuDNN/cukv {_f(s.get('geomean_ratio_cudnn'))}, lowest {_f(s.get('min_ratio_cudnn'))}."]
    if fp8:
        out[-1] += f" Geomean bf16/FP8 {_f(_geomean([r['fp8_speedup'] for r in rows]))}."
    return out


def _shape(r):
    return f"b{r['batch']} L{r['seq_len']} h{r['num_qo_heads']}/{r['num_kv_heads']} d{r['head_dim']}"


def prefill_table(name, d):
    s, rows = d["summary"], d["rows"]
    out = _head(name, s)
    out.append(f"Causal prompts, page {s.get('page_size')}, {s.get('dtype')} queries; "
               f"TFLOP/s by `{s.get('flops_formula', 'flops')}`. Ratios are peer time / cukv time (paged).")
    out.append("")
    cols = ["shape", "paged TFLOP/s", "contiguous TFLOP/s", "cuDNN TFLOP/s", "flash TFLOP/s", "cuDNN/cukv",
            "flash/cukv"]
    out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join([_shape(r), _f(r["paged_tflops"], 0), _f(r["contig_tflops"], 0),
                                      _f(r.get("cudnn_tflops"), 0), _f(r.get("flash_tflops"), 0),
                                      _f(r.get("ratio_cudnn"), 2), _f(r.get("ratio_flash"), 2)]) + " |")
    out += ["", f"Geomean cuDNN/cukv {_f(s.get('geomean_ratio_cudnn'))}, flash/cukv "
                f"{_f(s.get('geomean_ratio_flash'))}."]
    return out


def fp8_prefill_table(name, d):
    s, rows = d["summary"], d["rows"]
    out = _head(name, s)
    out.append(f"The same tokens in a bf16 cache and an FP8 cache, timed in {s.get('fp8_rounds')} interleaved rounds; "
               "bf16/FP8 is the bf16 paged time over the FP8 time (above 1: FP8 is faster), median over rounds. "
               "Milliseconds per strategy; 'auto' picked the one named.")
    out.append("")
    cols = ["shape", "bf16 ms", "fused ms", "dequantize_first ms", "convert_once ms", "auto took", "bf16/FP8",
            "rounds (min-max)"]
    out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        rr = r.get("fp8_vs_bf16_rounds") or []
        spread = f"{min(rr):.2f}-{max(rr):.2f}" if rr else "-"
        out.append("| " + " | ".join([_shape(r), _f(r["paged_ms"]), _f(r.get("fp8_fused_ms")),
                                      _f(r.get("fp8_dequantize_first_ms")), _f(r.get("fp8_convert_once_ms")),
                                      str(r.get("fp8_strategy", "-")), _f(r["fp8_vs_bf16"], 2), spread]) + " |")
    out += ["", f"Geomean bf16/FP8 {_f(_geomean([r['fp8_vs_bf16'] for r in rows]))}."]
    return out


def mla_decode_table(name, d):
    """``bench mla-decode``: cukv beside FlashMLA (same call), plus any extra cukv configs it timed."""
    extra = sorted({k[:-len("_over_cukv")] for r in d["rows"] for k in r if k.endswith("_over_cukv")
                    and k != "flashmla_over_cukv"})
    out = [f"### `{name}`", "", f"{d['device']}, {d.get('date', '2026-11-27')}; {_names(d.get('cukv', 'cukv'))} beside FlashMLA's SM90 "
           f"kernel; read ceiling {_f(d.get('read_ceiling_tbs'), 2)} TB/s "
           "(same call).", "",
           "| shape | cukv ms | TFLOP/s | TB/s | % ceiling | FlashMLA ms | FlashMLA/cukv |"
           + "".join(f" {e} time / cukv |" for e in extra),
           "|---|---|---|---|---|---|---|" + "---|" * len(extra)]
    for r in d["rows"]:
        out.append(f"| {r['shape']} | {_f(r['cukv_ms'])} | {_f(r['cukv_tflops'], 0)} | {_f(r['cukv_tbs'], 2)} | "
                   f"{_f(r['cukv_pct_ceiling'], 0)} | {_f(r.get('flashmla_ms'))} | {_f(r.get('flashmla_over_cukv'), 2)} |"
                   + "".join(f" {_f(1 / r[e + '_over_cukv'] if r.get(e + '_over_cukv') else None, 2)} |" for e in extra))
    g = d.get("geomean_flashmla_over_cukv_h128")
    out += ["", f"Geomean FlashMLA/cukv over the h128 shapes {_f(g)}."
            + "".join(f" Geomean {e}/cukv time {_f(1 / d['geomean_' + e + '_over_cukv'])}." for e in extra
                      if d.get("geomean_" + e + "_over_cukv"))]
    return out


def mla_prefill_table(name, d):
    """``bench mla-prefill``: cukv beside cuDNN and FlashInfer's FA3 kernel (same call)."""
    out = [f"### `{name}`", "", f"{d['device']}, {d.get('date', '2026-11-27')}; {d.get('cukv', 'cukv')} beside cuDNN "
           "(SDPA, K materialized with the broadcast rope; the kernel alone timed) and FlashInfer's ragged FA3 prefill "
           "(same call).", "",
           "| shape | cukv ms | TFLOP/s | cuDNN TFLOP/s | FA3 TFLOP/s | cuDNN/cukv | FA3/cukv |",
           "|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        out.append(f"| {r['shape']} | {_f(r['cukv_ms'])} | {_f(r['cukv_tflops'], 0)} | {_f(r.get('cudnn_tflops'), 0)} | "
                   f"{_f(r.get('flashinfer_tflops'), 0)} | {_f(r.get('cukv_over_cudnn'), 2)} | "
                   f"{_f(r.get('cukv_over_flashinfer'), 2)} |")
    out += ["", f"Geomean cuDNN/cukv {_f(d.get('geomean_cukv_over_cudnn'))}, FA3/cukv "
            f"{_f(d.get('geomean_cukv_over_flashinfer'))} (time ratios; above 1: cukv faster)."]
    return out


def sparse_mla_table(name, d):
    """``bench sparse-mla``: cukv beside FlashMLA's sparse kernels (same call)."""
    out = [f"### `{name}`", "", f"{d['device']}; FlashMLA: {d.get('flashmla', '-')}; FLOPs 2 x tokens x H x topk x "
           "(576 + 512).", "", "| shape | cukv ms | TFLOP/s | FlashMLA ms | FlashMLA TFLOP/s | FlashMLA/cukv |",
           "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        out.append(f"| {r['shape']} | {_f(r['cukv_ms'])} | {_f(r['cukv_tflops'], 0)} | {_f(r.get('flashmla_ms'))} | "
                   f"{_f(r.get('flashmla_tflops'), 0)} | {_f(r.get('flashmla_over_cukv'), 3)} |")
    return out


def table(path):
    name = os.path.basename(path)
    d = json.load(open(path))
    row = d["rows"][0]
    if name.startswith("bench_mla_prefill"):
        return "mlap", mla_prefill_table(name, d)
    if name.startswith("bench_sparse_mla"):
        return "sparse", sparse_mla_table(name, d)
    if "flashmla_over_cukv" in row or name.startswith("bench_mla_decode"):
        return "mla", mla_decode_table(name, d)
    if "ctx" in row:
        return "decode", decode_table(name, d)
    if "fp8_ms" in row:
        return "fp8", fp8_prefill_table(name, d)
    return "prefill", prefill_table(name, d)


INTRO = """# Performance

Generated by `benchmarks/perf_tables.py` from the bench JSON in `docs/perf/` (do not edit by hand; rerun the
script). Each table is one `python -m cukv bench ...` call on the device and date it names; the PNG beside each
JSON file plots it.

How the benches time: every call is preceded by an L2 flush and a spin kernel twice the call's host time, so host
work (argument checks, tensor maps) never counts as GPU time; times are medians. From 2026-11-28 the flush writes 256
MB and then discards those lines from L2, so a timed call no longer pays the write-back of the flush's dirty lines
(9-10 us a call on both GPUs: docs/tuning.md, "L2 flush"); tables of earlier dates were timed after the write alone. Peers are PyTorch SDPA's cuDNN and
flash back ends on the same K/V (contiguous, since SDPA has no paged form), checked against cukv's output.
Compare figures only within one table: the GPU machine may be an H100 or an H200, and a prefill at the power
limit moves a few percent between calls.
"""

SECTIONS = {"decode": "## Decode", "prefill": "## Prefill (16-bit cache)", "fp8": "## Prefill (FP8 e4m3 cache)",
            "mla": "## MLA decode (absorbed, bf16 latent cache)",
            "mlap": "## MLA prefill (non-absorbed, 192/128, bf16, rope from a page-64 cache)",
            "sparse": "## Sparse MLA (top-k prefill and FP8 decode)"}


def render(perf_dir):
    files = sorted(glob.glob(os.path.join(perf_dir, "bench_*.json")))
    if not files:
        raise SystemExit(f"no bench_*.json under {perf_dir}")
    parts = {k: [] for k in SECTIONS}
    for f in files:
        kind, lines = table(f)
        parts[kind] += lines + [""]
    out = [INTRO]
    for k, title in SECTIONS.items():
        if parts[k]:
            out += [title, ""] + parts[k]
    return "\n".join(out).rstrip() + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--perf-dir", default=os.path.join(ROOT, "docs", "perf"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "performance.md"))
    a = ap.parse_args(argv)
    text = render(a.perf_dir)
    with open(a.out, "w") as f:
        f.write(text)
    print(f"wrote {a.out} ({text.count(chr(10))} lines)")


if __name__ == "__main__":
    main()
