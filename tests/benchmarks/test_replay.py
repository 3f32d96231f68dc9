"""Poisson replay on the virtual clock: every request finishes, timestamps are consistent, and the baselines differ
only in how they allocate."""

import pytest

from kvlab import load_model
from kvlab.baselines.static_batching import StaticBatchingEngine
from kvlab.benchmarks.datasets import poisson_arrivals
from kvlab.benchmarks.latency import normalized_latency
from kvlab.benchmarks.replay import replay, replay_arrivals, replay_static
from kvlab.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def embedded_model():
    return load_model()


PROMPTS = [[5 + i % 40] * (3 + i % 7) for i in range(12)]
LENS = [4 + (i * 5) % 17 for i in range(12)]


def test_arrivals_are_seeded_and_poisson_like():
    a, b = poisson_arrivals(200, 10.0, seed=1), poisson_arrivals(200, 10.0, seed=1)
    assert a == b and a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:]))
    assert 14 < a[-1] < 26, "200 arrivals at 10/s span about 20 s"
    assert poisson_arrivals(5, float("inf"), 0) == [0.0] * 5
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0, 0)


@pytest.mark.parametrize("policy", [None, "oracle", "pow2", "max"])
def test_replay_finishes_every_request_with_consistent_times(embedded_model, policy):
    model, tokenizer = embedded_model
    engines = []

    def make():
        engines.append(LLMEngine(model, tokenizer, block_size=4, num_blocks=80, max_num_seqs=16,
                                 reservation_policy=policy))
        return engines[-1]

    timings = replay(make, PROMPTS, LENS, rate=50.0, seed=0)
    for t, n in zip(timings, LENS):
        assert t.arrival <= t.first_token <= t.finish and len(t.token_times) == n
    assert normalized_latency(timings) > 0
    engine = engines[0]
    peak_running = max(sum(s == "running" for s in h.status.values()) for h in engine.history)
    if policy == "max":
        assert peak_running == 1, "Orca-Max reserves the whole 256-token context: one request fits 80 blocks of 4"
    assert engine.scheduler.num_preemptions == 0 or policy is None, "reservations never need preemption"
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_static_batches_return_together(embedded_model):
    model, tokenizer = embedded_model
    engine = StaticBatchingEngine(model, tokenizer, batch_size=4, block_size=4)
    timings = replay_static(engine, PROMPTS, LENS, rate=float("inf"), batch_size=4)
    finishes = [t.finish for t in timings]
    assert len(set(finishes[:4])) == 1 and finishes[4] > finishes[0], "a batch ends together, the next one after it"


def test_a_static_batch_starts_only_when_the_previous_one_has_finished():
    """On the virtual clock the engine is busy while a batch runs: requests that arrive meanwhile wait for it."""
    from kvlab.benchmarks.datasets import poisson_arrivals as arrivals_of

    clock = [0.0]

    class OneSecondBatches:
        """A static engine whose every batch takes exactly one second of the (fake) clock."""

        def generate(self, prompts, params):
            clock[0] += 1.0

    prompts, lens = [[1, 2]] * 8, [3] * 8
    arrivals = arrivals_of(8, 20.0, 0)
    assert arrivals[-1] < 1.0, "set-up: every request arrives while the first batch is still running"
    timings = replay_static(OneSecondBatches(), prompts, lens, rate=20.0, batch_size=2, clock=lambda: clock[0])
    finishes = sorted({t.finish for t in timings})
    assert finishes == [1.0, 2.0, 3.0, 4.0, 5.0][:len(finishes)], (
        f"batches end at {finishes}: each starts when the one before it finished, never at an arrival in between")
    assert all(t.finish - t.arrival >= 1.0 for t in timings), "no request finishes sooner than one batch after arriving"


class TickClock:
    """A fake clock: every reading is `tick` seconds after the one before, so every step lasts exactly one tick."""

    def __init__(self, tick: float):
        self.tick, self.now = tick, 0.0

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_replay_arrivals_on_a_fake_clock(embedded_model):
    """Each step lasts one tick (0.25 s): the arrival times decide who joins which step, exactly."""
    model, tokenizer = embedded_model
    engine = LLMEngine(model, tokenizer, block_size=4, num_blocks=40)
    prompts, lens = [[5, 6, 7], [8, 9], [10, 11, 12], [13]], [3, 2, 1, 2]
    # Request 1 arrives exactly when the first step ends (0.25): it joins the second step. Request 2 arrives
    # during a step and waits for its end. Request 3 arrives after everything finished: the clock jumps to it.
    arrivals = [0.0, 0.25, 0.3, 5.0]
    spans = []
    timings = replay_arrivals(engine, prompts, lens, arrivals, clock=TickClock(0.25), spans=spans)
    assert [t.token_times for t in timings] == [[0.25, 0.5, 0.75], [0.5, 0.75], [0.75], [5.25, 5.5]], (
        "an arrival equal to the clock joins the next step; one during a step waits for the step's end; "
        "an idle engine jumps to the next arrival instead of counting the idle time")
    assert spans == [(0.0, 0.25), (0.25, 0.5), (0.5, 0.75), (5.0, 5.25), (5.25, 5.5)]
    assert len(spans) == len(engine.history), "one span per engine step"
    assert [t.finish for t in timings] == [0.75, 0.75, 0.75, 5.5] and timings[2].ttft == 0.45
    assert arrivals == [0.0, 0.25, 0.3, 5.0] and lens == [3, 2, 1, 2], "the inputs stay as they were"


def test_replay_arrivals_refuses_inputs_that_do_not_pair_up(embedded_model):
    model, tokenizer = embedded_model
    engine = LLMEngine(model, tokenizer, block_size=4, num_blocks=40)
    with pytest.raises(ValueError, match="pair up"):
        replay_arrivals(engine, [[1, 2]], [3, 4], [0.0])
    with pytest.raises(ValueError, match="sorted"):
        replay_arrivals(engine, [[1], [2]], [1, 1], [1.0, 0.5])


def test_replay_is_replay_arrivals_at_poisson_times(embedded_model):
    model, tokenizer = embedded_model
    make = lambda: LLMEngine(model, tokenizer, block_size=4, num_blocks=80, max_num_seqs=16)  # noqa: E731
    ours = replay(make, PROMPTS, LENS, rate=30.0, seed=3, clock=TickClock(0.125))
    direct = replay_arrivals(make(), PROMPTS, LENS, poisson_arrivals(len(PROMPTS), 30.0, 3), clock=TickClock(0.125))
    assert [t.token_times for t in ours] == [t.token_times for t in direct]
