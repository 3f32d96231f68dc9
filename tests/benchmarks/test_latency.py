"""Latency definitions (TTFT, TPOT, ITL, E2E), the knee of a latency curve and the choice of a token budget."""

import pytest

from kvlab.benchmarks.latency import knee_rate, latency_metrics, pick_token_budget


def test_latencies_of_one_request():
    m = latency_metrics(10.0, [10.5, 10.6, 10.8, 11.1])
    assert m.ttft == pytest.approx(0.5) and m.e2e == pytest.approx(1.1)
    assert m.tpot == pytest.approx(0.6 / 3), "TPOT spreads the decode part over the tokens after the first"
    assert m.itl == pytest.approx((0.1, 0.2, 0.3))
    single = latency_metrics(0.0, [0.2])
    assert single.tpot is None and single.itl == ()
    chunked = latency_metrics(0.0, [0.1, 0.4], num_tokens=4)  # a speculative step delivered 3 tokens at once
    assert chunked.tpot == pytest.approx(0.1) and chunked.itl == pytest.approx((0.3,))


@pytest.mark.parametrize("args, message", [((0.0, []), "no tokens"), ((1.0, [0.5]), "before the arrival"),
                                           ((0.0, [0.3, 0.2]), "sorted"), ((0.0, [0.1, 0.2], 1), "cannot carry")])
def test_bad_timestamps(args, message):
    with pytest.raises(ValueError, match=message):
        latency_metrics(*args)


def test_knee_of_a_latency_curve():
    rates = [1, 2, 4, 8, 16]
    assert knee_rate(rates, [10, 11, 13, 25, 90], factor=2) == 4
    assert knee_rate(rates, [10, 11, 13, 19, 20], factor=2) == 16
    assert knee_rate(rates, [10, 30, 12, 12, 12], factor=2) == 1, "a dip after the first break does not count"
    assert knee_rate(list(reversed(rates)), [90, 25, 13, 11, 10], factor=2) == 4, "order of the pairs is free"
    with pytest.raises(ValueError):
        knee_rate([], [])


def test_pick_a_token_budget_for_an_slo():
    measured = {32: (900, 20), 64: (500, 30), 128: (300, 45), 256: (250, 80)}
    assert pick_token_budget(measured, ttft_slo=600, itl_slo=50) == 128, "the lowest TTFT that keeps ITL in bounds"
    assert pick_token_budget(measured, ttft_slo=600, itl_slo=35) == 64
    assert pick_token_budget(measured, ttft_slo=400, itl_slo=25) is None, "no budget meets both"
    assert pick_token_budget({64: (300, 10), 32: (300, 10)}, 400, 20) == 32, "ties go to the smaller budget"
