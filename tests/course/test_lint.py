"""The code passes ruff with the repository's configuration (pyproject.toml: 120 columns, imports sorted)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    beside_python = Path(sys.executable).with_name("ruff")
    if beside_python.exists():
        return [str(beside_python)]
    if shutil.which("ruff"):
        return ["ruff"]
    pytest.fail("ruff is not installed: run scripts/setup.sh (it installs the test extras, ruff among them)")


def test_ruff_finds_nothing():
    run = subprocess.run(_ruff() + ["check", "--no-cache", "kvlab", "tests", "tools", "benchmarks"],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, f"ruff check failed (fix it, or `ruff check --fix` for imports):\n{run.stdout[-6000:]}"
