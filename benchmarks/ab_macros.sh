#!/usr/bin/env bash
# A/B on the device, one call: for each variant ("NAME=VAL NAME2=VAL" compile defines, "" = as checked in, "@DIR" =
# another tree's cukv/ and templates/), compile the probe's kernels in parallel, then run
# benchmarks/probe_prefill_fp8.py (bf16 default beside the FP8 default) on the bench shapes. Defines reach the kernels
# through CUKV_DEFINES (part of the compile cache key), so no tracked file is edited. Logs under ${OUT:-out}.
# PROBE=script runs that probe instead (with --shapes "$SHAPES" and $PROBE_ARGS).
#   OUT=$OUT bash benchmarks/ab_macros.sh "" "CUKV_WAIT_STATS=1" @/path/to/other/tree
set -u
out=${OUT:-out}; mkdir -p "$out"
here=$(pwd)
export PYTHONUNBUFFERED=1
shapes=${SHAPES:-4x4096x32x8x128,1x16384x32x8x128,8x2048x32x32x128,4x4096x16x16x256,8x2048x32x8x64}
i=0
for variant in "$@"; do
  i=$((i + 1))
  if [[ "$variant" == @* ]]; then
    export PYTHONPATH="${variant#@}:$here" CUKV_DEFINES=""  # the other tree's cukv/ finds its own templates/
  else
    export PYTHONPATH="$here" CUKV_DEFINES="$variant"
  fi
  export CUKV_CACHE_DIR=$(pwd)/.cache/ab$i
  echo "=== variant $i: ${variant:-as checked in}" | tee -a "$out/ab.log"
  python3 - "$shapes" ${VARIANTS:-} <<'PY' 2>&1 | tail -3
import sys
from concurrent.futures import ProcessPoolExecutor
from cukv.policy.prefill import default_config
def build(c):
    return c.compiled.functions[c.name].registers
cfgs = set()
for s in sys.argv[1].split(","):
    d = int(s.split("x")[4])
    base = default_config("bfloat16", d, 16, "fp8_e4m3", d)
    cfgs |= {default_config("bfloat16", d, 16), base}
    if len(sys.argv) > 2:
        sys.path.insert(0, "benchmarks")
        from probe_prefill_fp8 import variant_configs
        cfgs |= set(variant_configs(base, sys.argv[2]))
with ProcessPoolExecutor(16) as ex:
    list(ex.map(build, cfgs))
print("compiled", len(cfgs))
PY
  if [ -n "${PROBE:-}" ]; then
    python3 "$PROBE" --shapes "$shapes" ${PROBE_ARGS:-} 2>&1 | tee -a "$out/ab.log"
  else
    python3 benchmarks/probe_prefill_fp8.py --shapes "$shapes" --rounds ${ROUNDS:-3} --variants "${VARIANTS:-}" \
      ${PROBE_ARGS:-} 2>&1 | tee -a "$out/ab.log"
  fi
done
