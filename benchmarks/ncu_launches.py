"""cukv launches at one decode cell or prefill shape for Nsight Compute: two warm-up rounds, then the round to
profile. Decode: cukv on bf16 and FP8 caches and, with ``--peers``, the SDPA peers (cuDNN, flash) on the same K/V.
Prefill: cukv paged on the bf16 cache and on the same tokens quantized into an FP8 cache.

    ncu -k regex:cukv_decode --launch-skip 2 --section WarpStateStats python3 benchmarks/ncu_launches.py decode 64x4096
    ncu --section SpeedOfLight python3 benchmarks/ncu_launches.py decode 1x512 --peers
    ncu -k regex:cukv_prefill --launch-skip 4 --launch-count 2 --section WarpStateStats \\
        python3 benchmarks/ncu_launches.py prefill 2x4096x128
    ncu -k regex:"cukv_mla_prefill|Fwd" --launch-skip 2 --launch-count 2 --section SpeedOfLight \\
        python3 benchmarks/ncu_launches.py mla-prefill "h128 2048 x 16K chunk (no mask)" --peers
    ncu -k regex:"cukv_mla_decode|flash" --launch-skip 2 --launch-count 2 --section SpeedOfLight \\
        python3 benchmarks/ncu_launches.py mla-decode "b128 h128 ctx8192" --peers
"""
import argparse

import cupy as cp

import cukv


def decode_fns(args):
    from cukv.bench.decode import _build, _fp8_cache, _peer_fns, _torch

    batch, ctx = map(int, args.cell.split("x"))
    hq, hkv, d, ps = 32, 8, 128, 16
    cache, pt, q, table = _build(batch, ctx, hq, hkv, d, ps)
    fcache = _fp8_cache(batch, ctx, hkv, d, ps, "token")
    out = cp.empty_like(q)
    dec = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16").plan(batch, ctx)
    fdec = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16", kv_dtype="fp8_e4m3", scale_granularity="token").plan(batch, ctx)
    fns = [lambda: dec.run(q, cache, pt, out=out), lambda: fdec.run(q, fcache, pt, out=out)]
    if args.peers and _torch() is not None:
        dec.run(q, cache, pt, out=out)
        fns += list(_peer_fns(_torch(), cache, table, q, out, batch, ctx, hq, d, {}).values())
    return fns


def prefill_fns(args):
    from cukv.bench.prefill import DTYPE, PAGE_SIZE, _build, fp8_cache_like
    from probe_lib import once_variant

    batch, seq_len, d = map(int, args.shape.split("x"))
    hq, hkv = map(int, args.heads.split("/"))
    q, k, v, cache, pt, offsets, lengths = _build(batch, seq_len, hq, hkv, d)
    fcache = fp8_cache_like((q, k, v, cache, pt, offsets, lengths), args.gran)
    out = cp.empty_like(q)
    bf = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE).plan(offsets, lengths, mask="causal")
    fp8_prefill, once_persistent, max_blocks = once_variant(args.strategy)  # "convert_once:np" / ":gN"
    f8 = cukv.BatchPrefill(hq, hkv, d, page_size=PAGE_SIZE, dtype=DTYPE, kv_dtype="fp8_e4m3",
                           scale_granularity=args.gran, fp8_prefill=fp8_prefill, once_persistent=once_persistent,
                           max_blocks=max_blocks).plan(offsets, lengths, mask="causal")
    print("configs:", bf.config.name, f8.config.name, flush=True)
    return [lambda: bf.run(q, (cache, pt), out=out), lambda: f8.run(q, (fcache, pt), out=out)]


def mla_prefill_fns(args):
    """cukv's MLA prefill (its default tile, or ``--config BMxBNxS``) on one bench mla-prefill shape and, with
    ``--peers``, FlashInfer's FA3 ragged prefill on the same tokens (K materialized whole, as the bench does)."""
    import dataclasses

    from cukv.bench.mla_prefill import PAGE, SHAPES, _peers, _problem, _rope_rows
    from cukv.ops.mla_prefill import BatchMLAPrefill

    name, batch, heads, q_len, prefix, mask = next(s for s in SHAPES if s[0] == args.shape)
    q, k_nope, v, cache, table, qo, kl = _problem(batch, heads, q_len, prefix)
    pf = BatchMLAPrefill(heads, PAGE)
    if args.config:
        bm, bn, st = map(int, args.config.split("x"))
        pf = BatchMLAPrefill(heads, PAGE, config=dataclasses.replace(pf.config, BM=bm, BN=bn, stages=st))
    pf.plan(qo, kl, mask=mask)
    print("config:", pf.config.name, flush=True)
    out = cp.empty((q.shape[0], heads, 128), cp.uint16)
    fns = [lambda: pf.run(q, k_nope, v, cache=cache, block_table=table, out=out)]
    torch, fi, why = _peers()
    if args.peers and fi is not None:
        kv_len = q_len + prefix
        rope = _rope_rows(cache, table, kv_len)
        k_full = cp.concatenate([k_nope, cp.broadcast_to(rope[:, None], (rope.shape[0], heads, 64))], axis=2)
        dev = torch.device("cuda")
        w = fi.prefill.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device=dev),
                                                            "NHD", backend="fa3")
        w.plan(torch.tensor(qo, dtype=torch.int32, device=dev), torch.arange(batch + 1, dtype=torch.int32,
               device=dev) * kv_len, heads, heads, head_dim_qk=192, head_dim_vo=128, causal=mask == "causal",
               sm_scale=192 ** -0.5, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        tq, tk, tv = (torch.from_dlpack(x).view(torch.bfloat16) for x in (q, k_full, v))
        fns.append(lambda: w.run(tq, tk, tv))
    elif args.peers:
        print("no FA3 peer:", why, flush=True)
    return fns


def mla_decode_fns(args):
    """cukv's absorbed MLA decode (the policy's config) on one bench mla-decode shape and, with ``--peers``,
    FlashMLA's dense decode on the same cache (its schedule planned outside the profiled launches)."""
    from cukv.bench.mla_decode import PAGE, SHAPES, _flash_mla, _fp8_copy, _lengths, _problem
    from cukv.ops.mla_decode import BatchMLADecode

    name, batch, heads, s_q, ctx = next(s for s in SHAPES if s[0] == args.shape)
    lens = _lengths(batch, ctx)
    cache, table, q = _problem(batch, heads, s_q, lens)
    kw = dict(slice_release=True) if args.slices else {}
    if args.kv_dtype:
        cache = _fp8_copy(cache)
        kw["kv_dtype"] = args.kv_dtype
    dec = BatchMLADecode(heads, **kw).plan(lens, s_q)
    print("config:", dec.config.name, flush=True)
    out = cp.empty((batch, s_q, heads, 512), cp.uint16)
    fns = [lambda: dec.run(q, cache, table, out=out)]
    fm, torch, why = _flash_mla()
    if args.peers and fm is not None and not args.kv_dtype:
        kc = torch.from_dlpack(cache.data).view(torch.bfloat16).view(cache.num_pages, PAGE, 1, 576)
        tq, tt = torch.from_dlpack(q).view(torch.bfloat16), torch.from_dlpack(table)
        tl = torch.from_dlpack(cp.asarray(lens))
        meta, _ = fm.get_mla_metadata()
        call = lambda: fm.flash_mla_with_kvcache(tq, kc, tt, tl, 512, meta, None, 576 ** -0.5,  # noqa: E731
                                                  causal=s_q > 1, use_legacy=True)
        call()  # plans its schedule
        fns.append(call)
    elif args.peers:
        print("no FlashMLA peer:", why, flush=True)
    return fns


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="op", required=True)
    d = sub.add_parser("decode")
    d.add_argument("cell", nargs="?", default="64x4096")
    d.add_argument("--peers", action="store_true")
    p = sub.add_parser("prefill")
    p.add_argument("shape", nargs="?", default="2x4096x128", help="batch x seq_len x head_dim")
    p.add_argument("--heads", default="32/8")
    p.add_argument("--gran", default="token")
    p.add_argument("--strategy", default="auto", help="fp8_prefill of the FP8 plan")
    m = sub.add_parser("mla-prefill")
    m.add_argument("shape", nargs="?", default="h128 2048 x 16K chunk (no mask)", help="a bench mla-prefill shape name")
    m.add_argument("--config", default="", help="BMxBNxSTAGES over the default tile's flags")
    m.add_argument("--peers", action="store_true")
    md = sub.add_parser("mla-decode")
    md.add_argument("shape", nargs="?", default="b128 h128 ctx8192", help="a bench mla-decode shape name")
    md.add_argument("--peers", action="store_true")
    md.add_argument("--kv-dtype", default=None, help="fp8_e4m3: cukv over an FP8 copy of the cache (no peer)")
    md.add_argument("--slices", action="store_true", help="slice_release=True")
    args = ap.parse_args()
    fns = {"decode": decode_fns, "prefill": prefill_fns, "mla-prefill": mla_prefill_fns,
           "mla-decode": mla_decode_fns}[args.op](args)
    for _ in range(3):  # rounds 1-2 warm up, round 3 is the one to profile
        for fn in fns:
            fn()
    cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
