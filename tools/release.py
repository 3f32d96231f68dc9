"""Regenerate the learner notebooks in notebooks/ from the instructor notebooks in solutions/.

Usage, from anywhere in the repository:

    python tools/release.py            # normalise solutions/, rebuild notebooks/ with nbgrader
    python tools/release.py --check    # change nothing; exit 1 and name the files that differ
    python tools/release.py 01_kv_cache  # only these assignments

An assignment is a folder solutions/<name>/ holding <name>.ipynb and any files the notebook
needs; nbgrader's generate_assignment runs in a temporary course directory (so no gradebook.db
appears in the repository) and its output replaces notebooks/<name>/.

The module also holds the scratch-course helpers that the tests and benchmarks/notebooks.py use
to autograde submissions with the repository's nbgrader_config.py.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path

import nbformat

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE = "solutions"
RELEASE = "notebooks"
# Editor and cache litter that must neither be released nor counted as a difference.
IGNORED = (".ipynb_checkpoints", "__pycache__", "*.pyc", ".DS_Store", ".virtual_documents")
DEFAULT_KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
# Cell metadata that only records when a cell last ran.
VOLATILE_CELL_METADATA = ("execution", "ExecuteTime")


class ReleaseError(RuntimeError):
    """nbgrader could not generate or grade an assignment."""


# --- Normalising notebooks -----------------------------------------------------------------


def normalise(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Strip outputs, execution counts and machine-specific metadata from nb, in place."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        for key in VOLATILE_CELL_METADATA:
            cell.metadata.pop(key, None)
    kernelspec = dict(nb.metadata.get("kernelspec") or DEFAULT_KERNELSPEC)
    language = nb.metadata.get("language_info", {}).get("name", kernelspec.get("language", "python"))
    nb.metadata = nbformat.from_dict({"kernelspec": kernelspec, "language_info": {"name": language}})
    return nb


def dumps(nb: nbformat.NotebookNode) -> str:
    """Serialise nb the stable way: indent 1, sorted keys, trailing newline."""
    text = nbformat.writes(nb, version=4, indent=1, sort_keys=True)
    return text if text.endswith("\n") else text + "\n"


def normalised_bytes(path: Path) -> bytes:
    """Return the bytes path would have once normalised."""
    return dumps(normalise(nbformat.read(path, as_version=4))).encode("utf-8")


# --- Discovering files ---------------------------------------------------------------------


def is_ignored(relpath: Path) -> bool:
    """Whether any part of relpath matches an IGNORED pattern."""
    return any(fnmatch(part, pattern) for part in relpath.parts for pattern in IGNORED)


def assignments(repo_root: Path = REPO_ROOT) -> list[str]:
    """Names of the folders solutions/*/ that hold a notebook, sorted."""
    return sorted(
        folder.name
        for folder in (Path(repo_root) / SOURCE).glob("*/")
        if folder.is_dir() and not is_ignored(Path(folder.name)) and any(folder.glob("*.ipynb"))
    )


def files_under(folder: Path) -> dict[str, Path]:
    """Map relative path (posix) to path for every non-ignored file below folder."""
    if not folder.is_dir():
        return {}
    return {
        path.relative_to(folder).as_posix(): path
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not is_ignored(path.relative_to(folder))
    }


# --- A scratch nbgrader course -------------------------------------------------------------


def course_config(repo_root: Path, course_root: Path, timeout: int | None = None):
    """Load repo_root/nbgrader_config.py, re-rooted to course_root (optionally with a new timeout)."""
    from traitlets.config.loader import PyFileConfigLoader

    cfg = PyFileConfigLoader("nbgrader_config.py", path=str(repo_root)).load_config()
    cfg.CourseDirectory.root = str(course_root)
    (Path(course_root) / "grading").mkdir(parents=True, exist_ok=True)
    cfg.CourseDirectory.db_url = "sqlite:///" + str(Path(course_root) / "grading" / "gradebook.db")
    if timeout is not None:
        cfg.Execute.timeout = int(timeout)
    cfg.NbGraderAPI.log_level = "WARN"  # the API's INFO log is one line per copied file
    return cfg


@contextmanager
def scratch_course(repo_root: Path, names: list[str], timeout: int | None = None):
    """Yield (course_root, NbGraderAPI) for a temporary course holding normalised copies of names."""
    from nbgrader.apps import NbGraderAPI

    # nbgrader's gradebook runs the `alembic` command: find it next to this Python even when the
    # virtualenv is not activated (python tools/release.py run as .venv/bin/python).
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    with tempfile.TemporaryDirectory(prefix="kvlab-course-") as tmp:
        course = Path(tmp)
        for name in names:
            for rel, path in files_under(Path(repo_root) / SOURCE / name).items():
                dest = course / SOURCE / name / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                if path.suffix == ".ipynb":
                    dest.write_bytes(normalised_bytes(path))
                else:
                    shutil.copy2(path, dest)
        # nbgrader needs a gradebook even to generate (its no_database option still queries one):
        # keep it in the temporary folder, never in the repository.
        cfg = course_config(repo_root, course, timeout)
        # An exchange of its own, or NbGraderAPI logs a CRITICAL about /usr/local/share/nbgrader.
        (course / "exchange").mkdir()
        cfg.Exchange.root = str(course / "exchange")
        yield course, NbGraderAPI(config=cfg)


def generate(api, name: str) -> None:
    """Run nbgrader generate_assignment for name, raising ReleaseError with nbgrader's log."""
    result = api.generate_assignment(name, force=True, create=True)
    if not result["success"]:
        log = result.get("log", "") + "\n" + result.get("error", "")
        # The cause hides in a traceback inside the log: put its last line first.
        causes = [line.strip() for line in log.splitlines()
                  if re.match(r"\s*[\w.]+(Error|Exception|Entry): ", line) and "NbGraderException" not in line]
        raise ReleaseError(
            f"nbgrader generate_assignment {name} failed: {' / '.join(causes) or 'see the log below'}\n"
            f"Fix the nbgrader cell metadata or markers in solutions/{name}/ (Create Assignment "
            f"toolbar in JupyterLab). nbgrader's log:\n{log}"
        )


# --- The release ---------------------------------------------------------------------------


def expected_files(repo_root: Path = REPO_ROOT, names: list[str] | None = None) -> dict[str, bytes]:
    """What solutions/<name>/*.ipynb and notebooks/<name>/ should hold, by repo-relative path."""
    repo_root = Path(repo_root)
    names = assignments(repo_root) if names is None else names
    want: dict[str, bytes] = {}
    for name in names:
        for rel, path in files_under(repo_root / SOURCE / name).items():
            if path.suffix == ".ipynb":
                want[f"{SOURCE}/{name}/{rel}"] = normalised_bytes(path)
    if not names:
        return want
    with scratch_course(repo_root, names) as (course, api):
        for name in names:
            generate(api, name)
            for rel, path in files_under(course / RELEASE / name).items():
                data = normalised_bytes(path) if path.suffix == ".ipynb" else path.read_bytes()
                want[f"{RELEASE}/{name}/{rel}"] = data
    return want


def actual_files(repo_root: Path, names: list[str]) -> dict[str, bytes]:
    """What solutions/<name>/*.ipynb and notebooks/<name>/ hold now, by repo-relative path."""
    have: dict[str, bytes] = {}
    for name in names:
        for rel, path in files_under(Path(repo_root) / SOURCE / name).items():
            if path.suffix == ".ipynb":
                have[f"{SOURCE}/{name}/{rel}"] = path.read_bytes()
        for rel, path in files_under(Path(repo_root) / RELEASE / name).items():
            have[f"{RELEASE}/{name}/{rel}"] = path.read_bytes()
    return have


def stale_releases(repo_root: Path) -> list[str]:
    """Folders notebooks/<name>/ whose solutions/<name>/ is gone."""
    names = set(assignments(repo_root))
    release = Path(repo_root) / RELEASE
    return sorted(
        f"{RELEASE}/{folder.name}/"
        for folder in release.glob("*/")
        if folder.is_dir() and folder.name not in names and not is_ignored(Path(folder.name))
    )


def differences(repo_root: Path = REPO_ROOT, names: list[str] | None = None) -> list[str]:
    """Repo-relative paths that `python tools/release.py` would create, change or delete."""
    everything = names is None
    names = assignments(repo_root) if everything else names
    want, have = expected_files(repo_root, names), actual_files(repo_root, names)
    changed = sorted(path for path in want.keys() | have.keys() if want.get(path) != have.get(path))
    return changed + (stale_releases(repo_root) if everything else [])


def release_all(repo_root: Path = REPO_ROOT, names: list[str] | None = None) -> list[str]:
    """Normalise solutions/ in place and rewrite notebooks/; return the paths that changed."""
    repo_root = Path(repo_root)
    everything = names is None
    names = assignments(repo_root) if everything else names
    want, have = expected_files(repo_root, names), actual_files(repo_root, names)
    changed = []
    for rel in sorted(want.keys() | have.keys()):
        if want.get(rel) == have.get(rel):
            continue
        changed.append(rel)
        path = repo_root / rel
        if rel in want:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(want[rel])
        else:
            path.unlink()  # released before, no longer produced by nbgrader
    for folder in stale_releases(repo_root) if everything else []:
        shutil.rmtree(repo_root / folder)
        changed.append(folder)
    return changed


# --- Executing and grading (used by the tests and benchmarks/notebooks.py) ----------------


def execute(path: Path, timeout: int = 300, kernel_name: str = "python3") -> nbformat.NotebookNode:
    """Run the notebook at path headless in its own folder and return the executed copy."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=timeout, kernel_name=kernel_name,
        resources={"metadata": {"path": str(Path(path).parent)}},
    )
    client.execute()
    return nb


def grade(repo_root: Path, name: str, submissions: dict[str, Path], timeout: int = 30,
          keep: Path | None = None) -> dict:
    """Autograde submissions ({student: notebook path}) of assignment name in one nbgrader pass.

    Returns {"ok", "log", "generate_s", "autograde_s", "students": {student: {"graded", "score",
    "max_score", "per_cell": {grade_id: score}, "messages": {grade_id: first error}}}};
    "graded" is False when nbgrader gave up on that submission (its kernel died, say).
    With keep, the autograded notebooks are copied to keep/<student>/ for inspection.
    """
    from nbgrader.api import Gradebook, MissingEntry

    with scratch_course(repo_root, [name], timeout=timeout) as (course, api):
        start = time.perf_counter()
        generate(api, name)
        generated = time.perf_counter()
        for student, path in submissions.items():
            dest = course / "grading" / "submitted" / student / name / f"{name}.ipynb"
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, dest)
        result = api.autograde(name, "*")  # one pass over every student
        graded = time.perf_counter()
        report = {
            "ok": result["success"],
            "log": result.get("log", "") + result.get("error", ""),
            "generate_s": generated - start,
            "autograde_s": graded - generated,
            "students": {},
        }
        with Gradebook(api.coursedir.db_url) as gb:
            for student in submissions:
                out = course / "grading" / "autograded" / student / name / f"{name}.ipynb"
                try:
                    sub = gb.find_submission(name, student)
                except MissingEntry:
                    report["students"][student] = {"graded": False, "score": None,
                                                   "max_score": None, "per_cell": {}, "messages": {}}
                    continue
                per_cell = {g.name: g.score for nb in sub.notebooks for g in nb.grades}
                report["students"][student] = {
                    "graded": out.exists(), "score": sub.score, "max_score": sub.max_score,
                    "per_cell": per_cell, "messages": cell_messages(out) if out.exists() else {},
                }
        if keep is not None:
            shutil.copytree(course / "grading" / "autograded", keep, dirs_exist_ok=True)
        return report


def cell_messages(path: Path) -> dict[str, str]:
    """Map grade_id to a one-line account of what a graded cell of the notebook at path showed."""
    messages = {}
    for cell in nbformat.read(path, as_version=4).cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if not (grade_id and cell.metadata["nbgrader"].get("grade")):
            continue
        for out in cell.get("outputs", []):
            if out.output_type == "error":
                messages[grade_id] = f"{out.ename}: {out.evalue}"[:300]
            elif out.output_type == "stream" and out.name == "stderr":
                messages[grade_id] = "wrote to stderr (nbgrader scores that zero): " + out.text[:200]
            elif out.output_type == "execute_result":
                messages[grade_id] = "partial credit " + out.data.get("text/plain", "")[:50]
            else:
                continue
            break  # nbgrader grades by the first such output, so report that one
    return messages


# --- Command line --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run the release, or with --check report what it would change."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="assignments to release (default: all)")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if solutions/ or notebooks/ are out of date")
    parser.add_argument("--repo-root", type=Path, default=REPO_ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = args.names or None
    found = assignments(args.repo_root)
    unknown = sorted(set(args.names) - set(found))
    if unknown:
        parser.error(f"no solutions/<name>/<name>.ipynb for {', '.join(unknown)}; found: {found}")
    try:
        paths = differences(args.repo_root, names) if args.check else release_all(args.repo_root, names)
    except ReleaseError as err:
        print(err, file=sys.stderr)
        return 2
    if args.check:
        if paths:
            print("These files are not what `python tools/release.py` produces from solutions/:",
                  *(f"  {p}" for p in paths), "Run `python tools/release.py` and commit the result.",
                  sep="\n", file=sys.stderr)
            return 1
        print(f"release up to date ({len(found if names is None else names)} assignment(s))")
        return 0
    print("\n".join(f"updated {p}" for p in paths) or "nothing to update")
    return 0


if __name__ == "__main__":
    sys.exit(main())
