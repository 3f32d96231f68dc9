"""Every graded test cell loads its checks afresh from the course's files, so a submission cannot replace them."""

import re
from pathlib import Path

import nbformat
import pytest

from conftest import load_release_tool

ROOT = Path(__file__).resolve().parents[2]
release = load_release_tool()
LOADER = ('import importlib.util as _iu; _spec = _iu.find_spec("kvlab.course.checks"); '
          '_checks = _iu.module_from_spec(_spec); _spec.loader.exec_module(_checks)')
CHECK_NAMES = ("check_equal", "check_close", "own_implementation", "limited_output", "run_case", "expect_raises")


def graded_cells(name):
    notebook = nbformat.read(ROOT / release.SOURCE / name / f"{name}.ipynb", as_version=4)
    return [c for c in notebook.cells if c.metadata.get("nbgrader", {}).get("grade")]


@pytest.mark.parametrize("name", release.assignments(ROOT))
def test_graded_cells_load_the_checks_afresh(name):
    for cell in graded_cells(name):
        grade_id = cell.metadata["nbgrader"]["grade_id"]
        source = cell.source
        assert LOADER in source, (
            f"{name}/{grade_id} must load kvlab/course/checks.py afresh with the standard loader line:\n  {LOADER}\n"
            "A notebook can replace the functions of an imported kvlab.course.checks; it cannot change a fresh copy.")
        assert "from kvlab.course.checks import" not in source and "kvlab.course.checks." not in source, (
            f"{name}/{grade_id} takes a check from the imported kvlab.course.checks module, which a submission can "
            "change")
        loaded_at = source.index(LOADER)
        for check in CHECK_NAMES:
            used = [m.start() for m in re.finditer(rf"(?<![\w.]){check}\(", source)]
            assert not used or used[0] > loaded_at, f"{name}/{grade_id} calls {check} before loading the checks"
