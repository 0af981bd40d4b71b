"""A/B probe for the absorbed MLA kernels' consumers: times each ``bench mla-decode`` shape (the policy's config)
and each ``bench sparse-mla`` shape in two variants, in interleaved rounds in one process, and prints per shape
the time of each, their ratio (above 1: the second is faster) and the largest output difference. The variants:
``lazy_rescale`` off ("eager") and on ("lazy"); with ``--define NAME`` the policy's config compiled with the
preprocessor define NAME ("define") and without ("default"); with ``--schedule NAME`` the op built with that
``schedule`` ("forced") and with the policy's ("default"); with ``--field NAME=VALUE`` the policy's config with that
field (or comma-separated fields) replaced ("field", e.g. ``prefetch_tiles=1``) and as it is ("default"); with
``--plan NAME=VALUE`` the op planned with that ``BatchMLADecode.plan`` argument ("plan", e.g. ``chunk_tiles=32``:
chunks of that many tiles instead of the plan's choice) and by default ("default"; dense shapes only).

    PYTHONPATH=. python3 benchmarks/probe_mla_rescale.py [--dense b128,h16] [--sparse prefill,decode] [--rounds 5]
    PYTHONPATH=. python3 benchmarks/probe_mla_rescale.py --define CUKV_MLA_EXACT_EXP2
    PYTHONPATH=. python3 benchmarks/probe_mla_rescale.py --schedule split --dense h16 --sparse h16,h32
    PYTHONPATH=. python3 benchmarks/probe_mla_rescale.py --field prefetch_tiles=1 --dense "" --sparse prefill
    PYTHONPATH=. python3 benchmarks/probe_mla_rescale.py --plan chunk_tiles=32 --sparse ""

``--dense`` / ``--sparse`` keep the shapes whose names contain one of the comma-separated words ("" runs none).
"""
from __future__ import annotations

import argparse

import numpy as np
from probe_lib import compiled_with, field_value


def _pick(names, text):
    return [n for n in names if any(w in n for w in text.split(","))] if text else []


def _variants(define, schedule=None, field="", plan=""):
    """(label, config fields to replace, define, schedule or None for the policy's, plan arguments) of the two
    variants, the reference first."""
    if plan:
        name, value = plan.split("=", 1)
        return (("plan", {}, "", None, {name: field_value(value)}), ("default", {}, "", None, {}))
    return tuple(v + ({},) for v in _variants_op(define, schedule, field))


def _variants_op(define, schedule=None, field=""):
    if schedule:
        return (("forced", {}, "", schedule), ("default", {}, "", None))
    if define:
        return (("define", {}, define, None), ("default", {}, "", None))
    if field:
        fields = dict(f.split("=", 1) for f in field.split(","))  # NAME=VALUE[,NAME=VALUE...]
        return (("field", {k: field_value(v) for k, v in fields.items()}, "", None),
                ("default", {}, "", None))
    return (("eager", {"lazy_rescale": False}, "", None), ("lazy", {"lazy_rescale": True}, "", None))


def _report(name, timer, fns, outs, rounds, reps):
    import cupy as cp

    from cukv.bench.timing import interleaved_medians

    med = interleaved_medians(timer, fns, reps=reps, rounds=rounds)
    val = lambda o: (o.astype(cp.uint32) << 16).view(cp.float32)  # noqa: E731 - bf16 bits -> float32
    (a, oa), (b, ob) = outs.items()
    diff = float(cp.abs(val(ob) - val(oa)).max())
    r = med[a] / med[b]
    print(f"{name:<34} {a} {med[a] * 1e3:8.1f} us  {b} {med[b] * 1e3:8.1f} us  {a}/{b} {r:.3f}  "
          f"max|diff| {diff:.2e}", flush=True)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dense", default="b128,b16,b1,skewed")
    ap.add_argument("--sparse", default="prefill,decode")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--define", default="", help="compare the policy's config with and without this define")
    ap.add_argument("--schedule", default="", help="compare the op built with this schedule and with the policy's")
    ap.add_argument("--field", default="", help="compare the policy's config with NAME=VALUE replaced and without")
    ap.add_argument("--plan", default="", help="compare the dense op planned with NAME=VALUE and by default")
    args = ap.parse_args()
    import cupy as cp

    from cukv.bench import mla_decode as bd
    from cukv.bench import sparse_mla as bs
    from cukv.bench.timing import Timer
    from cukv.ops.mla_decode import BatchMLADecode
    from cukv.ops.sparse_mla import SparseMLA

    timer = Timer()
    ratios = {}
    for name, batch, heads, s_q, ctx in bd.SHAPES:
        if name not in _pick([s[0] for s in bd.SHAPES], args.dense):
            continue
        lens = bd._lengths(batch, ctx)
        cache, table, q = bd._problem(batch, heads, s_q, lens)
        fns, outs = {}, {}
        for key, fields, define, sched, plan_kw in _variants(args.define, args.schedule, args.field, args.plan):
            dec = BatchMLADecode(heads, schedule=sched).plan(lens, s_q)  # the policy's config for s_q
            dec.config = compiled_with(dec.config, define, **fields)[0]       # a copy set by hand: plan keeps it
            dec.plan(lens, s_q, **plan_kw)
            outs[key] = cp.empty((batch, s_q, heads, 512), cp.uint16)
            fns[key] = (lambda d=dec, o=outs[key]: d.run(q, cache, table, out=o))
            fns[key]()
        ratios[name] = _report(f"{name} ({dec.config.schedule})", timer, fns, outs, args.rounds, args.reps)
        cache = table = q = fns = outs = None
        cp.get_default_memory_pool().free_all_blocks()
    for name, kind, n, s_q, heads, topk, s_kv in bs.SHAPES:
        if name not in _pick([s[0] for s in bs.SHAPES], args.sparse):
            continue
        tokens = n * s_q
        target, kvd, q, idx, sink = bs.problem(kind, n, s_q, heads, topk, s_kv)
        fns, outs = {}, {}
        for key, fields, define, sched, _ in _variants(args.define, args.schedule, args.field):
            att = SparseMLA(heads, kv_dtype=kvd, schedule=sched)
            att.config = compiled_with(att.config, define, **fields)[0]
            att.plan(tokens, topk)
            outs[key] = cp.empty((tokens, heads, 512), cp.uint16)
            mx = cp.empty((tokens, heads), cp.float32)
            fns[key] = (lambda a=att, o=outs[key], mx=mx: a.run(q, target, idx, sink=sink, out=o, max_logits=mx))
            fns[key]()
        ratios[name] = _report(f"{name} ({att.config.schedule})", timer, fns, outs, args.rounds, args.reps)
        q = idx = target = fns = outs = None
        cp.get_default_memory_pool().free_all_blocks()
    if ratios:
        a, b = (v[0] for v in _variants(args.define, args.schedule, args.field, args.plan))
        print(f"geomean {a}/{b} over {len(ratios)} shapes: {np.exp(np.mean(np.log(list(ratios.values())))):.3f}")


if __name__ == "__main__":
    main()
