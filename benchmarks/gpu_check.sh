#!/usr/bin/env bash
# One call on a GPU machine: doctor, compile, GPU tests, the demo, benchmarks (decode, prefill, MLA decode and prefill). Logs and
# JSON land in $1 (default $OUT or ./out); a short table is printed last.
#   STAGE=tests | bench | all (default all): run only the tests or only the benchmarks (two calls fit the device
#   tool's 10-minute limit); STAGE=mla: only the MLA and sparse MLA GPU tests and their three benches (one call). With two or more GPUs the prefill test files run on GPU 1 beside the rest on GPU 0,
#   then tests/test_multi_gpu.py uses both; benchmarks always run alone on GPU 0.
#   SLOW=1 adds the tests marked slow (long sweeps; a call of their own); PYTEST_ARGS replaces the test selection; BENCH_ARGS goes to `bench decode`, BENCH_PREFILL_ARGS (e.g. --quick) to
#   `bench prefill`, BENCH_MLA_ARGS to `bench mla-decode`; a .peers kit beside the tree adds FlashMLA and FlashInfer to the MLA benches.
set -u
out=${1:-${OUT:-out}}
mkdir -p "$out"
stage=${STAGE:-all}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd) PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=gpu
export CUKV_CACHE_DIR=${CUKV_CACHE_DIR:-$(pwd)/.cache/cukv}
python3 -m cukv doctor 2>&1 | tee "$out/doctor.log" | tail -4
python3 -m cukv compile --jobs "$(nproc)" > "$out/compile.log" 2>&1; echo "compile rc=$? ($(tail -1 "$out/compile.log"))"
gpus=$(python3 -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())" 2>/dev/null || echo 0)
prefill_files="tests/test_prefill_gpu.py tests/test_fp8_prefill_gpu.py tests/test_prefill_hypothesis_gpu.py tests/test_prefill_reference.py"
marks=$([ -n "${SLOW:-}" ] && echo gpu || echo "gpu and not slow")  # SLOW=1 adds the long sweeps (the MLA full grid)
pytest_q() { python3 -m pytest -q -m "$marks" -p no:cacheprovider "$@"; }

if [ "$stage" = mla ]; then  # the MLA kernels alone: their fast GPU tests, then the three MLA benches with the peers
  pytest_q tests/test_mla_decode_gpu.py tests/test_mla_decode_schedule_gpu.py tests/test_mla_prefill_gpu.py \
    tests/test_sparse_mla_gpu.py > "$out/tests_mla.log" 2>&1
  echo "tests_mla: $(tail -1 "$out/tests_mla.log")"; grep -h "^FAILED\|^ERROR" "$out/tests_mla.log" | head -20
  peers() { if [ -f .peers/activate.sh ]; then (source .peers/activate.sh .peers >/dev/null 2>&1; "$@"); else "$@"; fi; }
  peers python3 -m cukv bench mla-decode --out "$out" --kv-dtype fp8_e4m3 ${BENCH_MLA_ARGS:-} > "$out/bench_mla_decode.log" 2>&1
  peers python3 -m cukv bench mla-prefill --out "$out" > "$out/bench_mla_prefill.log" 2>&1
  peers python3 -m cukv bench sparse-mla --out "$out" > "$out/bench_sparse_mla.log" 2>&1
  for f in bench_mla_decode bench_mla_prefill bench_sparse_mla; do echo "=== $f"; tail -${TAIL:-14} "$out/$f.log"; done
  exit 0
fi

if [ "$stage" != bench ]; then
  if [ -n "${PYTEST_ARGS:-}" ]; then
    pytest_q $PYTEST_ARGS 2>&1 | tee "$out/tests.log" | tail -15
  elif [ "$gpus" -ge 2 ]; then
    ignore=$(for f in $prefill_files tests/test_multi_gpu.py; do printf -- '--ignore=%s ' "$f"; done)
    CUDA_VISIBLE_DEVICES=1 pytest_q $prefill_files > "$out/tests_prefill.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=0 pytest_q tests $ignore > "$out/tests_rest.log" 2>&1
    wait
    pytest_q tests/test_multi_gpu.py > "$out/tests_multi_gpu.log" 2>&1
    for f in tests_rest tests_prefill tests_multi_gpu; do echo "$f: $(tail -1 "$out/$f.log")"; done
    grep -h "^FAILED\|^ERROR" "$out"/tests_*.log | head -20
  else
    pytest_q tests 2>&1 | tee "$out/tests.log" | tail -15
  fi
  python3 examples/decode_loop.py > "$out/demo.log" 2>&1; echo "demo rc=$? ($(tail -1 "$out/demo.log"))"
fi

if [ "$stage" != tests ]; then
  export CUDA_VISIBLE_DEVICES=0
  python3 -m cukv bench decode --out "$out" ${BENCH_ARGS:-} > "$out/bench_decode.log" 2>&1
  python3 -m cukv bench prefill --out "$out" ${BENCH_PREFILL_ARGS:-} > "$out/bench_prefill.log" 2>&1
  peers() { if [ -f .peers/activate.sh ]; then (source .peers/activate.sh .peers >/dev/null 2>&1; "$@"); else "$@"; fi; }
  peers python3 -m cukv bench mla-decode --out "$out" ${BENCH_MLA_ARGS:-} > "$out/bench_mla_decode.log" 2>&1
  peers python3 -m cukv bench mla-prefill --out "$out" > "$out/bench_mla_prefill.log" 2>&1
  peers python3 -m cukv bench sparse-mla --quick --out "$out" > "$out/bench_sparse_mla.log" 2>&1
  for f in bench_decode bench_prefill bench_mla_decode bench_mla_prefill bench_sparse_mla; do
    echo "=== $f"; tail -${TAIL:-16} "$out/$f.log"
  done
fi
