"""A run's fixed cost in the absorbed MLA decode: each shape timed as the op runs it, without the combine launch, and
with the grid cut to the work items (no blocks that return at once), beside FlashMLA when it imports (its time
includes its own combine kernel). Contexts from one tile to 128 tiles per item at b128 h128 show what a block costs
besides its tiles.

    PYTHONPATH=. python3 benchmarks/probe_mla_overhead.py [--shapes 128x128x64,128x128x4096] [--bench s_q2,skewed]

(``source .peers/activate.sh .peers`` first for FlashMLA.) ``--shapes``: ``BxHxCTX`` (s_q 1); ``--bench``: the ``bench
mla-decode`` shapes whose names contain one of the words. To compare two source trees, run it once with each on
``PYTHONPATH`` in the same device call (the kernel cache keys on the source, so the two never mix).
"""
from __future__ import annotations

import argparse

DEFAULT = "128x128x64,128x128x512,128x128x2048,128x128x4096,128x128x8192,128x16x8192,1x128x32768"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=DEFAULT)
    ap.add_argument("--bench", default="", help="bench mla-decode shapes whose names contain one of these words")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    import cupy as cp

    from cukv.bench import mla_decode as bd
    from cukv.bench.timing import Timer, interleaved_medians
    from cukv.ops.mla_decode import BatchMLADecode

    timer = Timer()
    fm, torch, _ = bd._flash_mla()
    shapes = [(f"b{b} h{h} ctx{c}", b, h, 1, c) for b, h, c in
              (tuple(int(x) for x in t.split("x")) for t in args.shapes.split(",") if t)]
    words = [w for w in args.bench.split(",") if w]
    shapes += [s for s in bd.SHAPES if any(w in s[0] for w in words)]
    for name, batch, heads, s_q, ctx in shapes:
        lens = bd._lengths(batch, ctx)
        cache, table, q = bd._problem(batch, heads, s_q, lens)
        full, cut = (BatchMLADecode(heads).plan(lens, s_q) for _ in range(2))
        out = cp.empty((batch, s_q, heads, 512), cp.uint16)
        combine, cap = cut._combine, cut._grid

        def without(grid):
            cut._combine, cut._grid = (lambda *a, **k: None), grid
            cut.run(q, cache, table, out=out)
            cut._combine, cut._grid = combine, cap

        fns = {"run": lambda: full.run(q, cache, table, out=out), "no_combine": lambda: without(cap),
               "no_combine_items": lambda: without(cut.num_items + cut.num_items % 2)}
        if fm is not None:
            kc = torch.from_dlpack(cache.data).view(torch.bfloat16).view(cache.num_pages, bd.PAGE, 1, 576)
            tq, tt = torch.from_dlpack(q).view(torch.bfloat16), torch.from_dlpack(table)
            tl = torch.from_dlpack(cp.asarray(lens))
            meta, _ = fm.get_mla_metadata()
            fns["flashmla"] = lambda: fm.flash_mla_with_kvcache(tq, kc, tt, tl, 512, meta, None, 576 ** -0.5,
                                                                causal=s_q > 1, use_legacy=True)
            fns["flashmla"]()
        med = interleaved_medians(timer, fns, reps=args.reps, rounds=args.rounds)
        print(f"{name:<30} items {full.num_items:4d} grid {cap:4d} chunk {full.chunk_tiles:4d} "
              + " ".join(f"{k} {v * 1e3:7.1f} us" for k, v in med.items()), flush=True)
        cache = table = q = out = full = cut = fns = None
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
