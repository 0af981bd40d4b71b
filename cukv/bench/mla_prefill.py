"""``python -m cukv bench mla-prefill``: non-absorbed MLA prefill (bf16, causal; k_rope from a page-64 MLA cache)
beside, in the same process, cuDNN through ``torch.nn.functional.scaled_dot_product_attention`` (which needs K
materialized as ``[k_nope | k_rope broadcast]``: the kernel alone is timed, not the copy) and FlashInfer's ragged
FA3 prefill (``head_dim_qk=192, head_dim_vo=128``) when ``flashinfer`` imports (../shared/peers/README.md: source
``.peers/activate.sh`` first). L2 flushed before every call, CUDA events; cukv and the peers in interleaved rounds,
median of the round medians. TFLOP/s count ``B*H*Sq*Sk*(192+128)*2`` over the (query, key) pairs the mask keeps
(:func:`cukv.ops.mla_prefill.mla_prefill_flops`).

Shapes ``BxHxS`` (batch, heads, new tokens): 1x128x8192, 4x128x2048, 1x32x8192, 1x16x16384, 4x16x4096 causal; 2048
new tokens over a 16K cached prefix at h128 in one shot (causal), and the same as a non-causal context chunk."""
from __future__ import annotations

import time

import numpy as np

from ..device import device_name
from .timing import Timer, geomean, interleaved_medians, write_json

PAGE = 64
# (name, batch, heads, new tokens, cached prefix, mask)
SHAPES = [("1x128x8192", 1, 128, 8192, 0, "causal"), ("4x128x2048", 4, 128, 2048, 0, "causal"),
          ("1x32x8192", 1, 32, 8192, 0, "causal"), ("1x16x16384", 1, 16, 16384, 0, "causal"),
          ("4x16x4096", 4, 16, 4096, 0, "causal"), ("h128 2048 over 16K (one shot)", 1, 128, 2048, 16384, "causal"),
          ("h128 2048 x 16K chunk (no mask)", 1, 128, 2048, 16384, "none")]
QUICK = ["4x16x4096", "h128 2048 over 16K (one shot)"]
PEERS = ("cudnn", "flashinfer")


def _bf16(rng, shape):
    import cupy as cp

    return (rng.standard_normal(shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)


def _problem(batch, heads, q_len, prefix, seed=0):
    """Device operands of one shape: q, k_nope, v (bf16 bits), a page-64 cache holding every key's rope part in
    shuffled pages, its table and the plan's offsets."""
    import cupy as cp

    from ..mla_cache import MLAKVCache

    rng = cp.random.default_rng(seed)
    kv_len = q_len + prefix
    q = _bf16(rng, (batch * q_len, heads, 192))
    k_nope, v = _bf16(rng, (batch * kv_len, heads, 128)), _bf16(rng, (batch * kv_len, heads, 128))
    pages = -(-kv_len // PAGE)
    cache = MLAKVCache(batch * pages, PAGE, "bfloat16")
    cache.data[...] = _bf16(rng, cache.data.shape)
    perm = np.random.default_rng(seed).permutation(batch * pages).astype(np.int32)
    table = cp.asarray(perm.reshape(batch, pages))
    qo = np.arange(batch + 1) * q_len
    kl = np.full(batch, kv_len)
    return q, k_nope, v, cache, table, qo, kl


def _rope_rows(cache, table, kv_len):
    """k_rope[B * kv_len, 64] gathered from the cache (for the peers, which take K whole)."""
    import cupy as cp

    pos = cp.arange(kv_len)
    rows = cache.data[table[:, pos // PAGE], pos % PAGE, 512:]  # [B, kv_len, 64]
    return rows.reshape(-1, 64)


def _peers():
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - the peers are optional
        return None, None, f"torch not importable ({type(e).__name__})"
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001
        return torch, None, f"flashinfer not importable ({type(e).__name__}: {str(e)[:80]})"
    return torch, flashinfer, None


def _cudnn_fn(torch, q, k_full, v, batch, heads, q_len, kv_len, mask):
    """cuDNN SDPA on [B, H, L, D] copies (K materialized with the broadcast rope): ``(fn, output [T, H, 128])``."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def bhld(x, n, d):
        return torch.from_dlpack(x).view(torch.bfloat16).reshape(batch, n, heads, d).transpose(1, 2).contiguous()

    tq, tk, tv = bhld(q, q_len, 192), bhld(k_full, kv_len, 192), bhld(v, kv_len, 128)
    kw = {"scale": 192 ** -0.5}
    if mask == "causal":
        if q_len == kv_len:
            kw["is_causal"] = True
        else:  # bottom-right: query i sees keys <= kv_len - q_len + i
            i = torch.arange(q_len, device=tq.device)[:, None]
            kw["attn_mask"] = torch.arange(kv_len, device=tq.device)[None, :] <= kv_len - q_len + i

    def fn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(tq, tk, tv, **kw)

    out = fn()
    torch.cuda.synchronize()
    return fn, out.transpose(1, 2).reshape(batch * q_len, heads, 128)


def _flashinfer_fn(torch, fi, q, k_full, v, batch, heads, q_len, kv_len, mask):
    """FlashInfer's ragged FA3 prefill on the same tokens: ``(fn, output [T, H, 128])``."""
    dev = torch.device("cuda")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    w = fi.prefill.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
    qo = torch.arange(batch + 1, dtype=torch.int32, device=dev) * q_len
    ko = torch.arange(batch + 1, dtype=torch.int32, device=dev) * kv_len
    w.plan(qo, ko, heads, heads, head_dim_qk=192, head_dim_vo=128, causal=mask == "causal", sm_scale=192 ** -0.5,
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    tq, tk, tv = (torch.from_dlpack(x).view(torch.bfloat16) for x in (q, k_full, v))
    fn = lambda: w.run(tq, tk, tv)  # noqa: E731
    out = fn()
    torch.cuda.synchronize()
    return fn, out


def run(out_dir: str | None = None, quick: bool = False, reps: int = 20, rounds: int = 3) -> dict:
    """Time every shape (``quick``: two); returns and (with ``out_dir``) writes ``bench_mla_prefill.json``. Each shape
    times cukv and the peers in ``rounds`` interleaved rounds of ``reps`` calls in all."""
    import cupy as cp

    from ..ops.mla_prefill import BatchMLAPrefill, mla_prefill_flops

    timer = Timer()
    torch, fi, why = _peers()
    rows = []
    for name, batch, heads, q_len, prefix, mask in SHAPES:
        if quick and name not in QUICK:
            continue
        kv_len = q_len + prefix
        q, k_nope, v, cache, table, qo, kl = _problem(batch, heads, q_len, prefix)
        pf = BatchMLAPrefill(heads, PAGE).plan(qo, kl, mask=mask)
        out = cp.empty((q.shape[0], heads, 128), cp.uint16)
        fn = lambda: pf.run(q, k_nope, v, cache=cache, block_table=table, out=out)  # noqa: E731
        fn()
        cp.cuda.Device().synchronize()
        r = {"shape": name, "batch": batch, "heads": heads, "q_len": q_len, "kv_len": kv_len, "mask": mask,
             "config": pf.config.name}
        fns = {"cukv": fn}
        if torch is not None:
            mine = torch.from_dlpack(out).view(torch.bfloat16).float()
            rope = _rope_rows(cache, table, kv_len)
            k_full = cp.concatenate([k_nope, cp.broadcast_to(rope[:, None], (rope.shape[0], heads, 64))], axis=2)
            for peer, make in (("cudnn", _cudnn_fn), ("flashinfer", _flashinfer_fn if fi else None)):
                if make is None:
                    continue
                try:
                    args = (torch, fi) if peer == "flashinfer" else (torch,)
                    fns[peer], po = make(*args, q, k_full, v, batch, heads, q_len, kv_len, mask)
                    r[f"{peer}_max_abs_diff"] = float((po.float() - mine).abs().max())
                except Exception as e:  # noqa: BLE001 - a peer that cannot run a shape is reported, not fatal
                    r[f"{peer}_ms"], r[f"{peer}_error"] = None, f"{type(e).__name__}: {str(e)[:120]}"
            rope = None
        # cukv and the peers in interleaved rounds (median of the round medians): a slow spell of the machine
        # lands on every side, not on one
        for k, ms in interleaved_medians(timer, fns, reps, rounds).items():
            r[f"{k}_ms"] = ms
        fns = k_full = None
        flops = mla_prefill_flops(batch, q_len, kv_len, heads, causal=mask == "causal")
        for k in ("cukv",) + PEERS:
            if r.get(f"{k}_ms"):
                r[f"{k}_tflops"] = flops / (r[f"{k}_ms"] * 1e-3) / 1e12
                if k != "cukv":
                    r[f"cukv_over_{k}"] = r[f"{k}_ms"] / r["cukv_ms"]  # above 1: cukv is faster
        rows.append(r)
        print(_fmt(r), flush=True)
        q = k_nope = v = cache = table = out = pf = fn = mine = None  # free this shape's buffers
        cp.get_default_memory_pool().free_all_blocks()
    from ..policy.mla_prefill import default_config

    result = {"device": device_name(), "peers": why or "imported",
              "date": time.strftime("%Y-%m-%d"), "rows": rows,
              "cukv": [default_config("bfloat16", PAGE, w).name for w in (False, True)]}
    for peer in PEERS:
        ratios = [r[f"cukv_over_{peer}"] for r in rows if f"cukv_over_{peer}" in r]
        if ratios:
            result[f"geomean_cukv_over_{peer}"] = geomean(ratios)
            result[f"min_cukv_over_{peer}"] = float(min(ratios))
    print(format_table(result))
    if out_dir:
        write_json(out_dir, "bench_mla_prefill.json", result)
    return result


def _fmt(r) -> str:
    s = f"{r['shape']:<34} cukv {r['cukv_ms']:8.3f} ms {r['cukv_tflops']:6.1f} TF/s"
    for peer in PEERS:
        if r.get(f"{peer}_ms"):
            s += (f" | {peer} {r[f'{peer}_ms']:8.3f} ms {r[f'{peer}_tflops']:6.1f} TF/s "
                  f"(peer/cukv {r[f'cukv_over_{peer}']:.3f}, diff {r[f'{peer}_max_abs_diff']:.1e})")
        elif f"{peer}_error" in r:
            s += f" | {peer} failed: {r[f'{peer}_error']}"
    return s


def format_table(result) -> str:
    lines = [f"{result['device']}; peers: {result['peers']}"] + [_fmt(r) for r in result["rows"]]
    for k, v in result.items():
        if k.startswith(("geomean_", "min_")):
            lines.append(f"{k}: {v:.3f} (above 1: cukv faster)")
    return "\n".join(lines)
