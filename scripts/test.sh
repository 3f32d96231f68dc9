#!/usr/bin/env bash
# Set up kvlab (first run: a few minutes) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"   # nbgrader's gradebook shells out to alembic from the venv
export HF_HUB_OFFLINE=1              # tests use local models only
exec .venv/bin/python -m pytest "$@"
