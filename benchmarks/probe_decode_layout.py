"""Does the page layout bound paged decode? Times ``BatchDecode`` (its default: the tensor-copy ring) over the same K/V
in two page layouts, in one process with interleaved rounds and an L2 flush before every call:

* ``nhd``: cukv's own ``[pages, page_size, heads, dim]`` (a KV head's 16 rows of a page lie 256 bytes apart every
  heads x 256 bytes), the layout ``bench decode`` times;
* ``hnd``: head-major pages ``[pages, heads, page_size, dim]`` (FlashInfer's HND; a KV head's rows of a page are one
  contiguous run), wrapped through ``PagedKVCache.from_arrays`` as a strided view, no kernel change.

If ``hnd`` reads measurably faster, the cuDNN gap of issue 55 (cuDNN streams a contiguous copy) is DRAM locality of
the page layout, not the kernel (docs/history/decode.md, "Tensor copies and the cuDNN gap"). Prints one line per cell
(us, TB/s, % of the read ceiling, nhd/hnd) and checks the two outputs are bitwise equal.

    PYTHONPATH=. python3 benchmarks/probe_decode_layout.py --cells 64x4096,16x32768,128x8192
"""
import argparse

import cupy as cp

import cukv
from cukv.bench.decode import _build
from cukv.bench.timing import Timer, geomean, interleaved_medians, read_ceiling


def head_major(cache):
    """The same K/V values in head-major pages, seen as ``[pages, page_size, heads, dim]`` views."""
    views = []
    for a in (cache.k, cache.v):
        hnd = cp.ascontiguousarray(a.transpose(0, 2, 1, 3))  # [pages, heads, page_size, dim]
        views.append(hnd.transpose(0, 2, 1, 3))  # strides: page, dim (token), page_size * dim (head), 1
    return cukv.PagedKVCache.from_arrays(*views)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="64x4096,16x32768,128x8192", help="batch x ctx, comma-separated")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    hq, hkv, d, ps = 32, 8, 128, args.page_size
    timer = Timer()
    ceiling = read_ceiling(timer)[0]
    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    print(f"# {dev}; read ceiling {ceiling:.2f} TB/s; page {ps}", flush=True)
    ratios = []
    for cell in args.cells.split(","):
        batch, ctx = map(int, cell.split("x"))
        cache, pt, q, _ = _build(batch, ctx, hq, hkv, d, ps)
        caches = {"nhd": cache, "hnd": head_major(cache)}
        nbytes = 2 * batch * ctx * hkv * d * 2
        fns, outs, names = {}, {}, {}
        for key, c in caches.items():
            dec = cukv.BatchDecode(hq, hkv, d, ps, "bfloat16").plan(batch, ctx)
            out = outs[key] = cp.full_like(q, 0x7FC0)  # NaN bits: every row must be written
            fns[key] = (lambda dec=dec, out=out, c=c: dec.run(q, c, pt, out=out))
            fns[key]()
            names[key] = f"{dec.config.name} s{dec.num_splits}"
        cp.cuda.Device().synchronize()
        med = interleaved_medians(timer, fns, reps=args.reps, rounds=args.rounds)
        tbs = {k: nbytes / (m * 1e-3) / 1e12 for k, m in med.items()}
        r = med["nhd"] / med["hnd"]
        ratios.append(r)
        print(f"{cell:>11}  {names['nhd']}: nhd {med['nhd'] * 1e3:8.1f} us {tbs['nhd']:.2f} TB/s "
              f"({100 * tbs['nhd'] / ceiling:.1f}%)  hnd {med['hnd'] * 1e3:8.1f} us {tbs['hnd']:.2f} TB/s "
              f"({100 * tbs['hnd'] / ceiling:.1f}%)  nhd/hnd {r:.3f}  bitwise {bool(cp.array_equal(outs['nhd'], outs['hnd']))}",
              flush=True)
        caches = cache = fns = outs = None
        cp.get_default_memory_pool().free_all_blocks()
    print(f"geomean nhd/hnd time over {len(ratios)} cells: {geomean(ratios):.3f}")


if __name__ == "__main__":
    main()
