"""nbgrader configuration for the kvlab course: run nbgrader from the repository root.

Release (prefer `python tools/release.py`, which also normalises the notebook JSON):
    nbgrader generate_assignment 01_kv_cache --force      # solutions/ -> notebooks/
Grade:
    # put each submission at grading/submitted/<student>/01_kv_cache/01_kv_cache.ipynb
    nbgrader autograde 01_kv_cache
    nbgrader generate_feedback 01_kv_cache                # HTML under grading/feedback/

Everything nbgrader writes besides notebooks/ (submissions, autograded copies, feedback and
gradebook.db) goes under grading/, which git ignores. The per-cell time limit is 60 s; raise it
with KVLAB_CELL_TIMEOUT=120 or `--Execute.timeout=120` on the command line.
"""

import os

from nbformat.v4 import new_output
from nbgrader.converters import Autograde
from nbgrader.preprocessors import LimitOutput, NbGraderPreprocessor
from nbgrader.utils import is_grade
from traitlets import Integer

c = get_config()  # noqa: F821 (traitlets provides get_config when it loads this file)

ROOT = os.path.dirname(os.path.abspath(__file__))

# --- Where things live -------------------------------------------------------------------
# Paths are relative to the root, so tools/release.py and the tests can reuse this file for a
# scratch course by setting only `root` and `db_url`.
c.CourseDirectory.root = ROOT
c.CourseDirectory.source_directory = "solutions"  # instructor notebooks (the nbgrader source)
c.CourseDirectory.release_directory = "notebooks"  # what learners open, committed to git
c.CourseDirectory.submitted_directory = "grading/submitted"
c.CourseDirectory.autograded_directory = "grading/autograded"
c.CourseDirectory.feedback_directory = "grading/feedback"
c.CourseDirectory.solution_directory = "grading/solution"
c.CourseDirectory.source_with_tests_directory = "grading/source_with_tests"
# The gradebook holds learners' grades: keep it out of the repo root and out of git.
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(ROOT, "grading", "gradebook.db")
# SQLite creates the file but not its folder: without this a fresh clone fails at the first
# generate_assignment with "unable to open database file".
os.makedirs(os.path.join(ROOT, "grading"), exist_ok=True)

# --- Executing submissions (autograde and validate) --------------------------------------
# One runaway cell must cost a bounded time, not hang the whole grading run.
c.Execute.timeout = int(os.environ.get("KVLAB_CELL_TIMEOUT", "60"))
# On timeout interrupt the kernel (KeyboardInterrupt) and go on with the next cell, instead of
# aborting the submission; the timed-out cell gets the error below, so its test scores zero.
c.Execute.interrupt_on_timeout = True
c.Execute.error_on_timeout = {
    "ename": "CellTimeoutError",
    "evalue": "the cell ran past the per-cell time limit",
    "traceback": [
        "CellTimeoutError: the cell ran past the per-cell time limit (Execute.timeout); "
        "look for an infinite loop or a much too large input",
    ],
}
# nbgrader's default (True) abandons the whole submission, points already earned included, when
# the kernel ignores the interrupt (a long C call such as sum(range(10**12))) or its output
# lags more than iopub_timeout behind. False only logs a warning and grades on: earlier
# exercises keep their points, and each later cell costs at most one timeout.
c.Execute.raise_on_iopub_timeout = False
# Errors in a cell never stop the run: nbgrader's Execute hard-codes allow_errors=True, so a
# cell that raises only zeroes the test cells that depend on it.

# Measurements that earn no points (a load ramp, a sweep of batch sizes) carry the cell tag
# "skip-autograde": the learner's Run All runs them, nbgrader's autograde and validate do not, so
# grading a class costs the exercises and their tests, not the chapter's experiments. Such a cell
# imports nothing and defines nothing that a later untagged cell uses (tests/course/test_skip_tags.py).
SKIP_TAG = "skip-autograde"
c.Execute.skip_cells_with_tag = SKIP_TAG


class LimitOutputOrFail(LimitOutput):
    """LimitOutput that also caps characters and zeroes a test cell whose output was cut."""

    max_chars = Integer(
        100_000, help="maximum number of characters of stream output per cell (-1: no limit)"
    ).tag(config=True)

    def preprocess_cell(self, cell, resources, cell_index):
        if cell.cell_type != "code":
            return cell, resources
        text = "".join(out.text for out in cell.outputs if out.output_type == "stream")
        too_many_lines = self.max_lines >= 0 and text.count("\n") > self.max_lines
        too_many_chars = self.max_chars >= 0 and len(text) > self.max_chars
        cell, resources = super().preprocess_cell(cell, resources, cell_index)
        if too_many_chars:
            # LimitOutput counts lines only, so one 10-million-character line would survive it.
            budget = self.max_chars
            for out in cell.outputs:
                if out.output_type == "stream":
                    out.text = out.text[:budget]
                    budget -= len(out.text)
        if (too_many_lines or too_many_chars) and is_grade(cell):
            # A test cell that floods the output is a failed test: printing is not the task, and
            # a huge notebook would break the feedback pages.
            # First in the list: nbgrader grades by the first error or result it finds.
            cell.outputs.insert(0, new_output(
                "error", ename="OutputLimitExceeded",
                evalue=f"more than {self.max_lines} lines or {self.max_chars} characters",
                traceback=[
                    f"OutputLimitExceeded: this test printed {len(text)} characters in "
                    f"{text.count(chr(10))} lines (limits: {self.max_chars} characters, "
                    f"{self.max_lines} lines); remove the debugging prints",
                ],
            ))
        return cell, resources


class HonourSkipTagOutsideGradedCells(NbGraderPreprocessor):
    """Drop the skip tag from every cell nbgrader grades or restores: a submission that tags its own
    test cells (so that they would not run, and nbgrader would count a silent test as passed) is
    graded as if it had not. (An NbGraderPreprocessor: nbconvert's plain Preprocessor is disabled by default.)"""

    def preprocess_cell(self, cell, resources, cell_index):
        tags = cell.metadata.get("tags")
        if tags and SKIP_TAG in tags and cell.metadata.get("nbgrader"):
            cell.metadata["tags"] = [tag for tag in tags if tag != SKIP_TAG]
        return cell, resources


# Keep the outputs stored in autograded notebooks and feedback small: enough to debug with.
c.LimitOutput.max_lines = 1000
c.LimitOutput.max_traceback = 100
c.LimitOutputOrFail.max_chars = 100_000
# Same pipeline as nbgrader's default, with the stricter output limit in LimitOutput's place.
_default_steps = Autograde.class_traits()["autograde_preprocessors"].default()
assert LimitOutput in _default_steps, "nbgrader changed its autograde pipeline: update this file"
c.Autograde.autograde_preprocessors = [
    LimitOutputOrFail if step is LimitOutput else step for step in _default_steps
]
# After OverwriteCells, which restores the graded cells' source but keeps the submission's tags.
c.Autograde.sanitize_preprocessors = [
    *Autograde.class_traits()["sanitize_preprocessors"].default(), HonourSkipTagOutsideGradedCells
]
