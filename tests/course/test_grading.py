"""The solutions run without error, and nbgrader grades the reference, untouched and sample submissions as expected.

Grading uses the repository's nbgrader_config.py in a temporary course directory: one
generate_assignment and one autograde pass per assignment for all its submissions. Sample
submissions live in tests/submissions/<name>/*.ipynb, with their expected scores in
tests/submissions/<name>/expected.json:
    {"wrong_answer.ipynb": {"score": 3.0, "per_cell": {"test_num_blocks": 0.0}}}
The per-cell time limit is 30 s here (KVLAB_TEST_CELL_TIMEOUT=60 to change it), so a sample
submission with an infinite loop costs only that.
"""

import json
import os
import re
from pathlib import Path

import nbformat
import pytest

from conftest import load_release_tool

ROOT = Path(__file__).resolve().parents[2]
release = load_release_tool()

ASSIGNMENTS = release.assignments(ROOT)
per_assignment = pytest.mark.parametrize("name", ASSIGNMENTS, ids=ASSIGNMENTS)
SUBMISSIONS_DIR = ROOT / "tests" / "submissions"
SAMPLES = [
    (name, path.name)
    for name in ASSIGNMENTS
    for path in sorted((SUBMISSIONS_DIR / name).glob("*.ipynb"))
]
CELL_TIMEOUT = int(os.environ.get("KVLAB_TEST_CELL_TIMEOUT", "30"))
SOLUTION, UNTOUCHED = "reference-solution", "untouched-release"
# nbgrader skips the cells tagged skip-autograde (a chapter's measurements; nbgrader_config.py). The reference
# solution is graded as a class would be, tags honoured, and once more with the tags removed, so that every
# measurement cell is also run and checked by nbgrader's own run.
SOLUTION_EVERY_CELL, SKIP_TAG = "reference-solution-every-cell", "skip-autograde"

# nbgrader's gradebook triggers these inside autograde; they are not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")


def student_id(sample: str) -> str:
    """The nbgrader student id for a sample submission file name."""
    return "sample-" + re.sub(r"[^A-Za-z0-9_-]", "_", Path(sample).stem)


_runs: dict[str, object] = {}


@pytest.fixture(scope="session")
def kept(tmp_path_factory) -> Path:
    """Where the autograded notebooks are kept for inspecting failures (pytest's temporary folder)."""
    return tmp_path_factory.mktemp("autograded")


def graded(name: str, kept: Path) -> dict:
    """Autograde all submissions of name once per test session (see release.grade for the format)."""
    if name not in _runs:
        submissions = {
            SOLUTION: ROOT / release.SOURCE / name / f"{name}.ipynb",
            UNTOUCHED: ROOT / release.RELEASE / name / f"{name}.ipynb",
        }
        every_cell = without_skip_tags(submissions[SOLUTION], kept / f"{name}-every-cell.ipynb")
        if every_cell is not None:
            submissions[SOLUTION_EVERY_CELL] = every_cell
        for sample in sorted((SUBMISSIONS_DIR / name).glob("*.ipynb")):
            submissions[student_id(sample.name)] = sample
        try:
            _runs[name] = release.grade(ROOT, name, submissions, timeout=CELL_TIMEOUT,
                                        keep=kept / name)
        except Exception as err:  # remember it: every test of this assignment reports it
            _runs[name] = err
    if isinstance(_runs[name], Exception):
        raise _runs[name]
    return _runs[name]


def without_skip_tags(path: Path, dest: Path) -> Path | None:
    """A copy of the notebook at path with its skip-autograde tags removed, or None if it has none."""
    notebook = nbformat.read(path, as_version=4)
    tagged = [cell for cell in notebook.cells if SKIP_TAG in cell.metadata.get("tags", [])]
    if not tagged:
        return None
    for cell in tagged:
        cell.metadata["tags"] = [tag for tag in cell.metadata["tags"] if tag != SKIP_TAG]
    nbformat.write(notebook, dest)
    return dest


def result_of(name: str, student: str, kept: Path) -> dict:
    """One student's grading result, failing the test with nbgrader's log if it was not graded."""
    run = graded(name, kept)
    result = dict(run["students"][student], notebook=kept / name / student / name / f"{name}.ipynb")
    assert result["graded"], (
        f"nbgrader could not grade {student!r} of {name} (kernel died, or the notebook is not "
        f"valid nbgrader JSON). Reproduce with `nbgrader autograde {name}` after copying it to "
        f"grading/submitted/<student>/{name}/{name}.ipynb. nbgrader's log:\n{run['log'][-4000:]}"
    )
    return result


def explain(result: dict) -> str:
    """The per-cell scores and the first error of each failed test, for failure messages."""
    return "\n".join(
        [f"  {grade_id}: {score} {result['messages'].get(grade_id, '')}"
         for grade_id, score in result["per_cell"].items()]
        + [f"The graded notebook, with its outputs: {result['notebook']}"]
    )


@pytest.mark.slow
@per_assignment
def test_solution_runs_without_error_and_writes_no_file(name, kept):
    """Every cell of the reference solution ran without an error in nbgrader's own run (demo cells included, which
    grading alone would not notice), and the notebook wrote no file beside itself."""
    every_cell = SOLUTION_EVERY_CELL in graded(name, kept)["students"]
    result = result_of(name, SOLUTION_EVERY_CELL if every_cell else SOLUTION, kept)
    notebook = nbformat.read(result["notebook"], as_version=4)
    errors = [f"cell {i}: {out.ename}: {out.evalue}"[:400] for i, cell in enumerate(notebook.cells)
              if cell.cell_type == "code" for out in cell.get("outputs", []) if out.output_type == "error"]
    assert not errors, (f"{release.SOURCE}/{name}/{name}.ipynb fails when run top to bottom (Restart Kernel and Run "
                        f"All Cells reproduces it):\n" + "\n".join(errors))
    created = sorted(p.name for p in result["notebook"].parent.iterdir() if p.name != f"{name}.ipynb")
    assert not created, (
        f"running {release.SOURCE}/{name}/{name}.ipynb created {created} next to it; nbgrader would ship them in the "
        "release. Write scratch files to a temporary folder, or to a git-ignored path outside solutions/.")


@pytest.mark.slow
@per_assignment
def test_solution_scores_full_marks(name, kept):
    """The reference solution gets every point from nbgrader."""
    result = result_of(name, SOLUTION, kept)
    assert result["max_score"] > 0, f"{name} has no graded test cell"
    assert result["score"] == result["max_score"], (
        f"the reference solution of {name} scores {result['score']} of {result['max_score']}:\n"
        f"{explain(result)}\nA test cell scores zero if it raises, times out ({CELL_TIMEOUT} s "
        "here) or writes to stderr (warnings count!); its last line's value, if it is a number, "
        "is taken as partial credit.")
    notebook = nbformat.read(result["notebook"], as_version=4)
    errors = [f"cell {i}: {out.ename}: {out.evalue}"[:400] for i, cell in enumerate(notebook.cells)
              if cell.cell_type == "code" for out in cell.get("outputs", []) if out.output_type == "error"]
    assert not errors, (f"graded as a class is graded ({SKIP_TAG} cells skipped), {name}'s solution fails in:\n"
                        + "\n".join(errors) + f"\nan untagged cell must not need a {SKIP_TAG} cell")


@pytest.mark.slow
@per_assignment
def test_untouched_release_scores_zero(name, kept):
    """The learner's notebook, submitted untouched, scores 0 and does not crash the grader."""
    result = result_of(name, UNTOUCHED, kept)
    assert result["score"] == 0, (
        f"the untouched release of {name} scores {result['score']}:\n{explain(result)}\n"
        "Each test must call the exercise, so that the stub's NotImplementedError fails it.")


@per_assignment
def test_expected_scores_cover_every_sample(name):
    """tests/submissions/<name>/expected.json lists exactly the sample submissions of that folder."""
    folder = SUBMISSIONS_DIR / name
    samples = {path.name for path in folder.glob("*.ipynb")}
    if not samples:
        pytest.skip(f"no sample submissions in {folder.relative_to(ROOT)}")
    expected = json.loads((folder / "expected.json").read_text()) if (folder / "expected.json").exists() else {}
    assert set(expected) == samples, (
        f"{folder.relative_to(ROOT)}/expected.json must have one entry per sample notebook: "
        f"missing {sorted(samples - set(expected))}, without a notebook {sorted(set(expected) - samples)}."
    )


@pytest.mark.slow
@pytest.mark.parametrize("name, sample", SAMPLES, ids=[f"{n}/{s}" for n, s in SAMPLES])
def test_sample_submission_gets_expected_score(name, sample, kept):
    """A sample submission gets the total and per-cell scores recorded in expected.json."""
    expected = json.loads((SUBMISSIONS_DIR / name / "expected.json").read_text()).get(sample)
    assert expected is not None, f"add {sample!r} to tests/submissions/{name}/expected.json"
    result = result_of(name, student_id(sample), kept)
    wrong = [
        f"{grade_id}: expected {points}, got {result['per_cell'].get(grade_id, 'no such cell')}"
        for grade_id, points in expected.get("per_cell", {}).items()
        if result["per_cell"].get(grade_id) != pytest.approx(points)
    ]
    if result["score"] != pytest.approx(expected["score"]):
        wrong.insert(0, f"total: expected {expected['score']}, got {result['score']}")
    assert not wrong, (
        f"tests/submissions/{name}/{sample} is graded differently than expected.json says:\n  "
        + "\n  ".join(wrong) + f"\nAll cells as graded:\n{explain(result)}\n"
        "If the chapter changed on purpose, update expected.json.")
