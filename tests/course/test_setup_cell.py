"""Every chapter starts with the same set-up cell, which installs kvlab only when it is missing."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(ROOT.glob("solutions/*/*.ipynb")) + sorted(ROOT.glob("notebooks/*/*.ipynb"))


def first_code_cell(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "".join(next(c for c in cells if c["cell_type"] == "code")["source"])


def test_there_are_chapters():
    assert NOTEBOOKS, "no notebooks found under solutions/ and notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[str(p.relative_to(ROOT)) for p in NOTEBOOKS])
def test_first_code_cell_is_the_shared_setup(path):
    reference = first_code_cell(NOTEBOOKS[0])
    assert first_code_cell(path) == reference, (
        f"{path.relative_to(ROOT)} starts with a different set-up cell than {NOTEBOOKS[0].relative_to(ROOT)}; "
        "the set-up cell must be identical in every chapter so that fixes reach all of them"
    )


def test_setup_cell_installs_only_when_kvlab_is_missing_and_keeps_torch():
    setup = first_code_cell(NOTEBOOKS[0])
    assert 'find_spec("kvlab") is None' in setup, "install only when kvlab is not importable"
    install = next(line for line in setup.splitlines() if '"pip", "install"' in line)
    assert "torch" not in install and "--upgrade" not in install, "never reinstall torch (Colab's matches its GPU)"
    assert "KVLAB_REPO" in setup
