"""Per kernel: registers and spills (ptxas, through cukv.compiler) and the PTX instruction count by opcode (NVRTC's
PTX for the same source and options), to compare two trees where the cubins' .text differ and no GPU is at hand.

    python3 tools/ptx_stats.py --filter _decode_ --out after.json
    python3 tools/ptx_stats.py --diff before.json after.json      # registers, spills and opcodes that changed
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree's cukv

_OP = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)")


def ptx_opcodes(ptx: str) -> dict:
    """Instruction counts by full opcode (``mma.sync.aligned.m16n8k16...``), directives and labels left out."""
    counts = collections.Counter()
    for line in ptx.splitlines():
        s = line.split("//")[0].strip()
        if not s or s.startswith((".", "{", "}", "$")) or s.endswith(":"):
            continue
        m = _OP.match(s)
        if m:
            counts[m.group(1)] += 1
    return dict(sorted(counts.items()))


def stats(cfg) -> dict:
    from cupy.cuda import nvrtc
    from cukv import compiler
    src = cfg.render()
    mod = compiler.compile_source(cfg.name, src, arch="sm_90a")
    f = mod.functions[cfg.name]
    opts = [o for o in compiler.compile_options("sm_90a") if not o.startswith(("--ptxas", "-arch"))]
    opts.append("-arch=compute_90a")
    prog = nvrtc.createProgram(src, f"{cfg.name}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, opts)
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    if isinstance(ptx, bytes):
        ptx = ptx.decode()
    return {"registers": f.registers, "spill_stores": f.spill_stores, "spill_loads": f.spill_loads,
            "ptx": ptx_opcodes(ptx)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--filter", action="append", default=[])
    ap.add_argument("--out")
    ap.add_argument("--diff", nargs=2, metavar=("A", "B"))
    a = ap.parse_args(argv)
    if a.diff:
        x, y = (json.load(open(p)) for p in a.diff)
        for n in sorted(set(x) & set(y)):
            if a.filter and not any(f in n for f in a.filter):
                continue
            p, q = x[n], y[n]
            ops = {o: q["ptx"].get(o, 0) - p["ptx"].get(o, 0) for o in set(p["ptx"]) | set(q["ptx"])}
            ops = {o: d for o, d in sorted(ops.items()) if d}
            total = sum(q["ptx"].values()) - sum(p["ptx"].values())
            print(f"{n}: regs {p['registers']}->{q['registers']} spills "
                  f"{p['spill_stores'] + p['spill_loads']}->{q['spill_stores'] + q['spill_loads']}; "
                  f"ptx {sum(p['ptx'].values())}->{sum(q['ptx'].values())} ({total:+d})" + (f" {ops}" if ops else ""))
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fingerprint import configs, dump
    dump({c.name: stats(c) for c in configs() if not a.filter or any(f in c.name for f in a.filter)}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
