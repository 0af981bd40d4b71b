"""Fingerprints of every kernel cukv ships or picks by default: the rendered source's SHA-1 and the SHA-1 of
the cubin's code (.text.* sections). Two trees whose fingerprints match generate the same machine code.

    python3 tools/fingerprint.py --out before.json [--no-compile]
    python3 tools/fingerprint.py --out after.json && python3 tools/fingerprint.py --diff before.json after.json
    python3 tools/fingerprint.py --filter _prefill_ --out sub.json --jobs 1   # a subset while iterating
    python3 tools/fingerprint.py --filter _prefill_ --diff before.json sub.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's cukv, not an installed one

# the tree this file sits in, not an installed cukv (python3 tools/fingerprint.py puts tools/ first on the path)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def configs():
    """Shipped specializations, plus the FP8 decode/prefill defaults and the convert-once kernels."""
    from cukv import specs
    from cukv.configs.prefill import HEAD_DIMS
    from cukv.policy.decode import decode_config
    from cukv.policy.prefill import default_config

    out = list(specs.shipped())
    for dt, d, g, sb in [("bfloat16", 128, 4, sb) for sb in (0, 32, 64, 128)] + [
            ("float16", 128, 4, 128), ("bfloat16", 64, 8, 64), ("bfloat16", 256, 4, 256), ("bfloat16", 128, 1, 0)]:
        for stages in (None, 0):
            out.append(decode_config(dt, d, g, 16, kv_dtype="fp8_e4m3", scale_block=sb, stages=stages))
    for d in HEAD_DIMS:
        for sb in sorted({0, d, 32, 64, 128}):
            if sb and d % sb:
                continue
            for ps in (16, 1):
                out.append(default_config("bfloat16", d, ps, "fp8_e4m3", sb))
    try:
        from cukv.policy.prefill import ONCE_HEAD_DIMS, once_config
        for d in ONCE_HEAD_DIMS:
            for sb in (0, d):
                try:
                    out.append(once_config("bfloat16", d, 16, "fp8_e4m3", sb))
                except Exception:  # noqa: BLE001 - a strategy the tree does not offer at this shape
                    pass
    except ImportError:
        pass
    seen, uniq = set(), []
    for c in out:
        if c.name not in seen:
            seen.add(c.name)
            uniq.append(c)
    return uniq


def _text_digest(cubin: bytes) -> str:
    """SHA-1 over the .text.* sections (name and bytes), in section order."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    stroff = secs[shstrndx][4]
    h = hashlib.sha1()
    for name_off, _t, _f, _a, off, size in secs:
        end = cubin.index(b"\0", stroff + name_off)
        name = cubin[stroff + name_off:end]
        if name.startswith(b".text."):
            h.update(name + b"\0" + cubin[off:off + size])
    return h.hexdigest()


def _one(args):
    cfg, compile_ = args
    src = cfg.render()
    row = {"source": hashlib.sha1(src.encode()).hexdigest()}
    if compile_:
        from cukv import compiler
        mod = compiler.compile_source(cfg.name, src, arch="sm_90a")
        row["text"] = _text_digest(mod.cubin_path.read_bytes())
    return cfg.name, row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--diff", nargs=2, metavar=("A", "B"))
    ap.add_argument("--filter", action="append", default=[], metavar="SUBSTR",
                    help="only kernels whose name contains SUBSTR (repeatable); --diff then compares common names")
    a = ap.parse_args(argv)
    if a.diff:
        x, y = (json.load(open(p)) for p in a.diff)
        # --filter: the kernels of that name in both (a filtered run beside a full one)
        names = sorted(set(x) & set(y) if a.filter else set(x) | set(y))
        names = [n for n in names if not a.filter or any(f in n for f in a.filter)]
        src = sum(x.get(n, {}).get("source") != y.get(n, {}).get("source") for n in names)
        txt = [n for n in names if x.get(n, {}).get("text") != y.get(n, {}).get("text")]
        print(f"{len(names)} kernels; {src} rendered sources differ; {len(txt)} .text digests differ")
        for n in txt:
            print("  text differs:", n)
        return 1 if txt else 0
    cfgs = [c for c in configs() if not a.filter or any(f in c.name for f in a.filter)]
    with ProcessPoolExecutor(a.jobs) as ex:
        rows = dict(ex.map(_one, [(c, not a.no_compile) for c in cfgs]))
    print(f"{len(rows)} kernels fingerprinted", file=sys.stderr)
    dump(rows, a.out)
    return 0


def dump(rows: dict, out: str | None) -> None:
    """Rows as sorted JSON to the file ``out``, or to stdout (also tools/ptx_stats.py's output)."""
    text = json.dumps(rows, indent=1, sort_keys=True)
    if out:
        open(out, "w").write(text)
    else:
        print(text)


if __name__ == "__main__":
    sys.exit(main())
