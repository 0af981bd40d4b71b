import sys, time
import numpy as np, cupy as cp
import cukv
from cukv.bench.timing import Timer
from cukv.dtypes import to_storage

shapes = [(4, 4096, 32, 8, 128), (8, 2048, 32, 8, 64), (4, 4096, 16, 16, 256), (8, 2048, 32, 32, 128)]
if len(sys.argv) > 1:
    shapes = shapes[: int(sys.argv[1])]
timer = Timer()
import torch
from torch.nn.attention import sdpa_kernel, SDPBackend
rng = np.random.default_rng(0)
for b, L, hq, hkv, d in shapes:
    flops = 4 * b * hq * d * L * L / 2
    q = cp.asarray(to_storage(rng.standard_normal((b * L, hq, d)).astype(np.float32), "bfloat16"))
    k = cp.asarray(to_storage(rng.standard_normal((b * L, hkv, d)).astype(np.float32), "bfloat16"))
    v = cp.asarray(to_storage(rng.standard_normal((b * L, hkv, d)).astype(np.float32), "bfloat16"))
    qo = np.arange(b + 1, dtype=np.int32) * L
    kl = np.full(b, L, np.int32)
    res = {}
    pf = cukv.BatchPrefill(hq, hkv, d, page_size=None).plan(qo, kl, mask="causal")
    kv = (k, v, cp.asarray(qo))
    res["contig"] = timer.median_ms(lambda: pf.run(q, kv), reps=10)
    # paged
    ps = 16
    npages = b * L // ps
    cache = cukv.PagedKVCache(npages + 4, ps, hkv, d, dtype="bfloat16")
    ids = rng.permutation(npages).astype(np.int32)
    table = ids.reshape(b, L // ps)
    pos = np.arange(L)
    slots = np.concatenate([table[s, pos // ps].astype(np.int64) * ps + pos % ps for s in range(b)])
    cukv.append_kv(cache, k, v, cp.asarray(slots))
    pt = cukv.PageTable(cp.asarray(table), cp.asarray(kl), ps)
    pfp = cukv.BatchPrefill(hq, hkv, d, page_size=ps).plan(qo, kl, mask="causal")
    res["paged"] = timer.median_ms(lambda: pfp.run(q, (cache, pt)), reps=10)
    tq = torch.from_dlpack(q).view(torch.bfloat16).view(b, L, hq, d).transpose(1, 2).contiguous()
    tk = torch.from_dlpack(k).view(torch.bfloat16).view(b, L, hkv, d).transpose(1, 2).contiguous()
    tv = torch.from_dlpack(v).view(torch.bfloat16).view(b, L, hkv, d).transpose(1, 2).contiguous()
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(be):
                fn = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=hq != hkv)
                fn()
                res[name] = timer.median_ms(fn, reps=10)
        except Exception as e:
            res[name] = float("nan"); print(name, "failed", str(e)[:200])
    # check vs torch math on a slice for sanity
    o = pf.run(q, kv)
    ot = torch.from_dlpack(o).view(torch.bfloat16).view(b, L, hq, d).transpose(1, 2)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION if d <= 256 else SDPBackend.MATH):
        ref = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=hq != hkv)
    err = (ot.float() - ref.float()).abs().max().item()
    line = f"b{b} L{L} h{hq}/{hkv} d{d}: " + "  ".join(f"{n} {t:.3f}ms {flops / t / 1e9:.0f}TF" for n, t in res.items())
    line += f"  flash/paged {res['flash'] / res['paged']:.2f} cudnn/paged {res['cudnn'] / res['paged']:.2f}  maxdiff-vs-flash {err:.3g}"
    print(line, flush=True)
