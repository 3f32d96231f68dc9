#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run: GPU tests (engine + compiled kernel), the kernel tests on
# CUDA tensors, and the kernel benchmark (quick grid; plots and CSV in benchmarks/results/).
# Usage on a GPU machine, from the repository root:  bash scripts/gpu_check.sh
# It uses .venv if there is one, else a python3 that already has torch (CUDA), triton and transformers
# (e.g. Colab), and only runs scripts/setup.sh when neither works.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
if ! "$PY" -c "import torch, triton, transformers, ipywidgets" 2>/dev/null; then
    bash scripts/setup.sh
    PY=.venv/bin/python
fi
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU here'; print(torch.cuda.get_device_name())"
"$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_gpu.py tests/kernels/test_paged_attention_kernel.py tests/kernels/test_engine_kernel.py \
    tests/engine/test_kv_cache_dtype.py
"$PY" benchmarks/paged_attention_gpu.py --quick "$@"
