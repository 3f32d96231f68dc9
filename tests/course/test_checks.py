"""The notebook checks: messages that show yours and expected, the reference guard, the output cap."""

import pytest
import torch

import kvlab.cache.naive_cache
import kvlab.decoding.generate
from kvlab.course.checks import CheckFailed, check_close, check_equal, limited_output, own_implementation


def test_check_equal_shows_yours_expected_and_first_difference():
    with pytest.raises(CheckFailed) as info:
        check_equal("tokens", [1, 2, 3], [1, 2, 4], hint="look at the last one")
    text = str(info.value)
    assert "Yours:    [1, 2, 3]" in text and "Expected: [1, 2, 4]" in text
    assert "index 2" in text and "Hint: look at the last one" in text


def test_check_equal_names_a_wrong_type():
    with pytest.raises(CheckFailed, match="You returned a str, expected a int"):
        check_equal("count", "3", 3)


def test_check_close_reports_shape_and_largest_difference(capsys):
    with pytest.raises(CheckFailed, match="Shapes differ"):
        check_close("out", torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(CheckFailed, match=r"Largest difference 1 at index \(1,\)"):
        check_close("out", torch.zeros(3), torch.tensor([0.0, 1.0, 0.0]))
    with pytest.raises(CheckFailed, match="expected a tensor"):
        check_close("out", [0.0], torch.zeros(1))
    check_close("out", torch.ones(2), torch.ones(2))
    assert "✓ out" in capsys.readouterr().out


def test_own_implementation_rejects_the_reference_in_every_disguise():
    ref = kvlab.decoding.generate.greedy_generate
    alias = ref
    with pytest.raises(CheckFailed, match="reference implementation"):
        own_implementation(alias, ref)

    def wraps(*args):
        return ref(*args)

    def via_module(*args):
        return kvlab.decoding.generate.greedy_generate(*args)

    class Sub(kvlab.cache.naive_cache.NaiveKVCache):
        pass

    for fake in (wraps, via_module):
        with pytest.raises(CheckFailed, match="calls kvlab's reference"):
            own_implementation(fake, ref)
    with pytest.raises(CheckFailed, match="inherits"):
        own_implementation(Sub, kvlab.cache.naive_cache.NaiveKVCache)


def test_own_implementation_accepts_code_that_uses_other_kvlab_helpers():
    from kvlab.model.attention_hook import forward

    def mine(model, ids, n):
        return forward(model, ids, range(len(ids)), None)

    own_implementation(mine, kvlab.decoding.generate.greedy_generate)


def test_limited_output_fails_a_flood_and_replays_normal_output(capsys):
    with pytest.raises(CheckFailed, match="printed more than 1,000 characters"):
        with limited_output(1000):
            for i in range(10_000):
                print(i)
    with limited_output(1000):
        print("short")
    assert "short" in capsys.readouterr().out


def test_check_close_reports_nan_where_it_is():
    """A NaN in the learner's tensor is reported with its index, not a crash inside the check."""
    import pytest
    import torch

    from kvlab.course.checks import check_close

    yours = torch.tensor([[1.0, float("nan")], [0.0, 2.0]])
    with pytest.raises(AssertionError, match=r"Largest difference inf at index \(0, 1\)"):
        check_close("nan", yours, torch.ones(2, 2))


def test_own_implementation_sees_through_lookups_by_name():
    """getattr, importlib, __globals__, sys.modules, a notebook helper and a default argument: none gets past."""
    import importlib
    import sys

    ref = kvlab.decoding.generate.greedy_generate
    module = kvlab.decoding.generate

    def by_getattr(*args):
        return getattr(module, "greedy_" + "generate")(*args)

    def by_importlib(*args):
        return importlib.import_module("kvlab.decoding.generate").greedy_generate(*args)

    def by_globals(*args):
        return module.load_model.__globals__["greedy_generate"](*args)

    def by_sys_modules(*args):
        return getattr(sys.modules["kvlab.decoding.generate"], "greedy_generate")(*args)

    def by_default(*args, impl=ref):
        return impl(*args)

    def helper(*args):
        return ref(*args)

    def by_helper(*args):
        return helper(*args)

    class ByAttribute:
        impl = staticmethod(ref)

    for fake in (by_getattr, by_importlib, by_globals, by_sys_modules, by_default, by_helper, ByAttribute):
        with pytest.raises(CheckFailed):
            own_implementation(fake, ref)


def test_own_implementation_accepts_lookups_on_the_learners_own_objects():
    def mine(table, name):
        return getattr(table, name, None)

    own_implementation(mine, kvlab.decoding.generate.greedy_generate)


class _Liar(int):
    """An int that claims to equal anything."""

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = int.__hash__


def test_check_equal_compares_plain_values_so_a_redefined_eq_cannot_pass():
    for yours, expected in ((_Liar(0), 5), ([_Liar(0)], [5]), ((1, _Liar(2)), (1, 3)), ({"a": _Liar(1)}, {"a": 2})):
        with pytest.raises(CheckFailed):
            check_equal("answer", yours, expected)

    class Anything:
        def __eq__(self, other):
            return True

    with pytest.raises(CheckFailed, match="plain Python values"):
        check_equal("answer", [Anything()], [1])
    import numpy as np

    check_equal("numpy integers count as ints", [np.int64(3), torch.tensor(4)], [3, 4])


def test_check_close_reads_the_values_of_a_tensor_subclass():
    class Close(torch.Tensor):
        def __sub__(self, other):
            return torch.zeros(self.shape)

    with pytest.raises(CheckFailed, match="Largest difference"):
        check_close("out", torch.ones(3).as_subclass(Close), torch.zeros(3))


def test_run_case_and_expect_raises_name_the_case():
    from kvlab.course.checks import expect_raises, run_case

    def boom(x):
        raise ZeroDivisionError("oops")

    with pytest.raises(CheckFailed, match=r"boom\(3\): your code raised ZeroDivisionError: oops"):
        run_case("boom(3)", boom, 3)
    assert run_case("len", len, [1, 2]) == 2
    with pytest.raises(CheckFailed, match="len\\(\\[\\]\\): expected ValueError, but nothing was raised"):
        expect_raises("len([])", ValueError, len, [])
    with pytest.raises(CheckFailed, match="expected KeyError, your code raised ZeroDivisionError"):
        expect_raises("boom", KeyError, boom, 1)
    expect_raises("boom", ZeroDivisionError, boom, 1)


def test_check_approx_takes_plain_numbers_within_tolerance():
    from kvlab.course.checks import check_approx

    check_approx("share", 0.5834, 14 / 24, abs_tol=0.005)
    with pytest.raises(CheckFailed, match="Allowed difference"):
        check_approx("share", 0.6, 14 / 24, abs_tol=0.005)
    with pytest.raises(CheckFailed, match="expected a number"):
        check_approx("share", "0.58", 14 / 24, abs_tol=0.005)
    with pytest.raises(CheckFailed):
        check_approx("ms", float("nan"), 0.08, rel_tol=0.01)

    class Liar(float):
        def __sub__(self, other):
            return 0.0

    with pytest.raises(CheckFailed):
        check_approx("ms", Liar(5.0), 0.08, rel_tol=0.01)
