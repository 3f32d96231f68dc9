#!/usr/bin/env bash
# Set up kvlab (first run: a few minutes) and open the course in JupyterLab on Chapter 1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Serve the whole course (all chapters in the file browser), opened on Chapter 1.
exec .venv/bin/jupyter lab --ServerApp.root_dir="$PWD" notebooks/01_kv_cache/01_kv_cache.ipynb "$@"
