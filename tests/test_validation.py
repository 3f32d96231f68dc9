"""The shared argument checks: one wording and one exception rule for every layer."""

import math

import pytest

from kvlab.validation import (
    ArgumentTypeError,
    check_block_size,
    check_int,
    check_number,
    check_positive_int,
    check_sliding_window,
)


@pytest.mark.parametrize("value", [2.5, "3", None, True, False])
def test_a_non_integer_is_both_a_type_error_and_a_value_error(value):
    """bool is refused too: True as a count is always a bug."""
    with pytest.raises(ArgumentTypeError, match="n must be a positive integer") as info:
        check_positive_int("n", value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


def test_too_small_is_a_value_error_naming_the_bound():
    with pytest.raises(ValueError, match="num_blocks must be a non-negative integer, got -1"):
        check_int("num_blocks", -1, minimum=0)
    with pytest.raises(ValueError, match="k must be an integer >= 2, got 1"):
        check_int("k", 1, minimum=2)
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        check_block_size(0)


def test_accepted_values_come_back_as_plain_ints():
    import numpy as np
    assert check_int("n", np.int64(3)) == 3 and type(check_int("n", np.int64(3))) is int
    assert check_int("n", 0, minimum=0) == 0


@pytest.mark.parametrize("value,message", [
    (math.nan, "must be a finite number"), (math.inf, "must be a finite number"),
    (-1, "must be non-negative"), ("8", "must be a finite number"),
])
def test_numbers_must_be_finite_and_non_negative(value, message):
    with pytest.raises(ValueError, match=message):
        check_number("bytes", value)


def test_zero_can_be_refused():
    assert check_number("bytes", 0) == 0
    with pytest.raises(ValueError, match="bytes must be positive, got 0"):
        check_number("bytes", 0, allow_zero=False)


def test_is_integer_is_the_one_rule_for_counts_and_ids():
    import numpy as np

    from kvlab.validation import is_integer
    assert is_integer(3) and is_integer(np.int32(3)) and is_integer(-1)
    assert not any(is_integer(v) for v in (True, 3.0, "3", None))


def test_a_sliding_window_is_a_positive_integer_or_none_for_full_attention():
    """0 is refused rather than read as full attention: a window of 0 keys would hide even the query itself."""
    assert check_sliding_window(None) is None and check_sliding_window(4096) == 4096
    for bad in (0, -1):
        with pytest.raises(ValueError, match="sliding_window must be a positive integer .* or None for full"):
            check_sliding_window(bad)
    for bad in (2.0, "128", True):
        with pytest.raises(ArgumentTypeError, match="sliding_window"):
            check_sliding_window(bad)
