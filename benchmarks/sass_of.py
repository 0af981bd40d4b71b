"""SASS of one prefill specialization, for reading what ptxas made of a code shape: NVRTC -> PTX (compute_90a),
then this machine's ptxas -> cubin -> nvdisasm (the cubins NVRTC writes do not always open in nvdisasm).

    PYTHONPATH=. python3 benchmarks/sass_of.py out/once_pers_d256.sass convert_once 256 --persistent
"""
import argparse
import subprocess

from cupy.cuda import nvrtc

from cukv import compiler
from cukv.policy.prefill import once_config

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("kind", choices=["convert_once"])
ap.add_argument("head_dim", type=int)
ap.add_argument("--persistent", action="store_true")
ap.add_argument("--gran", type=int, default=0, help="scale block (0: the head dim, token scales)")
args = ap.parse_args()
c = once_config("bfloat16", args.head_dim, 16, "fp8_e4m3", args.gran or args.head_dim, persistent=args.persistent)
opts = [o.replace("-arch=sm_", "-arch=compute_") for o in compiler.compile_options(compiler.target_arch())
        if not o.startswith("--ptxas")]
prog = nvrtc.createProgram(c.render(), c.name + ".cu", [], [])
nvrtc.compileProgram(prog, opts)
ptx = nvrtc.getPTX(prog)
ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
base = args.out.rsplit(".", 1)[0]
open(base + ".ptx", "w").write(ptx.rstrip("\x00"))
arch = compiler.target_arch()
subprocess.run(["ptxas", f"-arch={arch}", "-v", "-lineinfo", "-o", base + ".cubin", base + ".ptx"], check=True)
with open(args.out, "w") as f:
    subprocess.run(["nvdisasm", "-c", "-g", base + ".cubin"], check=True, stdout=f)
print(c.name, "->", args.out)
