"""Queueing figures of a replayed run: utilisation, Little's law and the single-server wait, on hand-made spans
and on a real replay, where Little's law must hold between the dashboard and the latencies."""

import math
import statistics

import pytest

from kvlab import load_model
from kvlab.benchmarks.queueing import (
    arrival_rate,
    busy_fraction,
    busy_time,
    makespan,
    mean_in_system,
    single_server_wait,
)
from kvlab.benchmarks.replay import replay
from kvlab.engine.llm_engine import LLMEngine
from kvlab.engine.stats import StepRecord


def record(step, status):
    return StepRecord(step, status, {}, (), (), 0, 8, 0)


def test_busy_fraction_counts_only_the_window():
    spans = [(0.0, 1.0), (2.0, 3.0), (3.0, 5.0)]
    assert busy_time(spans) == 4.0
    assert busy_fraction(spans, until=4.0) == 0.75, "1 + 1 + 1 busy seconds of the first 4"
    assert busy_fraction(spans, until=5.0, since=2.0) == 1.0
    with pytest.raises(ValueError, match="window"):
        busy_fraction(spans, until=1.0, since=1.0)


def test_arrival_rate_is_gaps_over_their_span():
    assert arrival_rate([0.0, 0.5, 1.0, 2.0]) == 1.5, "3 gaps in 2 seconds"
    with pytest.raises(ValueError, match="two arrivals"):
        arrival_rate([1.0])


def test_mean_in_system_counts_a_request_during_the_step_that_finishes_it():
    spans = [(0.0, 1.0), (1.0, 2.0), (3.0, 4.0)]
    history = [record(0, {"a": "running", "b": "waiting"}),
               record(1, {"a": "finished (length)", "b": "running"}),   # a finished in this step: still counted
               record(2, {"a": "finished (length)", "b": "finished (length)"})]
    # 2 requests for 1 s, 2 for 1 s, then idle 1 s (0), then b alone for 1 s: 5 request-seconds over 4 s.
    assert mean_in_system(spans, history, 4.0) == 1.25
    with pytest.raises(ValueError, match="one span per step"):
        mean_in_system(spans[:2], history, 4.0)


def test_single_server_wait_grows_like_one_over_one_minus_rho():
    assert single_server_wait(0.5, 2.0) == 2.0
    assert single_server_wait(0.9, 1.0) == pytest.approx(9.0)
    assert single_server_wait(0.0, 1.0) == 0.0
    assert math.isinf(single_server_wait(1.0, 1.0)), "at rho = 1 the queue never empties"
    with pytest.raises(ValueError):
        single_server_wait(-0.1, 1.0)


def test_littles_law_holds_on_a_real_replay():
    """L from the dashboard (requests in the engine, step by step) equals throughput x mean latency, but for one
    term: a request that arrives during a step joins the engine at the step's end, and the dashboard does not see
    it until then. With that term the two sides agree to rounding."""
    model, tokenizer = load_model()
    engines = []

    def make():
        engines.append(LLMEngine(model, tokenizer, block_size=8, num_blocks=24, max_num_seqs=16))
        return engines[-1]

    prompts = [[5 + i % 30] * (4 + i % 9) for i in range(16)]
    lens = [3 + (i * 7) % 13 for i in range(16)]
    spans = []
    timings = replay(make, prompts, lens, rate=40.0, seed=1, spans=spans)
    duration = makespan(timings)
    little = len(timings) / duration * statistics.fmean(t.e2e for t in timings)
    unseen = sum(end - t.arrival for t in timings for start, end in spans if start < t.arrival < end) / duration
    assert unseen > 0, "set-up: some requests arrive while a step runs"
    assert mean_in_system(spans, engines[0].history, duration) + unseen == pytest.approx(little, rel=1e-9)
    assert 0 < busy_fraction(spans, duration) <= 1
