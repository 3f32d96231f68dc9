"""Time each chapter's notebook: headless execution of the solutions and nbgrader autograding.

Usage, from anywhere in the repository:

    python benchmarks/notebooks.py                        # every solutions/<chapter>/
    python benchmarks/notebooks.py --chapters 01_kv_cache
    python benchmarks/notebooks.py --strict               # exit 1 when a target is missed

For each chapter it reports the wall time to run solutions/<chapter>/<chapter>.ipynb top to
bottom with nbclient (target: 60 s, so a learner's Run All stays short) and to autograde that
notebook as one submission of the chapter with the repository's nbgrader_config.py (target:
15 s, so grading a class stays cheap). nbgrader's generate_assignment, needed once per
chapter rather than per submission, is timed separately and has no target.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kvlab_release_tool", ROOT / "tools" / "release.py")
release = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(release)

EXECUTE_TARGET_S = 60.0
AUTOGRADE_TARGET_S = 15.0


def measure(name: str, cell_timeout: int) -> dict:
    """Execute and autograde the solutions notebook of chapter name; return the timings in seconds."""
    notebook = ROOT / release.SOURCE / name / f"{name}.ipynb"
    start = time.perf_counter()
    error = None
    try:
        release.execute(notebook, timeout=cell_timeout)
    except Exception as err:  # still time the grader; report the failure in the table
        error = f"execution failed: {type(err).__name__}"
    execute_s = time.perf_counter() - start
    graded = release.grade(ROOT, name, {"benchmark": notebook}, timeout=cell_timeout)
    student = graded["students"]["benchmark"]
    if not graded["ok"] or student["score"] != student["max_score"]:
        error = error or f"autograde scored {student['score']} of {student['max_score']}"
    return {
        "chapter": name, "execute_s": execute_s, "autograde_s": graded["autograde_s"],
        "generate_s": graded["generate_s"], "error": error,
    }


def verdict(seconds: float, target: float) -> str:
    """'ok' within the target, else how far over it."""
    return "ok" if seconds <= target else f"OVER by {seconds - target:.1f} s"


def table(rows: list[dict]) -> str:
    """The timings as a fixed-width text table with the targets."""
    width = max([len("chapter")] + [len(r["chapter"]) for r in rows])
    head = (f"{'chapter':<{width}}  {'execute':>8}  {'target':>6}  {'':<15}  "
            f"{'autograde':>9}  {'target':>6}  {'':<15}  {'generate':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['chapter']:<{width}}  {r['execute_s']:>6.1f} s  {EXECUTE_TARGET_S:>4.0f} s  "
            f"{verdict(r['execute_s'], EXECUTE_TARGET_S):<15}  "
            f"{r['autograde_s']:>7.1f} s  {AUTOGRADE_TARGET_S:>4.0f} s  "
            f"{verdict(r['autograde_s'], AUTOGRADE_TARGET_S):<15}  {r['generate_s']:>6.1f} s"
            + (f"  ({r['error']})" if r["error"] else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure the chosen chapters and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chapters", nargs="+", metavar="NAME",
                        help="chapters to measure (default: every folder in solutions/)")
    parser.add_argument("--cell-timeout", type=int, default=300,
                        help="per-cell time limit in seconds, for execution and grading (default 300)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a chapter misses a target")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the timings as JSON")
    args = parser.parse_args(argv)
    found = release.assignments(ROOT)
    chapters = args.chapters or found
    unknown = sorted(set(chapters) - set(found))
    if unknown:
        parser.error(f"no solutions/<name>/<name>.ipynb for {', '.join(unknown)}; found: {found}")
    if not chapters:
        print("no chapter in solutions/ yet: nothing to measure")
        return 0
    rows = []
    for name in chapters:
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        rows.append(measure(name, args.cell_timeout))
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    missed = any(
        r["error"] or r["execute_s"] > EXECUTE_TARGET_S or r["autograde_s"] > AUTOGRADE_TARGET_S
        for r in rows
    )
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
