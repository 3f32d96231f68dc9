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


def test_meets_slos_as_vllm_goodput_counts_a_request():
    from kvlab.benchmarks.latency import meets_slos

    m = latency_metrics(0.0, [0.25, 0.5, 1.0])          # TTFT 0.25, TPOT 0.375, E2E 1.0 (exact in binary)
    assert meets_slos(m, {"ttft": 0.25, "tpot": 0.375, "e2el": 1.0}), "a value equal to its SLO meets it"
    assert not meets_slos(m, {"ttft": 0.249}), "TTFT 0.25 misses an SLO of 0.249"
    assert not meets_slos(m, {"tpot": 0.374}), "TPOT is (E2E - TTFT) / (tokens - 1) = 0.375"
    assert not meets_slos(m, {"e2el": 0.999})
    assert meets_slos(m, {}), "no SLO: every request counts"
    assert meets_slos(latency_metrics(0.0, [0.1]), {"tpot": 0.0}), "one token: TPOT counts as 0, as in vLLM"
    two_chunks = latency_metrics(0.0, [0.25, 1.0], num_tokens=4)   # 3 tokens after the first in one chunk
    assert meets_slos(two_chunks, {"tpot": 0.25}) and not meets_slos(two_chunks, {"tpot": 0.249})
    with pytest.raises(ValueError, match="itl"):
        meets_slos(m, {"itl": 0.1})


def test_goodput_budget_picks_the_budget_that_serves_most_requests_within_slos():
    from kvlab.benchmarks.latency import goodput_budget

    fast_first = [(0.0, [0.05, 0.30], None), (0.0, [0.06, 0.31], None), (0.0, [0.50, 0.52], None)]
    even = [(0.0, [0.10, 0.20], None), (0.0, [0.12, 0.22], None), (0.0, [0.15, 0.25], None)]
    runs = {256: fast_first, 32: even}
    assert goodput_budget(runs, {"ttft": 0.2}) == 32, "3 requests within TTFT 0.2 at budget 32, 2 at 256"
    assert goodput_budget(runs, {"ttft": 0.1}) == 256
    assert goodput_budget(runs, {"ttft": 0.5, "tpot": 0.1}) == 32, "256's first two requests have TPOT 0.25"
    assert goodput_budget({64: even, 16: even}, {"ttft": 1.0}) == 16, "a tie goes to the smaller budget"
    assert goodput_budget(runs, {"ttft": 0.01}) is None, "no request meets the SLO under any budget"
    assert goodput_budget({}, {"ttft": 1.0}) is None
    with pytest.raises(ValueError, match="unknown SLO"):
        goodput_budget({}, {"p99_ttft": 1.0})
