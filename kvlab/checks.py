"""Checks used by the notebooks' test cells: they say what was expected and what you returned."""

import contextlib
import dis
import io
import sys
import types

import torch


class CheckFailed(AssertionError):
    """A notebook check that failed; the message shows yours next to the expected value."""


def _short(value, limit: int = 300) -> str:
    if isinstance(value, torch.Tensor):
        text = f"tensor of shape {tuple(value.shape)}, dtype {value.dtype}"
        if value.numel() <= 12:
            text += f": {value.tolist()}"
        return text
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fail(name: str, yours, expected, hint: str | None, detail: str = "") -> None:
    lines = [f"{name}: not what was expected.", f"  Yours:    {_short(yours)}", f"  Expected: {_short(expected)}"]
    if detail:
        lines.append(f"  {detail}")
    if hint:
        lines.append(f"  Hint: {hint}")
    raise CheckFailed("\n".join(lines))


def _passed(name: str) -> None:
    print(f"✓ {name}")


def check_equal(name: str, yours, expected, hint: str | None = None) -> None:
    """Pass when yours == expected (lists, numbers, strings); otherwise show both."""
    if isinstance(yours, torch.Tensor) or isinstance(expected, torch.Tensor):
        raise TypeError("use check_close for tensors")
    if type(yours) is not type(expected) and not (
        isinstance(yours, (int, float)) and isinstance(expected, (int, float)) and not isinstance(yours, bool)
    ):
        _fail(name, yours, expected, hint,
              f"You returned a {type(yours).__name__}, expected a {type(expected).__name__}.")
    if yours != expected:
        detail = ""
        if isinstance(yours, (list, tuple)) and isinstance(expected, (list, tuple)):
            first = next((i for i, (a, b) in enumerate(zip(yours, expected)) if a != b), min(len(yours), len(expected)))
            detail = f"First difference at index {first}; lengths {len(yours)} and {len(expected)}."
        _fail(name, yours, expected, hint, detail)
    _passed(name)


def check_close(name: str, yours, expected, atol: float = 1e-5, rtol: float = 1e-4, hint: str | None = None) -> None:
    """Pass when tensors match in shape and agree within tolerance; otherwise show the largest difference."""
    if not isinstance(yours, torch.Tensor):
        _fail(name, yours, expected, hint, f"You returned a {type(yours).__name__}, expected a tensor.")
    if yours.shape != expected.shape:
        _fail(name, yours, expected, hint, f"Shapes differ: {tuple(yours.shape)} vs {tuple(expected.shape)}.")
    diff = (yours.double() - expected.double()).abs()
    if not torch.allclose(yours.double(), expected.double(), atol=atol, rtol=rtol) or diff.isnan().any():
        worst = diff.nan_to_num(nan=float("inf"))  # a NaN counts as the largest possible difference
        index = tuple(int(i) for i in torch.nonzero(worst == worst.max())[0]) if diff.numel() else ()
        largest = worst.max().item() if diff.numel() else 0.0
        _fail(name, yours, expected, hint,
              f"Largest difference {largest:.3g} at index {index} (tolerance {atol} + {rtol}·|expected|).")
    _passed(name)


def _referenced_globals(code: types.CodeType) -> set[str]:
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    names |= set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _referenced_globals(const)
    return names


def _functions_of(obj) -> list:
    if isinstance(obj, type):
        return [v for k, v in vars(obj).items()
                if isinstance(v, (types.FunctionType, staticmethod, classmethod, property))]
    return [obj]


def own_implementation(obj, *references) -> None:
    """Fail unless `obj` was written in the notebook rather than taken from kvlab's reference code.

    references: kvlab's reference functions or classes for this exercise.
    """
    name = getattr(obj, "__name__", repr(obj))
    module = getattr(obj, "__module__", "") or ""
    if any(obj is ref for ref in references) or module.startswith("kvlab"):
        raise CheckFailed(
            f"{name} is kvlab's own reference implementation (from {module}). "
            "Write the exercise yourself: a submission that imports the reference earns no points."
        )
    if isinstance(obj, type):
        for base in obj.__mro__[1:]:
            if any(base is ref for ref in references):
                raise CheckFailed(f"{name} inherits from kvlab's reference {base.__name__}; "
                                  "write it without the reference.")
    reference_names = {ref.__name__ for ref in references}
    for fn in _functions_of(obj):
        fn = getattr(fn, "__func__", None) or getattr(fn, "fget", None) or fn
        code = getattr(fn, "__code__", None)
        if code is None:
            continue
        scope = dict(fn.__globals__)
        if fn.__closure__:
            scope.update(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ if _has_contents(c))))
        for global_name in _referenced_globals(code) | set(code.co_freevars):
            value = scope.get(global_name)
            uses_reference = any(value is ref for ref in references)
            uses_module = isinstance(value, types.ModuleType) and value.__name__.startswith("kvlab") and (
                reference_names & _referenced_globals(code)
            )
            if uses_reference or uses_module:
                raise CheckFailed(
                    f"{name} calls kvlab's reference implementation ({global_name}). "
                    "Write the exercise yourself: a submission that uses the reference earns no points."
                )


def _has_contents(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


class _BoundedWriter(io.TextIOBase):
    def __init__(self, limit: int):
        self.limit, self.count, self.parts = limit, 0, []

    def write(self, text: str) -> int:
        self.count += len(text)
        if self.count > self.limit:
            raise CheckFailed(
                f"your code printed more than {self.limit:,} characters during this check; "
                "remove the print calls inside loops and run the cell again"
            )
        self.parts.append(text)
        return len(text)


@contextlib.contextmanager
def limited_output(max_chars: int = 20_000):
    """Run a check's calls with their printing capped, so a flood of output fails the check."""
    writer = _BoundedWriter(max_chars)
    with contextlib.redirect_stdout(writer), contextlib.redirect_stderr(writer):
        yield
    sys.stdout.write("".join(writer.parts))
