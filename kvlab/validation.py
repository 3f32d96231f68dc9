"""The argument checks every layer shares: each returns the value it accepts and names what was wrong.

Plain Python only, so the torch-free layers (core, analysis) use them too.
"""

import json
import math
import numbers


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a TypeError by Python's convention, and a ValueError like every other
    bad argument.

    Both, so callers that catch either keep working (numpy's AxisError is a ValueError and an IndexError likewise).
    """


def is_integer(value) -> bool:
    """Whether value is an integer and not a bool (True as a count or an id is always a bug)."""
    if type(value) is int:  # the common case, without the slower abstract-class check below
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int = 1) -> int:
    """value as an int if it is an integer >= minimum: ArgumentTypeError for a non-integer, ValueError for one
    too small.

    bool is an int to Python, but True as a count is always a bug, so it is refused.
    """
    if not is_integer(value):
        raise ArgumentTypeError(f"{name} must be {_int_words(minimum)}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be {_int_words(minimum)}, got {value!r}")
    return int(value)


def check_positive_int(name: str, value) -> int:
    """value if it is a positive integer (bool refused); ValueError otherwise."""
    return check_int(name, value, 1)


def check_block_size(block_size) -> int:
    """block_size if it is a positive integer; ValueError otherwise."""
    return check_int("block_size", block_size, 1)


def check_sliding_window(sliding_window) -> int | None:
    """sliding_window as an int, or None (full attention); ArgumentTypeError / ValueError for anything else.

    A window of W keys lets the query at position p see keys p - W + 1 .. p, itself included, so W = 0
    would leave it nothing to attend to: full attention is None, never 0.
    """
    if sliding_window is None:
        return None
    what = ("sliding_window must be a positive integer (the keys a query sees, itself included) or None for full "
            f"attention, got {sliding_window!r}")
    if not is_integer(sliding_window):
        raise ArgumentTypeError(f"{what} ({type(sliding_window).__name__})")
    if sliding_window < 1:
        raise ValueError(what)
    return int(sliding_window)


def check_number(name: str, value, allow_zero: bool = True, what: str = "number") -> float:
    """value if it is a finite real number >= 0 (> 0 without allow_zero); ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a finite {what}, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite {what}, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'non-negative' if allow_zero else 'positive'}, got {value!r}")
    return value


def _int_words(minimum: int) -> str:
    if minimum == 1:
        return "a positive integer"
    if minimum == 0:
        return "a non-negative integer"
    return f"an integer >= {minimum}"


def config_mapping(name: str, value, keys) -> dict:
    """A sub-config given as a dict or its JSON string (as on the command line), with only the known keys."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{name} is not JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict (or its JSON) with keys among {', '.join(keys)}, got {value!r}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ValueError(f"{name} has unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                         f"it knows {', '.join(keys)}")
    return value
