#!/usr/bin/env bash
# What the peers' prefill kernels are (grid, block, cluster, registers, shared memory) and how many bytes they move
# through L2 and DRAM, beside cukv's bf16 and FP8 kernels, at one shape (benchmarks/ncu_peers.py). Clocks are left
# alone (--clock-control none): these kernels run at the H100's power limit, so the SM clock is part of the answer.
#   OUT=out bash benchmarks/ncu_peers.sh [BxLxHQxHKVxD] [granularity]
# NCU_SET=full also collects ncu's full set (instruction mix, stall reasons, shared-memory traffic) for cukv's kernels
# and cuDNN's, and prints each one's details into $OUT/<name>_details.txt.
set -u
out=${OUT:-out}; shape=${1:-4x4096x16x16x256}; gran=${2:-token}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd) PYTHONUNBUFFERED=1 CUKV_CACHE_DIR=${CUKV_CACHE_DIR:-$(pwd)/.cache/cukv}
# launch figures (grid, block, cluster, registers, shared memory) come from the LaunchStats section
M="gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum"
M="$M,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum"
M="$M,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed"
name=ncu_peers_${shape}_${gran}
extra="--section LaunchStats"
if [ -n "${NCU_SET:-}" ]; then extra="--set $NCU_SET -k regex:cukv_prefill|cudnn"; name=${name}_$NCU_SET; fi
ncu -f --profile-from-start off --clock-control none $extra --metrics "$M" -o "$out/$name" \
  python3 benchmarks/ncu_peers.py "$shape" --gran "$gran" > "$out/$name.log" 2>&1
echo "ncu rc=$?"; grep -E "configs|rror" "$out/$name.log" | head -5
ncu -i "$out/$name.ncu-rep" --csv --page raw > "$out/$name.csv" 2>&1
python3 benchmarks/ncu_csv_table.py "$out/$name.csv"
if [ -n "${NCU_SET:-}" ]; then
  ncu -i "$out/$name.ncu-rep" --print-details all > "$out/${name}_details.txt" 2>&1
  ncu -i "$out/$name.ncu-rep" --page source --print-source sass --csv > "$out/${name}_sass.csv" 2>&1
  python3 benchmarks/ncu_sass_summary.py "$out/${name}_sass.csv" --top=12 2>&1 | tee "$out/${name}_sass_summary.txt"
fi
