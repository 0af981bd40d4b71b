"""``python -m cukv bench sparse-mla``: sparse MLA prefill (bf16 rows, with a sink) and FP8 sparse decode beside
FlashMLA's SM90 sparse kernels (when ``flash_mla`` imports) in the same process, L2 flushed before every call,
CUDA events, medians. FLOPs = ``2 * tokens * H * topk * (576 + 512)``. FlashMLA takes 64 or 128 heads only: 16
and 32 heads are padded to 64 as serving engines do, and the padded time is reported."""
from __future__ import annotations

import time

from ..device import device_name
from .timing import Timer, write_json

# (name, kind, tokens (prefill s_q; decode batch), s_q, heads, topk, s_kv per request)
SHAPES = [("prefill h128 s_kv8K", "prefill", 4096, 1, 128, 2048, 8192),
          ("prefill h128 s_kv32K", "prefill", 4096, 1, 128, 2048, 32768),
          ("prefill h128 s_kv128K", "prefill", 4096, 1, 128, 2048, 131072),
          ("prefill h64 s_kv32K", "prefill", 4096, 1, 64, 2048, 32768),
          ("prefill h32 s_kv32K", "prefill", 4096, 1, 32, 2048, 32768),
          ("prefill h16 s_kv32K", "prefill", 4096, 1, 16, 2048, 32768),
          ("decode fp8 b128 s_q2 h128", "decode", 128, 2, 128, 2048, 32768),
          ("decode fp8 b128 s_q2 h16", "decode", 128, 2, 16, 2048, 32768),
          ("decode fp8 b8 s_q2 h128", "decode", 8, 2, 128, 2048, 32768)]
QUICK = ["prefill h128 s_kv32K", "prefill h16 s_kv32K", "decode fp8 b128 s_q2 h128"]
PAGE = 64


def _flash_mla():
    try:
        import flash_mla
        import torch

        return flash_mla, torch, None
    except Exception as e:  # noqa: BLE001 - the peer is optional
        return None, None, f"flash_mla not importable ({type(e).__name__}: {str(e)[:80]})"


def _bits(rng, shape):
    import cupy as cp

    return (rng.standard_normal(shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)


def _prefill(tokens, heads, topk, s_kv, seed=0):
    """kv[s_kv, 576] bf16 bits, q[tokens, heads, 576], indices[tokens, topk] (distinct rows per token, as an
    indexer's top-k), sink[heads]."""
    import cupy as cp

    rng = cp.random.default_rng(seed)
    kv = _bits(rng, (s_kv, 576))
    q = _bits(rng, (tokens, heads, 576))
    idx = cp.argsort(rng.random((tokens, s_kv), dtype=cp.float32)[:, :max(topk, min(s_kv, 4 * topk))], axis=1)
    idx = idx[:, :topk].astype(cp.int32) if s_kv >= topk else cp.full((tokens, topk), -1, cp.int32)
    if s_kv > 4 * topk:  # spread over the whole context
        idx = (idx.astype(cp.int64) * (s_kv // (4 * topk))).astype(cp.int32)
    sink = rng.standard_normal(heads, dtype=cp.float32)
    return kv, q, idx, sink


def problem(kind: str, n: int, s_q: int, heads: int, topk: int, s_kv: int):
    """One shape's inputs, ``(target, kv_dtype, q, indices, sink)``: prefill over ``s_kv`` contiguous 16-bit rows
    with a sink; decode with each of the ``n`` requests' own ``s_kv``-token context in its own pages of one FP8 cache
    (the same rows in every request's pages: timing data), no sink."""
    import cupy as cp

    from ..mla_cache import MLAKVCache
    from ..ops.mla_append import append_mla

    tokens = n * s_q
    kv, q, idx, sink = _prefill(tokens, heads, topk, s_kv)
    if kind == "prefill":
        return kv, None, q, idx, sink
    pages = s_kv // PAGE
    cache = MLAKVCache(n * pages, PAGE, "fp8_e4m3")
    for b in range(n):
        append_mla(cache, kv[:, :512], kv[:, 512:], cp.arange(b * s_kv, (b + 1) * s_kv, dtype=cp.int64),
                   pow2_scales=True, dtype="bfloat16")
    return cache, "fp8_e4m3", q, idx + (cp.arange(tokens, dtype=cp.int32) // s_q * s_kv)[:, None], None


def run(out_dir: str | None = None, quick: bool = False, reps: int = 20) -> dict:
    import cupy as cp

    from ..ops.sparse_mla import SparseMLA

    timer = Timer()
    fm, torch, why = _flash_mla()
    scale = 576 ** -0.5
    rows = []
    for name, kind, n, s_q, heads, topk, s_kv in SHAPES:
        if quick and name not in QUICK:
            continue
        tokens = n * s_q
        target, kvd, q, idx, sink = problem(kind, n, s_q, heads, topk, s_kv)
        att = SparseMLA(heads, kv_dtype=kvd).plan(tokens, topk)
        out = cp.empty((tokens, heads, 512), cp.uint16)
        lse = cp.empty((tokens, heads), cp.float32)
        mx = cp.empty((tokens, heads), cp.float32)
        fns = {"cukv": lambda: att.run(q, target, idx, sink=sink, out=out, lse=lse, max_logits=mx)}
        note, err = None, None
        if fm is not None:
            try:
                fns["flashmla"], fo, note = _flash_call(fm, torch, kind, q, target, idx, heads, topk, s_q, scale,
                                                       sink, out)
                fns["cukv"]()
                err = float((torch.from_dlpack(out).view(torch.bfloat16).float() - fo).abs().max())
            except Exception as e:  # noqa: BLE001 - report, keep timing cukv
                note = f"FlashMLA failed: {type(e).__name__}: {str(e)[:120]}"
        ms = {k: timer.median_ms(f, reps=reps) for k, f in fns.items()}
        flops = 2.0 * tokens * heads * topk * (576 + 512)
        r = {"shape": name, "heads": heads, "tokens": tokens, "topk": topk, "s_kv": s_kv, "items": att.num_items,
             "parts": att.num_parts, "max_abs_diff_vs_flashmla": err, "flashmla_note": note}
        for k, t in ms.items():
            r[f"{k}_ms"], r[f"{k}_tflops"] = t, flops / (t * 1e-3) / 1e12
        if "flashmla_ms" in r:
            r["flashmla_over_cukv"] = r["flashmla_ms"] / r["cukv_ms"]
        rows.append(r)
        print(_fmt(r), flush=True)
        fns = q = idx = out = lse = mx = target = att = None
        cp.get_default_memory_pool().free_all_blocks()
    result = {"device": device_name(), "date": time.strftime("%Y-%m-%d"),
              "flashmla": why or "imported", "rows": rows}
    if out_dir:
        write_json(out_dir, "bench_sparse_mla.json", result)
    return result


def _flash_call(fm, torch, kind, q, target, idx, heads, topk, s_q, scale, sink, out):
    """FlashMLA's call on the same data (heads padded to 64 below 64), its max |difference| from cukv's output on
    the real heads, and a note."""
    tokens = q.shape[0]
    pad = 64 if heads < 64 else heads
    tq = torch.from_dlpack(q).view(torch.bfloat16)
    if pad != heads:
        tq = torch.cat([tq, torch.zeros(tokens, pad - heads, 576, dtype=torch.bfloat16, device=tq.device)], 1)
    ti = torch.from_dlpack(idx)
    note = f"padded {heads} -> {pad} heads" if pad != heads else None
    if kind == "prefill":
        tkv = torch.from_dlpack(target).view(torch.bfloat16).view(-1, 1, 576)
        kw = {}
        if sink is not None:
            ts = torch.from_dlpack(sink)
            kw["attn_sink"] = torch.cat([ts, torch.zeros(pad - heads, dtype=ts.dtype, device=ts.device)]) \
                if pad != heads else ts
        try:
            call = lambda: fm.flash_mla_sparse_fwd(tq, tkv, ti.view(tokens, 1, topk), scale, 512,  # noqa: E731
                                                   use_legacy=True, **kw)
            fo = call()[0]
        except TypeError:
            note = (note + "; " if note else "") + "no attn_sink argument: timed without the sink"
            call = lambda: fm.flash_mla_sparse_fwd(tq, tkv, ti.view(tokens, 1, topk), scale, 512,  # noqa: E731
                                                   use_legacy=True)
            fo = call()[0]
    else:
        b = tokens // s_q
        tkc = torch.from_dlpack(target.data).view(-1, PAGE, 1, 656).view(torch.float8_e4m3fn)
        meta = fm.get_mla_metadata()[0]
        call = lambda: fm.flash_mla_with_kvcache(tq.view(b, s_q, pad, 576), tkc, None, None, 512, meta,  # noqa: E731
                                                 None, scale, is_fp8_kvcache=True,
                                                 indices=ti.view(b, s_q, topk), use_legacy=True)
        fo = call()[0]
    return call, fo.reshape(tokens, pad, 512)[:, :heads].float(), note


def _fmt(r) -> str:
    s = f"{r['shape']:<28} cukv {r['cukv_ms']:8.3f} ms {r['cukv_tflops']:6.1f} TF/s"
    if "flashmla_ms" in r:
        s += f" | FlashMLA {r['flashmla_ms']:8.3f} ms {r['flashmla_tflops']:6.1f} TF/s | FlashMLA/cukv " \
             f"{r['flashmla_over_cukv']:.3f}"
    if r.get("flashmla_note"):
        s += f" ({r['flashmla_note']})"
    return s
