"""``python -m cukv doctor | compile | bench | autotune | demo``."""
from __future__ import annotations

import argparse
import os
import sys
import time


def _doctor(args) -> int:
    import platform

    from . import __version__, compiler

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
    from .device import gpus

    found = gpus()
    for g in found:
        print(f"gpu {g.id}: {g.name} (sm_{g.capability[0]}{g.capability[1]}, {g.sm_count} SMs, "
              f"{g.memory_gib:.0f} GiB)")
    if found:
        import cupy as cp

        print(f"driver {cp.cuda.runtime.driverGetVersion()}, current device {cp.cuda.runtime.getDevice()}")
    else:
        print("gpu: none visible (kernels still compile to cubins; running them needs a GPU)")
    print(f"target arch: {compiler.target_arch()}")
    try:
        defs = compiler.resolve_defines()
        print(f"CUKV_DEFINES: {' '.join(defs) if defs else '(none)'}")
    except (ValueError, TypeError) as e:
        print(f"CUKV_DEFINES: INVALID ({e})")
        return 1
    d = compiler.cache_dir()
    n = len(list(d.glob("*.cubin"))) if d.is_dir() else 0
    print(f"cache: {d} ({n} cubins)")
    t = time.perf_counter()
    from .policy.decode import decode_config

    m = decode_config().compiled
    how = "from the cache" if m.cache_hit else f"NVRTC {m.compile_seconds:.2f} s"
    print(f"compile check: {m.name} ready in {time.perf_counter() - t:.2f} s ({how})")
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


def _granularity(text: str):
    return int(text) if str(text).isdigit() else text


def _bench(args) -> int:
    from .device import require_gpu

    if args.what == "mla-decode":
        from .bench.mla_decode import parse_mla_configs, run as run_mla

        try:
            cfgs = parse_mla_configs(args.mla_configs)  # a clear error before anything needs a GPU
        except ValueError as e:
            print(f"cukv bench mla-decode: {e}", file=sys.stderr)
            return 2
        require_gpu("cukv bench")
        run_mla(out_dir=args.out, quick=args.quick, configs=cfgs, fp8=args.kv_dtype == "fp8_e4m3",
                **({"reps": args.reps} if args.reps else {}))
        return 0
    if args.what == "sparse-mla":
        from .bench.sparse_mla import run as run_sparse

        require_gpu("cukv bench")
        run_sparse(out_dir=args.out, quick=args.quick, **({"reps": args.reps} if args.reps else {}))
        return 0
    if args.what == "mla-prefill":
        from .bench.mla_prefill import run as run_mla_prefill

        require_gpu("cukv bench")
        run_mla_prefill(out_dir=args.out, quick=args.quick, **({"reps": args.reps} if args.reps else {}))
        return 0
    if args.what == "prefill":
        from .bench.prefill import check_kv_dtype

        try:
            check_kv_dtype(args.kv_dtype)  # a clear error before anything needs a GPU
        except ValueError as e:
            print(f"cukv bench prefill: {e}", file=sys.stderr)
            return 2
    elif args.kv_dtype not in ("bfloat16", "fp8_e4m3"):
        print(f"cukv bench decode: --kv-dtype {args.kv_dtype!r} is not valid; accepted: bfloat16, fp8_e4m3", file=sys.stderr)
        return 2
    require_gpu("cukv bench")
    if args.what == "decode":
        from .bench.decode import run

        run(out_dir=args.out, quick=args.quick, sweep=args.sweep, kv_dtype=args.kv_dtype,
            scale_granularity=_granularity(args.scale_granularity), **({"reps": args.reps} if args.reps else {}))
    elif args.what == "prefill":
        from .bench.prefill import failed, run

        bad = failed(run(out_dir=args.out, quick=args.quick, reps=args.reps, kv_dtype=args.kv_dtype,
                         scale_granularity=_granularity(args.scale_granularity)))
        if bad:
            print("cukv failed on:\n  " + "\n  ".join(bad), file=sys.stderr)
            return 1
    return 0


def _autotune(args) -> int:
    from . import autotune
    from .errors import NoGPUError

    if args.what == "defaults":
        print(autotune.defaults_table())
        return 0
    if args.what == "show":
        path = autotune.autotune_path()
        recs = autotune.load_records(path)
        state = "" if autotune.enabled() else f"  ({autotune.ENV}=0: lookups are off)"
        print(f"{path}: {len(recs)} record(s){state}")
        for key, r in recs.items():
            c = r.get("config", {}) if isinstance(r, dict) else {}
            ms, tf = (r.get("ms"), r.get("tflops")) if isinstance(r, dict) else (None, None)
            print(f"  {key}: " + " ".join(f"{f}={c.get(f)}" for f in autotune.FIELDS)
                  + (f"  {ms:.3f} ms" if isinstance(ms, (int, float)) else "")
                  + (f"  {tf:.1f} TFLOP/s" if isinstance(tf, (int, float)) else ""))
        return 0
    if args.head_dim is None:
        print("cukv autotune prefill: --head-dim is required", file=sys.stderr)
        return 2
    from .policy.prefill import DEFAULTS

    if args.head_dim not in DEFAULTS:
        print(f"cukv autotune prefill: --head-dim {args.head_dim} is not supported; accepted: "
              f"{', '.join(map(str, sorted(DEFAULTS)))}", file=sys.stderr)
        return 2
    if autotune.tuned.device_name() is None:
        print("cukv autotune: timing needs a CUDA GPU and this process sees none (see `python -m cukv doctor`)",
              file=sys.stderr)
        return 2
    seq_len = args.seq_len or (2048 if args.quick else 4096)
    reps = args.reps or (5 if args.quick else 10)
    kind = f"page {args.page_size}" if args.page_size else "contiguous K/V"
    print(f"autotune prefill: {args.dtype} d{args.head_dim} {kind}; causal, {args.batch} x {seq_len} tokens, "
          f"{args.num_qo_heads}/{args.num_kv_heads} heads; median of {reps}", flush=True)
    print(f"{'BM':>4} {'BN':>4} {'BK':>4} {'st':>3} {'thr':>4} {'smem':>7} {'regs':>5} {'ms':>9} {'TFLOP/s':>8}  status",
          flush=True)
    rows = []

    def show(r):
        rows.append(r)
        c = r.config
        if not hasattr(c, "BM"):
            print(f"{str(c):>36}  invalid: {r.detail}", flush=True)
            return
        ms = f"{r.ms:9.3f}" if r.ms is not None else f"{'-':>9}"
        tf = f"{r.tflops:8.1f}" if r.tflops is not None else f"{'-':>8}"
        regs = f"{r.registers:>5}" if r.registers is not None else f"{'?':>5}"
        note = r.status + (" (default)" if r.is_default else "") + (f": {r.detail}" if r.detail else "")
        print(f"{c.BM:>4} {c.BN:>4} {c.BK:>4} {c.stages:>3} {c.num_threads:>4} {c.smem_bytes:>7} {regs} {ms} {tf}  "
              f"{note}", flush=True)

    try:
        best = autotune.tune_prefill(args.dtype, args.head_dim, args.page_size, num_qo_heads=args.num_qo_heads,
                                     num_kv_heads=args.num_kv_heads, seq_len=seq_len, batch=args.batch, reps=reps,
                                     quick=args.quick, jobs=args.jobs, persist=not args.no_save, on_result=show)
    except NoGPUError as e:
        print(f"cukv autotune: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"cukv autotune: {e}", file=sys.stderr)
        return 1
    win = next(r for r in rows if r.ok and r.config == best)
    base = next((r for r in rows if r.ok and r.is_default), None)
    vs = f"; default {base.ms:.3f} ms, {base.ms / win.ms:.2f}x" if base is not None and win.ms else ""
    print(f"winner: {best.name}  BM={best.BM} BN={best.BN} BK={best.BK} stages={best.stages}  {win.ms:.3f} ms  "
          f"{win.tflops or 0:.1f} TFLOP/s{vs}  ({sum(r.ok for r in rows)} timed, "
          f"{sum(r.status == 'spills' for r in rows)} spilling skipped)")
    if args.no_save:
        print("not saved (--no-save)")
    else:
        print(f"saved to {autotune.autotune_path()}; BatchPrefill uses it on this GPU model unless "
              f"{autotune.ENV}=0")
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
    b.add_argument("what", choices=["decode", "prefill", "mla-decode", "mla-prefill", "sparse-mla"])
    b.add_argument("--out", default=os.environ.get("OUT"), help="directory for JSON and PNG")
    b.add_argument("--quick", action="store_true",
                   help="decode: four cells instead of the full grid; prefill: two shapes, fewer repetitions")
    b.add_argument("--sweep", action="store_true", help="decode: also time other warp/split counts per cell")
    b.add_argument("--reps", type=int, default=None, help="timed calls per cell (decode default 30; prefill 20, quick 5)")
    b.add_argument("--kv-dtype", default="bfloat16",
                   help="fp8_e4m3: also time an FP8 cache beside bf16 on every shape")
    b.add_argument("--scale-granularity", default="token", help="FP8 scales: token, tensor, 32, 64 or 128")
    b.add_argument("--mla-configs", default="64x2", help="mla-decode: cukv configs to time in one process, "
                   "comma-separated block_n x num_kv_stages[:schedule][:tma|:cpasync][:slices] (e.g. "
                   "64x2,64x2:alternate,64x2:alternate:slices); the first is the "
                   "one compared with FlashMLA, the others are timed and checked against it")
    a = sub.add_parser("autotune", help="time prefill tile shapes on this GPU and keep the fastest (opt-in)",
                       description="prefill: time candidate (BM, BN, BK, stages) around the default on a causal "
                       "prefill, check each against the default's output, store the fastest next to the compile "
                       "cache (used by BatchPrefill on this GPU model unless CUKV_AUTOTUNE=0); defaults: print "
                       "the documented defaults table; show: list the stored records")
    a.add_argument("what", choices=["prefill", "defaults", "show"])
    a.add_argument("--head-dim", type=int, default=None)
    a.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    a.add_argument("--page-size", type=int, default=16, help="tokens per page; 0 tunes contiguous K/V")
    a.add_argument("--quick", action="store_true", help="about 20 candidates, shorter sequences, 5 repetitions")
    a.add_argument("--num-qo-heads", type=int, default=32)
    a.add_argument("--num-kv-heads", type=int, default=8)
    a.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 4096, quick 2048)")
    a.add_argument("--batch", type=int, default=2)
    a.add_argument("--reps", type=int, default=None, help="timed calls per candidate (default 10, quick 5)")
    a.add_argument("--jobs", type=int, default=None, help="compile processes (default: CPU count, at most 16)")
    a.add_argument("--no-save", action="store_true", help="print the table and the winner, store nothing")
    sub.add_parser("demo", help="run examples/decode_loop.py")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return {"doctor": _doctor, "compile": _compile, "bench": _bench, "autotune": _autotune,
            "demo": _demo}[args.cmd](args)
