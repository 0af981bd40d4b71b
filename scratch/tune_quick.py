import importlib, sys
import numpy as np, cupy as cp
import cukv
from cukv.bench.timing import Timer
from cukv.dtypes import to_storage
P = importlib.import_module("cukv.prefill")
timer = Timer()
rng = np.random.default_rng(0)
C = {
    64: [(128, 128, 64, 4), (192, 128, 64, 4), (192, 64, 64, 6), (192, 96, 64, 6), (192, 112, 64, 4)],
    128: [(128, 128, 128, 4), (192, 64, 128, 4), (192, 80, 128, 3), (192, 64, 128, 3)],
    256: [(128, 64, 256, 4), (128, 64, 256, 3)],
}
for b, L, hq, hkv, d in [(8, 2048, 32, 8, 64), (8, 2048, 32, 32, 128), (4, 4096, 32, 8, 128), (4, 4096, 16, 16, 256)]:
    flops = 4 * b * hq * d * L * L / 2
    q = cp.asarray(to_storage(rng.standard_normal((b * L, hq, d)).astype(np.float32), "bfloat16"))
    k = cp.asarray(to_storage(rng.standard_normal((b * L, hkv, d)).astype(np.float32), "bfloat16"))
    v = cp.asarray(to_storage(rng.standard_normal((b * L, hkv, d)).astype(np.float32), "bfloat16"))
    qo = np.arange(b + 1, dtype=np.int32) * L
    kl = np.full(b, L, np.int32)
    ps = 16
    npages = b * L // ps
    cache = cukv.PagedKVCache(npages + 4, ps, hkv, d, dtype="bfloat16")
    table = rng.permutation(npages).astype(np.int32).reshape(b, L // ps)
    pos = np.arange(L)
    slots = np.concatenate([table[s, pos // ps].astype(np.int64) * ps + pos % ps for s in range(b)])
    cukv.append_kv(cache, k, v, cp.asarray(slots))
    pt = cukv.PageTable(cp.asarray(table), cp.asarray(kl), ps)
    ref = None
    for bm, bn, bk, st in C[d]:
        row = []
        for page in (16, 0):
            try:
                cfg = P.PrefillConfig("bfloat16", d, page, bm, bn, bk, st)
                rep = cfg.compiled.functions[cfg.name]
                pf = cukv.BatchPrefill(hq, hkv, d, page_size=page or None, config=cfg).plan(qo, kl, mask="causal")
                kv = (cache, pt) if page else (k, v, cp.asarray(qo))
                o = pf.run(q, kv)
                if ref is None:
                    ref = o.copy()
                ok = bool(cp.all(o == ref)) or float(cp.abs(o.view(cp.uint16).astype(cp.int32) - ref.view(cp.uint16).astype(cp.int32)).max()) < 4
                t = timer.median_ms(lambda: pf.run(q, kv), reps=8, warmup=2)
                row.append(f"p{page} {t:.3f}ms {flops / t / 1e9:.0f}TF sp{rep.spill_stores}{'' if ok else ' MISMATCH'}")
            except Exception as e:
                row.append(f"p{page} ERR {str(e)[:80]}")
        print(f"b{b} L{L} h{hq}/{hkv} d{d} cfg {bm},{bn},{bk},{st}: " + " | ".join(row), flush=True)
