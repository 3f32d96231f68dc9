"""Speculative decoding's arithmetic: the expected acceptance length and the ideal speed-up."""

import pytest

from kvlab.analysis.spec_decode import expected_acceptance_length, ideal_speedup


@pytest.mark.parametrize("alpha, k, expected", [
    (0.0, 4, 1.0),                 # every draft rejected: the verification still gives one token
    (1.0, 4, 5.0),                 # every draft accepted, plus the bonus token
    (0.5, 1, 1.5),
    (0.5, 3, 1 + 0.5 + 0.25 + 0.125),
    (0.8, 0, 1.0),                 # no drafts: plain decoding
])
def test_the_geometric_sum(alpha, k, expected):
    assert expected_acceptance_length(alpha, k) == pytest.approx(expected)


def test_the_closed_form_is_the_sum_it_stands_for():
    for alpha in (0.1, 0.37, 0.9, 0.999):
        for k in range(8):
            assert expected_acceptance_length(alpha, k) == pytest.approx(sum(alpha ** i for i in range(k + 1)))


def test_more_drafts_never_give_fewer_tokens_but_give_less_and_less():
    lengths = [expected_acceptance_length(0.7, k) for k in range(10)]
    gains = [b - a for a, b in zip(lengths, lengths[1:])]
    assert all(g > 0 for g in gains) and all(b < a for a, b in zip(gains, gains[1:]))
    assert lengths[-1] < 1 / (1 - 0.7), "bounded by 1 / (1 - alpha), however many drafts"


def test_ideal_speedup():
    assert ideal_speedup(3.0, 4) == 3.0, "n-gram lookup costs nothing: the speed-up is the acceptance length"
    assert ideal_speedup(3.0, 4, draft_cost=0.25) == pytest.approx(1.5), "a draft pass a quarter of a target pass"
    assert ideal_speedup(1.0, 4, draft_cost=0.1) < 1.0, "drafts nobody accepts only cost"


@pytest.mark.parametrize("call, message", [
    (lambda: expected_acceptance_length(1.5, 2), "probability"),
    (lambda: expected_acceptance_length(0.5, -1), "num_speculative_tokens"),
    (lambda: ideal_speedup(0.5, 2), "at least one token"),
    (lambda: ideal_speedup(2.0, 2, draft_cost=-1), "draft_cost"),
])
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
