PY ?= python3
OUT ?= out

.PHONY: install test demo bench compile doctor gpu-check clean

install:  ## install cukv with its test extras (NVRTC and CUDA headers come as wheels)
	$(PY) -m pip install -q -e ".[test]"

test:  ## CPU suite (GPU tests skip with a reason where there is no GPU)
	$(PY) -m pytest -q -x tests

demo:  ## the main job: a self-checking decode loop (reference path without a GPU)
	$(PY) examples/decode_loop.py

compile:  ## build every shipped specialization, print registers/spills/shared memory
	$(PY) -m cukv compile

doctor:
	$(PY) -m cukv doctor

bench:  ## side-by-side decode timings (needs a GPU; PyTorch SDPA as the peer when importable)
	$(PY) -m cukv bench decode --out $(OUT)

gpu-check:  ## on a GPU machine: GPU tests + benchmarks in one go, logs and JSON under $(OUT)
	bash benchmarks/gpu_check.sh $(OUT)

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis out
