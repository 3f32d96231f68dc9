"""The install files agree: environment.yml, pyproject.toml and the pinned constraints."""

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _pyproject_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return {r.replace(" ", "").replace('"', "'") for r in reqs}


def _environment_requirements() -> set[str]:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "- pip:")
    reqs = set()
    for line in lines[start + 1:]:
        match = re.match(r"\s+- (.+)$", line)
        if not match:
            break
        if not match.group(1).startswith("-e"):
            reqs.add(match.group(1).replace(" ", "").replace('"', "'"))
    return reqs


def _name(req: str) -> str:
    return re.split(r"[<>=!;\[ ]", req, maxsplit=1)[0].lower()


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    py, env = _pyproject_requirements(), _environment_requirements()
    assert py == env, (
        "environment.yml and pyproject.toml list different dependencies.\n"
        f"  only in pyproject.toml: {sorted(py - env)}\n  only in environment.yml: {sorted(env - py)}"
    )


def test_every_dependency_has_a_pinned_version_for_the_cpu_setup():
    pinned = {_name(line) for line in (ROOT / "requirements/constraints.txt").read_text().splitlines()
              if line and not line.startswith("#")}
    missing = sorted({_name(r) for r in _pyproject_requirements()} - pinned)
    assert not missing, f"requirements/constraints.txt pins no version for {missing}; scripts/setup.sh installs from it"


def _pins() -> dict[str, str]:
    """requirements/constraints.txt as {name: version}; every line must be an exact name==version pin."""
    pins = {}
    for line in (ROOT / "requirements/constraints.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][0-9A-Za-z.+-]*)", line.strip())
        assert match, (f"constraints.txt line {line!r} is not an exact pin name==version: "
                       f"scripts/setup.sh needs exact ones")
        assert match.group(1).lower() not in pins, f"{match.group(1)} is pinned twice"
        pins[match.group(1).lower()] = match.group(2)
    return pins


def test_setup_pins_the_versions_that_install_together_on_cpu():
    pins = _pins()
    known = {"torch": "2.13.0", "triton": "3.7.1", "transformers": "5.24.0", "nbgrader": "0.9.6"}
    for name, version in known.items():
        assert pins.get(name) == version, (
            f"{name}=={version} is the version known to install on a CPU machine with Python 3.11, "
            f"constraints.txt has {pins.get(name)!r}")
    assert "numpy" in pins, "numpy must be listed explicitly: Triton's interpreter needs it"


def test_every_pin_satisfies_the_range_pyproject_promises():
    """A pin outside pyproject's range would make setup.sh ask pip for the impossible."""
    from packaging.requirements import Requirement

    pins = _pins()
    for req in map(Requirement, _pyproject_requirements()):
        version = pins[req.name.lower()]
        assert req.specifier.contains(version, prereleases=True), (
            f"constraints.txt pins {req.name}=={version}, outside pyproject.toml's {req.name}{req.specifier}")
