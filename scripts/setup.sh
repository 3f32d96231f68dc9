#!/usr/bin/env bash
# Create .venv and install kvlab with the exact versions of requirements/constraints.txt.
# Safe to run again: it reinstalls only when pyproject.toml or the constraints changed.
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin="${PYTHON:-}"
if [ -z "$python_bin" ]; then
    if command -v python3.11 >/dev/null 2>&1; then python_bin=python3.11; else python_bin=python3; fi
fi

if [ ! -x .venv/bin/python ]; then
    echo "kvlab setup: creating .venv with $($python_bin --version)"
    "$python_bin" -m venv .venv
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check)

stamp=.venv/.kvlab-setup
want=$(cat pyproject.toml requirements/constraints.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

# torch first, and the CPU build on a machine without an NVIDIA GPU: the default Linux wheel on
# PyPI is a CUDA build of several GB. Ask pip which wheel it would pick, without downloading it.
torch_spec=$(grep '^torch==' requirements/constraints.txt)
torch_index=()
if ! command -v nvidia-smi >/dev/null 2>&1; then
    report=$(mktemp)
    "${pip[@]}" install -q --dry-run --ignore-installed --no-deps --report "$report" "$torch_spec" >/dev/null 2>&1 || true
    if ! grep -q '"version": "[^"]*+cpu"' "$report" 2>/dev/null; then
        echo "kvlab setup: no GPU found; installing the CPU build of torch"
        torch_index=(--index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple)
    fi
    rm -f "$report"
fi
"${pip[@]}" install -q "${torch_index[@]}" "$torch_spec"
"${pip[@]}" install -q -c requirements/constraints.txt -e ".[course,test]"
echo "$want" > "$stamp"
echo "kvlab setup: done ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
