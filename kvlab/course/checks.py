"""Checks used by the notebooks' test cells: they say what was expected and what you returned."""

import contextlib
import dis
import functools
import io
import operator
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


class _NotPlain(Exception):
    pass


def _plain(value):
    """value rebuilt from Python's own types, so an object that redefines == cannot pass for the answer."""
    if value is None or type(value) is bool:
        return value
    if isinstance(value, int):  # int's own slot reads the number, whatever a subclass redefines
        return int.__index__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bytes):
        return memoryview(value).tobytes()
    if isinstance(value, list):
        return [_plain(item) for item in list.__iter__(value)]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in tuple.__iter__(value))
    if isinstance(value, dict):
        return {_plain(key): _plain(item) for key, item in dict.items(value)}
    if isinstance(value, (set, frozenset)):
        return frozenset(_plain(item) for item in (set.__iter__(value) if isinstance(value, set)
                                                    else frozenset.__iter__(value)))
    if isinstance(value, torch.Tensor) and value.dim() == 0:  # a scalar tensor counts as its number
        return _plain(torch.Tensor.as_subclass(value, torch.Tensor).item())
    if not isinstance(value, torch.Tensor) and hasattr(type(value), "__index__"):  # numpy integers
        return int.__index__(operator.index(value))
    raise _NotPlain(type(value).__name__)


def check_equal(name: str, yours, expected, hint: str | None = None) -> None:
    """Pass when yours == expected (lists, numbers, strings); otherwise show both.

    Both sides are compared as plain Python values, so an answer must be made of ints, floats,
    strings, lists, tuples, dicts and sets (an integer from numpy or a 0-d tensor counts as an int).
    """
    if isinstance(yours, torch.Tensor) or isinstance(expected, torch.Tensor):
        raise TypeError("use check_close for tensors")
    if type(yours) is not type(expected) and not (
        isinstance(yours, (int, float)) and isinstance(expected, (int, float)) and not isinstance(yours, bool)
    ):
        _fail(name, yours, expected, hint,
              f"You returned a {type(yours).__name__}, expected a {type(expected).__name__}.")
    try:
        mine = _plain(yours)
    except _NotPlain as err:
        _fail(name, yours, expected, hint,
              f"Your answer holds a {err}; return plain Python values (int, float, str, bytes, list, tuple, dict).")
    expected = _plain(expected)
    if mine != expected:
        detail = ""
        if isinstance(mine, (list, tuple)) and isinstance(expected, (list, tuple)):
            first = next((i for i, (a, b) in enumerate(zip(mine, expected)) if a != b), min(len(mine), len(expected)))
            detail = f"First difference at index {first}; lengths {len(mine)} and {len(expected)}."
        _fail(name, yours, expected, hint, detail)
    _passed(name)


def check_approx(name: str, yours, expected: float, abs_tol: float = 0.0, rel_tol: float = 0.0,
                 hint: str | None = None) -> None:
    """Pass when the number yours is within abs_tol or rel_tol·|expected| of expected; otherwise show both."""
    if isinstance(yours, bool) or not isinstance(yours, (int, float)):
        _fail(name, yours, expected, hint, f"You returned a {type(yours).__name__}, expected a number.")
    mine = float(_plain(yours))
    if not abs(mine - expected) <= max(abs_tol, rel_tol * abs(expected)):  # also false for NaN
        _fail(name, yours, expected, hint, f"Allowed difference: {max(abs_tol, rel_tol * abs(expected)):.3g}.")
    _passed(name)


def check_close(name: str, yours, expected, atol: float = 1e-5, rtol: float = 1e-4, hint: str | None = None) -> None:
    """Pass when tensors match in shape and agree within tolerance; otherwise show the largest difference."""
    if not isinstance(yours, torch.Tensor):
        _fail(name, yours, expected, hint, f"You returned a {type(yours).__name__}, expected a tensor.")
    # A plain tensor of its values: a subclass cannot redefine the arithmetic the comparison uses.
    yours = torch.Tensor.as_subclass(yours, torch.Tensor).detach()
    if tuple(yours.shape) != tuple(expected.shape):
        _fail(name, yours, expected, hint, f"Shapes differ: {tuple(yours.shape)} vs {tuple(expected.shape)}.")
    mine, want = yours.double().cpu(), expected.detach().double().cpu()
    diff = (mine - want).abs()
    outside = (diff > atol + rtol * want.abs()) | diff.isnan()
    if diff.numel() and bool(outside.any()):
        worst = diff.nan_to_num(nan=float("inf"))  # a NaN counts as the largest possible difference
        index = tuple(int(i) for i in torch.nonzero(worst == worst.max())[0])
        largest = worst.max().item()
        _fail(name, yours, expected, hint,
              f"Largest difference {largest:.3g} at index {index} (tolerance {atol} + {rtol}·|expected|).")
    _passed(name)


def run_case(case: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), with an exception of yours reported together with the case that caused it.

    While fn runs, the references named to `own_implementation` in this cell refuse to run.
    """
    try:
        with refusing():
            return fn(*args, **kwargs)
    except CheckFailed:
        raise
    except ReferenceRefused as err:
        raise CheckFailed(f"{case}: {err}") from None
    except Exception as err:
        raise CheckFailed(f"{case}: your code raised {type(err).__name__}: {err}") from None


def expect_raises(case: str, error: type[BaseException], fn, *args, **kwargs) -> None:
    """Pass when fn(*args, **kwargs) raises error; otherwise say what happened in this case."""
    try:
        fn(*args, **kwargs)
    except error:
        return
    except CheckFailed:
        raise
    except Exception as err:
        raise CheckFailed(f"{case}: expected {error.__name__}, your code raised {type(err).__name__}: {err}") from None
    raise CheckFailed(f"{case}: expected {error.__name__}, but nothing was raised")


# --- kvlab's references refuse to run while a learner's function is under test -----------------
#
# Reading a function's names finds a reference kept in a global, but not one kept in a partial, a
# list, a dict or an instance attribute. So, while a learner's function runs in a check, every
# reference of the exercise has its code swapped for code that raises: however the reference is
# reached, calling it fails. The swap lasts only for the call (a `finally` restores it).

_RECORDED: list = []  # the references that own_implementation was given in this cell


class ReferenceRefused(BaseException):
    """Raised when kvlab's reference runs inside a learner's function under test.

    A BaseException, so that a learner's `except Exception` cannot swallow it and hand back a
    fallback answer computed some other way.
    """


def _refusal_message(name: str) -> str:
    return (f"your code ran kvlab's reference implementation {name}, which refuses to run while your "
            "function is being checked. Write the exercise yourself: a submission that uses the reference "
            "earns no points.")


def _refusing_code(fn: types.FunctionType) -> types.CodeType | None:
    """A code object that raises ReferenceRefused, with fn's free variables so it fits fn's closure."""
    code, free = fn.__code__, fn.__code__.co_freevars
    label = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', code.co_name)}"
    lines = ["def _factory():", *(f"    {name} = None" for name in free),
             "    def refused(*args, **kwargs):"]
    if free:
        lines.append("        (" + ", ".join(free) + ",)")
    lines += ["        raise '__refused__'", "    return refused"]
    namespace: dict = {}
    exec("\n".join(lines), {}, namespace)  # noqa: S102 - our own generated code, no input in it
    made = namespace["_factory"]().__code__
    if made.co_freevars != free:
        return None
    # The raised error is a constant of the code: the swapped code runs with fn's module globals.
    error = ReferenceRefused(_refusal_message(label))
    consts = tuple(error if c == "__refused__" else c for c in made.co_consts)
    return made.replace(co_name=code.co_name, co_qualname=code.co_qualname, co_consts=consts)


def _guarded_targets(reference) -> list:
    """The plain functions and Triton kernels whose running means `reference` ran."""
    if isinstance(reference, functools.partial):
        return _guarded_targets(reference.func)
    if isinstance(reference, types.MethodType):
        return _guarded_targets(reference.__func__)
    if isinstance(reference, (staticmethod, classmethod)):
        return _guarded_targets(reference.__func__)
    if isinstance(reference, property):
        return [t for f in (reference.fget, reference.fset, reference.fdel) if f for t in _guarded_targets(f)]
    if isinstance(reference, types.FunctionType):
        return [reference]
    if isinstance(reference, type):
        found = []
        for value in vars(reference).values():
            found += _guarded_targets(value)
        return found
    if callable(getattr(reference, "run", None)) and isinstance(getattr(reference, "fn", None), types.FunctionType):
        return [reference]  # a @triton.jit kernel: its launches go through .run
    return []


@contextlib.contextmanager
def refusing(*references):
    """Within the block, calling any of references (default: those recorded by own_implementation) raises."""
    targets, seen = [], set()
    for reference in references or _RECORDED:
        for target in _guarded_targets(reference):
            if id(target) not in seen:
                seen.add(id(target))
                targets.append(target)
    undo = []
    try:
        for target in targets:
            if isinstance(target, types.FunctionType):
                code = _refusing_code(target)
                if code is None:
                    continue
                undo.append((target, "__code__", target.__code__, True))
                target.__code__ = code
            else:
                label = getattr(target.fn, "__qualname__", repr(target))
                had = "run" in vars(target)
                undo.append((target, "run", vars(target).get("run"), had))
                target.run = functools.partial(_refuse_call, label)
        yield
    finally:
        for target, attr, value, had in reversed(undo):
            if had:
                setattr(target, attr, value)
            else:
                delattr(target, attr)


def _refuse_call(label, *args, **kwargs):
    raise ReferenceRefused(_refusal_message(label))


def _referenced_globals(code: types.CodeType) -> set[str]:
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    names |= set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _referenced_globals(const)
    return names


def _string_constants(code: types.CodeType) -> set[str]:
    found = {const for const in code.co_consts if isinstance(const, str)}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _string_constants(const)
    return found


# Names that look code up by a string or through another object's namespace. A reference reached
# this way escapes a check that reads names, so exercise code may not use them at all.
_DYNAMIC_LOOKUPS = {
    "__import__", "import_module", "__globals__", "f_globals", "f_back", "eval", "exec", "compile",
    "__builtins__", "__subclasses__", "__closure__", "__code__", "find_spec", "spec_from_file_location",
    "module_from_spec", "exec_module", "load_module", "run_path", "run_module", "get_objects", "getmembers",
}
# Harmless on the learner's own objects; a way around the check when kvlab or sys is in reach.
_ATTRIBUTE_LOOKUPS = {"getattr", "vars", "__dict__", "globals", "locals", "__getattribute__", "attrgetter",
                      "methodcaller", "modules"}


def _functions_of(obj) -> list:
    if isinstance(obj, type):
        return [v for k, v in vars(obj).items()
                if isinstance(v, (types.FunctionType, staticmethod, classmethod, property))]
    return [obj]


def _from_kvlab(value) -> bool:
    if isinstance(value, types.ModuleType):
        return value.__name__.split(".")[0] == "kvlab"
    module = getattr(value, "__module__", None)
    return isinstance(module, str) and module.split(".")[0] == "kvlab"


def own_implementation(obj, *references) -> None:
    """Fail unless `obj` was written in the notebook rather than taken from kvlab's reference code.

    references: kvlab's reference functions or classes for this exercise. The functions and classes
    of the notebook that `obj` calls are read too, and so are their default arguments and closures.
    """
    _RECORDED[:] = references
    name = getattr(obj, "__name__", repr(obj))
    module = getattr(obj, "__module__", "") or ""
    if any(obj is ref for ref in references) or _from_kvlab(obj):
        raise CheckFailed(
            f"{name} is kvlab's own reference implementation (from {module}). "
            "Write the exercise yourself: a submission that imports the reference earns no points."
        )
    reference_names = {getattr(ref, "__name__", "") for ref in references} - {""}

    def is_reference(value) -> bool:
        return any(value is ref for ref in references) or (
            _from_kvlab(value) and getattr(value, "__name__", None) in reference_names)

    def fail(where: str, why: str) -> None:
        raise CheckFailed(f"{name} {why} ({where}). Write the exercise yourself: a submission that "
                          "uses the reference earns no points.")

    pending, seen = [obj], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        label = getattr(current, "__qualname__", getattr(current, "__name__", repr(current)))
        if isinstance(current, type):
            for base in current.__mro__[1:]:
                if is_reference(base) or _from_kvlab(base):
                    raise CheckFailed(f"{label} inherits from kvlab's {base.__name__}; "
                                      "write it without kvlab's classes.")
            for attr, value in vars(current).items():
                if is_reference(value):
                    fail(f"{label}.{attr}", "keeps kvlab's reference implementation as an attribute")
        for fn in _functions_of(current):
            fn = getattr(fn, "__func__", None) or getattr(fn, "fget", None) or fn
            code = getattr(fn, "__code__", None)
            if code is None:
                continue
            if _from_kvlab(fn) or is_reference(fn):
                fail(label, f"calls kvlab's reference implementation ({getattr(fn, '__qualname__', fn)})")
            scope = dict(fn.__globals__)
            if fn.__closure__:
                scope.update(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ if _has_contents(c))))
            names = _referenced_globals(code)
            values = {n: scope[n] for n in names | set(code.co_freevars) if n in scope}
            defaults = list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values())
            dynamic = sorted(names & _DYNAMIC_LOOKUPS)
            if dynamic:
                fail(label, f"looks code up by name with {', '.join(dynamic)}")
            kvlab_strings = [s for s in _string_constants(code) if "kvlab" in s or s in reference_names]
            in_reach = [v for v in [*values.values(), *defaults]
                        if _from_kvlab(v) or v is sys or (isinstance(v, types.ModuleType) and v.__name__ in
                                                           ("importlib", "builtins", "inspect", "gc", "operator"))]
            lookups = sorted(names & _ATTRIBUTE_LOOKUPS)
            if lookups and (in_reach or kvlab_strings):
                fail(label, f"reaches into kvlab or sys with {', '.join(lookups)}")
            if kvlab_strings and in_reach:
                fail(label, f"names kvlab code in a string ({kvlab_strings[0]!r})")
            for global_name, value in [*values.items(), *(("a default argument", d) for d in defaults)]:
                uses_module = isinstance(value, types.ModuleType) and _from_kvlab(value) and (reference_names & names)
                if is_reference(value) or uses_module:
                    fail(global_name, "calls kvlab's reference implementation")
                if (isinstance(value, (types.FunctionType, type)) and not _from_kvlab(value)
                        and getattr(value, "__module__", None) == getattr(fn, "__module__", None)):
                    pending.append(value)  # a helper written in the notebook: read it too


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
