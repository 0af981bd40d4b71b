#!/usr/bin/env bash
# Nsight Compute profiles of the prefill (bf16 and FP8 caches) and decode (bf16 and FP8) kernels in one call:
# reports, their details and per-SASS-instruction source counters land in ${1:-$OUT}.
#   [WHICH=prefill|decode] bash benchmarks/ncu_profile.sh "$OUT" [prefill-shape] [decode-cell]
set -u
out=${1:-${OUT:-out}}; pshape=${2:-2x4096x128}; dcell=${3:-64x4096}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd) PYTHONUNBUFFERED=1 CUKV_CACHE_DIR=${CUKV_CACHE_DIR:-$(pwd)/.cache/cukv}
S="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats
   --section InstructionStats --section Occupancy --section LaunchStats --section SourceCounters --section MemoryWorkloadAnalysis"
M="--metrics regex:sm__inst_executed_pipe_.*sum.pct_of_peak_sustained_active$"
run() {  # name, kernel regex, skip, script, args...
  local name=$1 kre=$2 skip=$3; shift 3
  ncu -f -k "regex:$kre" --launch-skip "$skip" --launch-count 2 $S $M ${NCU_EXTRA:-} -o "$out/$name" python3 "$@" > "$out/$name.log" 2>&1
  local rc=$?
  set -- "$name"
  echo "$1 ncu rc=$rc"; tail -3 "$out/$1.log"
  ncu -i "$out/$1.ncu-rep" --print-details all > "$out/$1_details.txt" 2>&1
  ncu -i "$out/$1.ncu-rep" --page source --print-source sass --csv > "$out/$1_sass.csv" 2>&1
  ls -la "$out/$1"*
}
[ "${WHICH:-all}" = decode ] || run pf cukv_prefill 4 benchmarks/ncu_prefill.py "$pshape" ${PF_ARGS:-}
[ "${WHICH:-all}" = prefill ] || run dec cukv_decode 2 benchmarks/ncu_decode.py "$dcell"
