#!/usr/bin/env bash
# Nsight Compute profiles of the prefill (bf16 and FP8 caches) and decode (bf16 and FP8) kernels in one call:
# reports, their details and per-SASS-instruction source counters land in ${1:-$OUT}. PF_ARGS go to ncu_launches.py prefill
# (e.g. "--heads 32/32 --strategy convert_once"), NCU_EXTRA to ncu.
#   [WHICH=prefill|decode] bash benchmarks/ncu_profile.sh "$OUT" [prefill-shape] [decode-cell]
#   WHICH=mla-prefill [MLA_SHAPE="1x16x16384"] bash benchmarks/ncu_profile.sh "$OUT": the MLA prefill beside FA3, summarized
#   WHICH=mla-decode [MLA_SHAPE="b128 h128 ctx8192"] bash benchmarks/ncu_profile.sh "$OUT": MLA decode beside FlashMLA
set -u
out=${1:-${OUT:-out}}; pshape=${2:-2x4096x128}; dcell=${3:-64x4096}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd) PYTHONUNBUFFERED=1 CUKV_CACHE_DIR=${CUKV_CACHE_DIR:-$(pwd)/.cache/cukv}
S="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats
   --section InstructionStats --section Occupancy --section LaunchStats --section SourceCounters --section MemoryWorkloadAnalysis"
M="--metrics regex:sm__inst_executed_pipe_.*sum.pct_of_peak_sustained_active$"
run() {  # name, kernel regex, skip, script and its args...
  local name=$1 kre=$2 skip=$3 rc; shift 3
  ncu -f -k "regex:$kre" --launch-skip "$skip" --launch-count "${NCU_COUNT:-2}" $S $M ${NCU_EXTRA:-} -o "$out/$name" python3 "$@" \
    > "$out/$name.log" 2>&1
  rc=$?
  echo "$name ncu rc=$rc"; tail -3 "$out/$name.log"
  ncu -i "$out/$name.ncu-rep" --print-details all > "$out/${name}_details.txt" 2>&1
  ncu -i "$out/$name.ncu-rep" --page source --print-source sass --csv > "$out/${name}_sass.csv" 2>&1
  ls -la "$out/$name"*
}
if [ "${WHICH:-all}" = mla-decode ]; then  # cukv's absorbed MLA decode beside FlashMLA's dense decode (.peers kit)
  [ -f .peers/activate.sh ] && source .peers/activate.sh .peers > /dev/null 2>&1
  NCU_COUNT=${NCU_COUNT:-6} run mlad "(?i)mla" 0 benchmarks/ncu_launches.py mla-decode "${MLA_SHAPE:-b128 h128 ctx8192}" --peers
  python3 benchmarks/ncu_sass_summary.py "$out/mlad_sass.csv" | tail -60
  exit 0
fi
if [ "${WHICH:-all}" = mla-prefill ]; then  # cukv's MLA prefill beside FlashInfer's FA3 kernel (the .peers kit)
  [ -f .peers/activate.sh ] && source .peers/activate.sh .peers > /dev/null 2>&1
  run mlap "(?i)prefill" 2 benchmarks/ncu_launches.py mla-prefill "${MLA_SHAPE:-1x16x16384}" --peers
  python3 benchmarks/ncu_sass_summary.py "$out/mlap_sass.csv" | tail -60
  exit 0
fi
[ "${WHICH:-all}" = decode ] || run pf cukv_prefill 4 benchmarks/ncu_launches.py prefill "$pshape" ${PF_ARGS:-}
[ "${WHICH:-all}" = prefill ] || run dec cukv_decode 2 benchmarks/ncu_launches.py decode "$dcell"
