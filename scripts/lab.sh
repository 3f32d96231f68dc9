#!/usr/bin/env bash
# Set up kvlab (first run: a few minutes) and open the course in JupyterLab on Chapter 1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/jupyter lab notebooks/01_kv_cache/01_kv_cache.ipynb "$@"
