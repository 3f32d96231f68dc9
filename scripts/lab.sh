#!/usr/bin/env bash
# Set up kvlab (first run: a few minutes) and open the course in JupyterLab on Chapter 1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One torch (OpenMP) thread in every notebook kernel: the course's model is tiny, and Chapter 9's
# replays time each step by the process's CPU time, which counts every thread and would otherwise grow
# with your number of cores (idle threads spin-wait). Set OMP_NUM_THREADS yourself to override it.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Serve the whole course (all chapters in the file browser), opened on Chapter 1.
exec .venv/bin/jupyter lab --ServerApp.root_dir="$PWD" notebooks/01_kv_cache/01_kv_cache.ipynb "$@"
