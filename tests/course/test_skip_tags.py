"""Cells tagged skip-autograde (a chapter's measurements) are skipped by nbgrader and by nothing else, and
grading never depends on them.

A learner's Run All executes every cell; nbgrader's autograde and validate skip the tagged ones
(nbgrader_config.py), so grading a class costs the exercises, not the chapter's experiments. That is
safe only if nothing graded can notice: a tagged cell imports nothing (a learner's own code may use any
module imported above it) and binds no name that a later untagged cell reads, and a submission cannot
skip its own test cells by tagging them.
"""

import ast
import builtins
import json
from pathlib import Path

import nbformat
import pytest
from traitlets.config.loader import PyFileConfigLoader

ROOT = Path(__file__).resolve().parents[2]
TAG = "skip-autograde"
NOTEBOOKS = sorted(ROOT.glob("solutions/*/*.ipynb")) + sorted(ROOT.glob("notebooks/*/*.ipynb"))
IPYTHON_NAMES = {"display", "get_ipython", "In", "Out"}


def tagged(cell) -> bool:
    return TAG in cell.metadata.get("tags", [])


def code_of(cell) -> str:
    """The cell's Python, IPython's %magics and !shell lines left out."""
    return "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))


def bound_and_read(source: str) -> tuple[set[str], set[str]]:
    """Names a cell binds anywhere (assignments, loops, defs, arguments, imports) and names it reads."""
    bound, read = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound, read


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[str(p.relative_to(ROOT)) for p in NOTEBOOKS])
def test_tagged_cells_are_plain_code_cells_without_imports(path):
    for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if not tagged(cell):
            continue
        where = f"{path.relative_to(ROOT)}, cell {index}"
        assert cell.cell_type == "code", (
            f"{where}: only code cells run; the {TAG} tag means nothing on a {cell.cell_type} cell")
        assert not cell.metadata.get("nbgrader"), (
            f"{where} is an nbgrader cell (solution, test or locked): grading must run it, so it cannot carry {TAG}")
        imports = [node for node in ast.walk(ast.parse(code_of(cell)))
                   if isinstance(node, (ast.Import, ast.ImportFrom))]
        assert not imports, (
            f"{where} imports {ast.unparse(imports[0])!r} but is skipped when grading: a learner's solution below it "
            "may use that name and would fail only under the grader. Move the import to an untagged cell above.")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[str(p.relative_to(ROOT)) for p in NOTEBOOKS])
def test_untagged_cells_read_nothing_that_only_a_tagged_cell_binds(path):
    cells = [(index, cell) for index, cell in enumerate(nbformat.read(path, as_version=4).cells)
             if cell.cell_type == "code"]
    binders: dict[str, list[tuple[int, bool]]] = {}   # name -> [(cell index, tagged)] in notebook order
    problems = []
    known = set(dir(builtins)) | IPYTHON_NAMES
    for index, cell in cells:
        bound, read = bound_and_read(code_of(cell))
        if not tagged(cell):
            for name in sorted(read - bound - known):
                sources = binders.get(name, [])
                if sources and all(is_tagged for _, is_tagged in sources):
                    problems.append(f"cell {index} reads {name!r}, bound only in tagged cell(s) "
                                    f"{[i for i, _ in sources]}")
        for name in bound:
            binders.setdefault(name, []).append((index, tagged(cell)))
    assert not problems, (
        f"{path.relative_to(ROOT)}: nbgrader skips the {TAG} cells, so these untagged cells would fail when graded "
        "(untag the cell that binds the name, or tag the reader too):\n  " + "\n  ".join(problems))


def test_release_keeps_the_solutions_tags():
    for solution in sorted(ROOT.glob("solutions/*/*.ipynb")):
        release = ROOT / "notebooks" / solution.parent.name / solution.name
        want = [code_of(c) for c in nbformat.read(solution, as_version=4).cells if tagged(c)]
        have = [code_of(c) for c in nbformat.read(release, as_version=4).cells if tagged(c)]
        assert have == want, f"{release.relative_to(ROOT)} does not tag the same cells as {solution.relative_to(ROOT)}"


def config():
    return PyFileConfigLoader("nbgrader_config.py", path=str(ROOT)).load_config()


def test_nbgrader_skips_the_tag_when_it_executes():
    assert config().Execute.skip_cells_with_tag == TAG, "nbgrader_config.py must make nbgrader's Execute skip the tag"


def test_a_submission_cannot_skip_its_own_test_cells():
    """The sanitizing step drops the tag from every nbgrader cell and leaves plain cells' tags alone."""
    steps = config().Autograde.sanitize_preprocessors
    honour = steps[-1]
    assert honour.__name__ == "HonourSkipTagOutsideGradedCells", "the tag filter must run last, after OverwriteCells"
    test_cell = nbformat.v4.new_code_cell("assert answer() == 42", metadata={
        "tags": [TAG, "other"], "nbgrader": {"grade": True, "grade_id": "t", "points": 1, "solution": False}})
    solution_cell = nbformat.v4.new_code_cell("def answer(): ...", metadata={
        "tags": [TAG], "nbgrader": {"grade": False, "grade_id": "s", "solution": True}})
    measurement = nbformat.v4.new_code_cell("sweep()", metadata={"tags": [TAG]})
    notebook = nbformat.v4.new_notebook(cells=[test_cell, solution_cell, measurement])
    step = honour()
    assert step.enabled, "nbconvert runs a preprocessor only if it is enabled"
    notebook, _ = step(notebook, {})
    assert [c.metadata.get("tags") for c in notebook.cells] == [["other"], [], [TAG]], json.dumps(
        [c.metadata for c in notebook.cells])
