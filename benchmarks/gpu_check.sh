#!/usr/bin/env bash
# One call on a GPU machine: doctor, compile, GPU tests, examples, benchmarks (decode, then prefill). Logs and
# JSON land in $1 (default $OUT or ./out); the benchmark tables are printed last. SKIP_BENCH=1 skips both
# benchmarks; BENCH_ARGS goes to `bench decode`, BENCH_PREFILL_ARGS (e.g. --quick) to `bench prefill`.
set -u
out=${1:-${OUT:-out}}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd) PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=gpu
export CUKV_CACHE_DIR=${CUKV_CACHE_DIR:-$(pwd)/.cache/cukv}
python3 -m cukv doctor 2>&1 | tee "$out/doctor.log"
python3 -m cukv compile --jobs 16 > "$out/compile.log" 2>&1; echo "compile rc=$? (see compile.log)"
python3 -m pytest -q -x -m "gpu or not gpu" ${PYTEST_ARGS:-tests} 2>&1 | tee "$out/tests.log" | tail -25
python3 examples/decode_loop.py > "$out/demo.log" 2>&1; echo "demo rc=$?"; tail -2 "$out/demo.log"
[ -n "${SKIP_BENCH:-}" ] || python3 -m cukv bench decode --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" | tail -30
[ -n "${SKIP_BENCH:-}" ] || python3 -m cukv bench prefill --out "$out" ${BENCH_PREFILL_ARGS:-} 2>&1 | tee "$out/bench_prefill.log" | tail -20
