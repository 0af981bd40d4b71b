"""``python -m cukv doctor | compile | bench | demo``."""
from __future__ import annotations

import argparse
import os
import sys
import time


def _doctor(args) -> int:
    import platform

    from . import __version__, compiler
    from .device import gpu_capability, sm_count

    print(f"cukv {__version__}   python {platform.python_version()}")
    try:
        import cupy

        print(f"cupy {cupy.__version__}")
    except Exception as e:  # noqa: BLE001
        print(f"cupy: NOT IMPORTABLE ({e})")
        return 1
    try:
        print(f"nvrtc {'.'.join(map(str, compiler.nvrtc_version()))}")
    except Exception as e:  # noqa: BLE001
        print(f"nvrtc: NOT FOUND ({e}); pip install nvidia-cuda-nvrtc")
        return 1
    inc = compiler.cuda_include_dir()
    print(f"cuda headers: {inc or 'NOT FOUND (pip install nvidia-cuda-runtime)'}")
    print(f"templates: {compiler.template_dir()}")
    cc = gpu_capability()
    if cc:
        import cupy as cp

        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        print(f"gpu: {props['name'].decode()} (sm_{cc[0]}{cc[1]}, {sm_count()} SMs, "
              f"{props['totalGlobalMem'] / 2**30:.0f} GiB), driver {cp.cuda.runtime.driverGetVersion()}")
    else:
        print("gpu: none visible (kernels still compile to cubins; running them needs a GPU)")
    print(f"target arch: {compiler.target_arch()}")
    d = compiler.cache_dir()
    n = len(list(d.glob("*.cubin"))) if d.is_dir() else 0
    print(f"cache: {d} ({n} cubins)")
    t = time.perf_counter()
    from .decode import DecodeConfig

    m = DecodeConfig().compiled
    print(f"compile check: {m.name} {'(cache hit)' if m.cache_hit else f'compiled in {m.compile_seconds:.2f} s'} "
          f"in {time.perf_counter() - t:.2f} s")
    return 0


def _compile_one(cfg):
    t = time.perf_counter()
    m = cfg.compiled
    return cfg.name, m, time.perf_counter() - t


def _compile(args) -> int:
    from .specs import select

    cfgs = select(args.filter)
    if not cfgs:
        print(f"no shipped specialization matches {args.filter!r}")
        return 1
    print(f"{'name':<44} {'regs':>4} {'spill':>5} {'stack':>5} {'smem':>6} {'sec':>6}  hit", flush=True)
    bad = 0
    if args.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs) as ex:
            results = ex.map(_compile_one, cfgs)
            bad = _report(results, len(cfgs))
    else:
        bad = _report(map(_compile_one, cfgs), len(cfgs))
    return 1 if bad else 0


def _report(results, total) -> int:
    bad = 0
    for i, (name, m, _sec) in enumerate(results):
        for fn, r in m.functions.items():
            flag = "  SPILLS" if r.spills or r.stack_frame else ""
            bad += bool(flag)
            src = "  (from cubin: no spill counts)" if getattr(r, "source", "ptxas") == "elf" else ""
            print(f"{fn:<44} {r.registers:>4} {r.spills:>5} {r.stack_frame:>5} {r.static_smem:>6} "
                  f"{m.compile_seconds:>6.2f}  {'yes' if m.cache_hit else 'no'}{flag}{src}   [{i + 1}/{total}]",
                  flush=True)
    return bad


def _bench(args) -> int:
    from .device import require_gpu

    if args.what == "prefill":
        from .bench.prefill import check_kv_dtype

        try:
            check_kv_dtype(args.kv_dtype)  # a clear error before anything needs a GPU
        except ValueError as e:
            print(f"cukv bench prefill: {e}", file=sys.stderr)
            return 2
    elif args.kv_dtype != "bfloat16":
        print("cukv bench decode: --kv-dtype applies to `bench prefill` only", file=sys.stderr)
        return 2
    require_gpu("cukv bench")
    if args.what == "decode":
        from .bench.decode import run

        run(out_dir=args.out, quick=args.quick, sweep=args.sweep, **({"reps": args.reps} if args.reps else {}))
    elif args.what == "prefill":
        from .bench.prefill import failed, run

        bad = failed(run(out_dir=args.out, quick=args.quick, reps=args.reps, kv_dtype=args.kv_dtype))
        if bad:
            print("cukv failed on:\n  " + "\n  ".join(bad), file=sys.stderr)
            return 1
    return 0


def _demo(args) -> int:
    import runpy
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "decode_loop.py"
    if not path.is_file():
        print("examples/decode_loop.py is not installed with the wheel; run it from a checkout")
        return 1
    sys.argv = [str(path)]
    runpy.run_path(str(path), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cukv", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("doctor", help="versions, NVRTC, headers, GPU, cache")
    c = sub.add_parser("compile", help="build every shipped specialization and print its resource report")
    c.add_argument("--filter", default=None, help="only names containing this")
    c.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1))
    b = sub.add_parser("bench", help="side-by-side timings against PyTorch SDPA")
    b.add_argument("what", choices=["decode", "prefill"])
    b.add_argument("--out", default=os.environ.get("OUT"), help="directory for JSON and PNG")
    b.add_argument("--quick", action="store_true",
                   help="decode: four cells instead of the full grid; prefill: two shapes, fewer repetitions")
    b.add_argument("--sweep", action="store_true", help="decode: also time other warp/split counts per cell")
    b.add_argument("--reps", type=int, default=None, help="timed calls per cell (decode default 30; prefill 20, quick 5)")
    b.add_argument("--kv-dtype", default="bfloat16",
                   help="prefill: K/V element type (only bfloat16 for now; the option is a placeholder for FP8)")
    sub.add_parser("demo", help="run examples/decode_loop.py")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return {"doctor": _doctor, "compile": _compile, "bench": _bench, "demo": _demo}[args.cmd](args)
