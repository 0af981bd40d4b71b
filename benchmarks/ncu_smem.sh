# Shared-memory traffic of the prefill kernels (bf16 beside FP8, token then tensor scales) at b2 L4096 h32/8 d128:
# wavefronts, bank conflicts, issue activity. Session 19 found the FP8 producer's 2-way conflict on its ring stores here.
#   OUT=out bash benchmarks/ncu_smem.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUKV_CACHE_DIR=$PWD/.cache/n
M="l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,sm__memory_throughput.avg.pct_of_peak_sustained_elapsed"
for g in token tensor; do
ncu -k regex:cukv_prefill --launch-skip 4 --launch-count 2 --section MemoryWorkloadAnalysis_Tables --metrics $M python3 benchmarks/ncu_prefill.py 2x4096x128 --gran $g > $OUT/ncu_$g.txt 2>&1
grep -E "cukv_prefill|bank|wavefronts|gmma|issue_active|duration|throughput|Shared" $OUT/ncu_$g.txt | head -60
done
