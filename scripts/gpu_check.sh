#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run: the GPU tests (engine and compiled kernels), the kernel
# tests on CUDA tensors (fp32/fp16/bf16 and int8/fp8 pools, the unified kernel, split-KV), the kernel
# benchmark (quick grid; CSV and plots in benchmarks/results/) and the step-time model's calibration
# (benchmarks/step_time_gpu.py). The benchmarks run even when a test fails, so one call on a GPU machine
# always brings back figures; the exit status is the tests'.
# Usage on a GPU machine, from the repository root:  bash scripts/gpu_check.sh [benchmark flags]
# It uses .venv if there is one, else a python3 that already has torch (CUDA), triton and transformers
# (e.g. Colab); only when neither has them does it run scripts/setup.sh, which needs the package index.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
if ! "$PY" -c "import torch, triton, transformers" 2>/dev/null; then
    if ! python3 -c "import urllib.request; urllib.request.urlopen('https://pypi.org/simple/', timeout=5)" 2>/dev/null; then
        echo "gpu_check: no python with torch, triton and transformers here, and no network to install them:" >&2
        echo "bring the repository's .venv along (built by scripts/setup.sh on a machine of the same kind)." >&2
        exit 2
    fi
    bash scripts/setup.sh || exit 2
    PY=.venv/bin/python
fi
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU here'; print(torch.cuda.get_device_name())" || exit 2
# The test files that run on CUDA tensors when a GPU is there (tests/course/test_gpu_check.py keeps this list
# in step with the kernel tests).
GPU_TESTS=(tests/kernels/test_gpu.py tests/kernels/test_paged_attention_kernel.py
           tests/kernels/test_paged_attention_quantized.py tests/kernels/test_unified_attention.py
           tests/kernels/test_engine_kernel.py tests/kernels/test_cache_write.py tests/kernels/test_sliding_window.py
           tests/kernels/test_hybrid_kernel.py tests/engine/test_kv_cache_dtype.py)
"$PY" -m pytest -q -p no:cacheprovider "${GPU_TESTS[@]}"
tests_status=$?
"$PY" benchmarks/paged_attention_gpu.py --quick "$@"
bench_status=$?
# The simulator's calibration: kvlab's own forward passes of Llama-3-8B (random weights, bf16) against the
# step-time model's prediction for this GPU (benchmarks/results/step_time_gpu.json).
"$PY" benchmarks/step_time_gpu.py
calib_status=$?
[ $bench_status -eq 0 ] && bench_status=$calib_status
exit $(( tests_status != 0 ? tests_status : bench_status ))
