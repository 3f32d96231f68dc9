"""The notebook checks: messages that show yours and expected, the reference guard, the output cap."""

import pytest
import torch

import kvlab.cache.naive_cache
import kvlab.decoding.generate
from kvlab.checks import CheckFailed, check_close, check_equal, limited_output, own_implementation


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

    from kvlab.checks import check_close

    yours = torch.tensor([[1.0, float("nan")], [0.0, 2.0]])
    with pytest.raises(AssertionError, match=r"Largest difference inf at index \(0, 1\)"):
        check_close("nan", yours, torch.ones(2, 2))
