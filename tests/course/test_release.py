"""notebooks/ is exactly nbgrader's release of solutions/, leaks no answer and has well-formed tests.

Every test runs once per assignment folder solutions/<name>/; with no assignment yet they are
skipped. Fix almost any failure here with `python tools/release.py`, then commit both folders.
"""

import os
import re
import shutil
from pathlib import Path

import nbformat
import pytest

from conftest import load_release_tool

ROOT = Path(__file__).resolve().parents[2]
release = load_release_tool()

ASSIGNMENTS = release.assignments(ROOT)
per_assignment = pytest.mark.parametrize("name", ASSIGNMENTS, ids=ASSIGNMENTS)
CELL_TIMEOUT = int(os.environ.get("KVLAB_TEST_CELL_TIMEOUT", "30"))
# Regions that nbgrader removes from the learner's copy.
REGIONS = ("SOLUTION", "HIDDEN TESTS", "MARK SCHEME")
MIN_SECRET_CHARS = 20  # shorter lines (`pass`, `return out`) legitimately appear in both copies
ONE_LINE_DOCSTRING = re.compile(r'^[rRuU]?("""|\'\'\')\s*\S.*\1\s*$')


def notebooks(folder: Path) -> list[Path]:
    """The notebooks of an assignment folder, checkpoints excluded."""
    return [path for rel, path in release.files_under(folder).items() if rel.endswith(".ipynb")]


def nbgrader_meta(cell) -> dict:
    """The cell's nbgrader metadata, {} for an ordinary cell."""
    return cell.metadata.get("nbgrader", {})


def is_test_cell(cell) -> bool:
    """An autograded test: a graded code cell that is not a solution cell."""
    meta = nbgrader_meta(cell)
    return cell.cell_type == "code" and meta.get("grade") and not meta.get("solution")


def split_secret(cell) -> tuple[list[str], list[str]]:
    """(secret, public) lines of a source cell: secret ones are what nbgrader strips from the release."""
    lines = cell.source.splitlines()
    has_markers = any(f"BEGIN {region}" in line for line in lines for region in REGIONS)
    if nbgrader_meta(cell).get("solution") and not has_markers:
        return lines, []  # a solution cell without markers is replaced as a whole
    secret, public, inside = [], [], None
    for line in lines:
        if inside is None:
            inside = next((r for r in REGIONS if f"BEGIN {r}" in line), None)
            if inside is None:
                public.append(line)
        elif f"END {inside}" in line:
            inside = None
        else:
            secret.append(line)
    return secret, public


def release_text(name: str) -> dict[str, str]:
    """Text of every released file of name (cell sources for notebooks), by repo-relative path."""
    texts = {}
    for rel, path in release.files_under(ROOT / release.RELEASE / name).items():
        key = f"{release.RELEASE}/{name}/{rel}"
        if path.suffix == ".ipynb":
            texts[key] = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)
        else:
            texts[key] = path.read_bytes().decode("utf-8", errors="ignore")
    return texts


@per_assignment
def test_release_is_nbgraders_output_of_solutions(name):
    """Regenerating notebooks/<name>/ from solutions/<name>/ changes no byte."""
    changed = release.differences(ROOT, [name])
    assert not changed, (
        "solutions/ and notebooks/ are out of step; these files would change:\n  "
        + "\n  ".join(changed)
        + "\nRun `python tools/release.py` (normalises solutions/ and regenerates notebooks/ with "
        "nbgrader), review the diff and commit both folders. Never edit notebooks/ by hand."
    )


def test_no_release_without_solutions():
    """Every folder in notebooks/ still has its source in solutions/."""
    stale = release.stale_releases(ROOT)
    assert not stale, (
        f"{stale} have no solutions/<name>/ any more; run `python tools/release.py` to remove them "
        "(or restore the source if it was deleted by mistake)."
    )


@per_assignment
def test_no_outputs_committed(name):
    """Solutions and learner notebooks carry no outputs and no execution counts."""
    dirty = []
    for folder in (release.SOURCE, release.RELEASE):
        for path in notebooks(ROOT / folder / name):
            for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
                if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None):
                    dirty.append(f"{path.relative_to(ROOT)} cell {index}")
    assert not dirty, (
        "outputs or execution counts are committed in:\n  " + "\n  ".join(dirty)
        + "\nRun `python tools/release.py` (it strips them) before committing."
    )


@per_assignment
def test_release_leaks_no_solution_or_hidden_test(name):
    """No line of a solution or hidden-test region of solutions/ appears in notebooks/.

    A line the author also wrote outside those regions (set-up shared by the visible and hidden
    parts of a test, say) is public anyway: it may appear as often as it does there, no more.
    """
    texts = release_text(name)
    secret, public = [], []
    for rel, path in release.files_under(ROOT / release.SOURCE / name).items():
        if path.suffix != ".ipynb":
            public.append(path.read_bytes().decode("utf-8", errors="ignore"))  # copied as is
            continue
        for cell in nbformat.read(path, as_version=4).cells:
            hidden, shown = split_secret(cell)
            secret += [line.strip() for line in hidden]
            public.append("\n".join(shown))
    public_text = "\n".join(public)
    leaks = []
    for needle in sorted(set(secret)):
        if len("".join(needle.split())) < MIN_SECRET_CHARS:
            continue
        shown = {where: text.count(needle) for where, text in texts.items() if needle in text}
        if sum(shown.values()) > public_text.count(needle):
            leaks += [f"{where}: {needle!r}" for where in shown]
    assert not leaks, (
        "the learner's copy shows lines that nbgrader should have removed:\n  " + "\n  ".join(leaks)
        + "\nCheck the ### BEGIN/END SOLUTION and HIDDEN TESTS markers in solutions/" + name
        + " and run `python tools/release.py`; a release generated from an older solutions/ "
        "shows up here too."
    )


@per_assignment
def test_release_has_no_nbgrader_markers(name):
    """notebooks/ contains no BEGIN SOLUTION or BEGIN HIDDEN TESTS marker."""
    found = [
        f"{where}: {marker}"
        for where, text in release_text(name).items()
        for marker in ("BEGIN SOLUTION", "BEGIN HIDDEN TESTS", "BEGIN MARK SCHEME")
        if marker in text
    ]
    assert not found, (
        "markers survived the release:\n  " + "\n  ".join(found)
        + "\nCheck in solutions/ that every BEGIN line has its END line spelled the same way, in "
        "a solution cell (SOLUTION) or an autograded test cell (HIDDEN TESTS), then run "
        "`python tools/release.py`."
    )


@per_assignment
def test_test_cells_are_well_formed(name):
    """Every test cell has points > 0 and a one-line docstring; grade_ids are unique."""
    problems, seen = [], {}
    for path in notebooks(ROOT / release.SOURCE / name):
        for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
            meta, where = nbgrader_meta(cell), f"{path.relative_to(ROOT)} cell {index}"
            grade_id = meta.get("grade_id")
            if grade_id:
                if grade_id in seen:
                    problems.append(f"{where}: grade_id {grade_id!r} already used by {seen[grade_id]}")
                seen.setdefault(grade_id, where)
            if meta.get("grade") and not float(meta.get("points") or 0) > 0:
                problems.append(f"{where} ({grade_id}): graded cell without points > 0")
            if is_test_cell(cell):
                first = next((line for line in cell.source.splitlines() if line.strip()), "")
                if not ONE_LINE_DOCSTRING.match(first.strip()):
                    problems.append(
                        f"{where} ({grade_id}): must open with a one-line docstring saying what "
                        f"it checks, e.g. '\"\"\"Exercise 2: ...\"\"\"'; found {first!r}")
    assert not problems, "malformed nbgrader cells:\n  " + "\n  ".join(problems)
    assert any(is_test_cell(c) for p in notebooks(ROOT / release.SOURCE / name)
               for c in nbformat.read(p, as_version=4).cells), f"solutions/{name} has no test cell"


@pytest.mark.slow
@per_assignment
def test_untouched_release_fails_every_test(name, tmp_path):
    """Run on the learner's untouched notebook, every test cell fails (nbgrader validate --invert)."""
    from nbgrader.validator import Validator

    for path in notebooks(ROOT / release.RELEASE / name):
        # Execute a copy: the notebook may write files next to itself.
        work = tmp_path / name
        shutil.copytree(path.parent, work, dirs_exist_ok=True)
        validator = Validator(config=release.course_config(ROOT, tmp_path / "course", CELL_TIMEOUT))
        validator.invert = True
        result = validator.validate(str(work / path.name))
        assert "changed" not in result and "type_changed" not in result, (
            f"{path.relative_to(ROOT)} is not nbgrader's release (checksums differ): "
            "run `python tools/release.py`.")
        passing = [cell["source"].splitlines()[0] for cell in result.get("passed", [])]
        assert not passing, (
            f"in {path.relative_to(ROOT)}, these tests pass although the learner has written "
            "nothing:\n  " + "\n  ".join(passing)
            + "\nA test must call the exercise so that the untouched stub (raise "
            "NotImplementedError) fails it, with visible asserts outside ### BEGIN HIDDEN TESTS.")
