"""The simulated engine: kvlab's own scheduler and KV cache manager, no model, a clock made of step times.

Given the live engine's measured step times, it must take exactly the live engine's decisions (who runs, how
many tokens each, whom it preempts, how many blocks are held) and give the same latencies; its GPU clock must
be the roofline of kvlab.simulation.step_time; bad input must say what is wrong.
"""

import random
import time

import pytest

from kvlab.benchmarks.datasets import poisson_arrivals
from kvlab.benchmarks.latency import normalized_latency
from kvlab.benchmarks.replay import replay_arrivals
from kvlab.engine.llm_engine import LLMEngine
from kvlab.simulation.engine import GPUStepTime, SimRequest, SimulatedEngine, resolve_model, run_static, simulate
from kvlab.simulation.step_time import step_time

# A small trace for the embedded model (vocabulary 83, context 256): even requests share a 24-token prefix (six
# blocks of 4), odd ones are long enough that 24 blocks force preemptions, and a 16-token budget chunks prompts.
PREFIX = [7] * 24
PROMPTS = [PREFIX + [10 + i] * (3 + i % 5) if i % 2 == 0 else [20 + i] * (10 + 3 * i) for i in range(10)]
LENS = [6 + (i * 7) % 15 for i in range(10)]
ARRIVALS = [0.0, 0.0, 0.001, 0.002, 0.004, 0.006, 0.01, 0.015, 0.02, 0.03]
KNOBS = dict(block_size=4, num_blocks=24, max_num_seqs=6, max_num_batched_tokens=16)


class RecordingClock:
    """time.process_time, remembering every reading: replay_arrivals reads it before and after each step."""

    def __init__(self):
        self.readings = []

    def __call__(self) -> float:
        self.readings.append(time.process_time())
        return self.readings[-1]

    def step_seconds(self) -> list[float]:
        r = self.readings
        return [r[i + 1] - r[i] for i in range(0, len(r), 2)]   # the very subtraction replay_arrivals makes


@pytest.mark.parametrize("policy, arena", [(None, None), ("pow2", None), ("oracle", "buddy")])
def test_given_the_live_step_times_the_simulation_takes_the_live_engines_decisions(embedded, policy, arena):
    model, tokenizer = embedded
    live = LLMEngine(model, tokenizer, reservation_policy=policy, reservation_arena=arena, **KNOBS)
    clock = RecordingClock()
    live_timings = replay_arrivals(live, PROMPTS, LENS, ARRIVALS, clock=clock)
    measured = iter(clock.step_seconds())

    sim = SimulatedEngine(lambda step: next(measured), KNOBS["num_blocks"], live.max_model_len, KNOBS["block_size"],
                          KNOBS["max_num_seqs"], KNOBS["max_num_batched_tokens"], reservation_policy=policy,
                          reservation_arena=arena)
    result = sim.run([SimRequest(a, p, n) for a, p, n in zip(ARRIVALS, PROMPTS, LENS)], record_steps=True)

    if policy is None:
        assert live.scheduler.num_preemptions > 0 and live.kv_cache_manager.hits > 0, \
            "set-up: the trace must make the live engine preempt and hit the prefix cache"
    if arena is not None:
        def steps(placed):
            engine = SimulatedEngine(lambda step: 0.001, KNOBS["num_blocks"], live.max_model_len, KNOBS["block_size"],
                                     KNOBS["max_num_seqs"], KNOBS["max_num_batched_tokens"], reservation_policy=policy,
                                     reservation_arena=placed)
            return engine.run([SimRequest(a, p, n) for a, p, n in zip(ARRIVALS, PROMPTS, LENS)]).num_steps
        assert steps(arena) > steps(None), "set-up: the arena must keep out requests whose blocks are free"
    for mine, theirs in zip(result.steps, live.history):
        assert list(mine.tokens) == list(theirs.tokens.items()), \
            f"step {theirs.step}: scheduled (request, tokens) in batch order. Simulated: {mine.tokens} Live: " \
            f"{list(theirs.tokens.items())}"
        assert mine.preempted == theirs.preempted, f"step {theirs.step}: preempted {mine.preempted} vs live " \
                                                   f"{theirs.preempted}"
        assert mine.used_blocks == theirs.used_blocks, f"step {theirs.step}: blocks held {mine.used_blocks} vs " \
                                                       f"live {theirs.used_blocks}"
    assert len(result.steps) == len(live.history), "as many steps as the live engine"
    assert result.num_preemptions == live.scheduler.num_preemptions
    assert (result.num_prompt_tokens, result.num_cached_prompt_tokens) == \
        (live.kv_cache_manager.queries, live.kv_cache_manager.hits), "the same prefix-cache hits"
    for i, (mine, theirs) in enumerate(zip(result.timings, live_timings)):
        assert mine.token_times == theirs.token_times, f"request {i}: token times differ from the live replay's"
        assert mine.metrics() == theirs.metrics(), f"request {i}: TTFT/TPOT/ITL/E2E by the same definitions"
    assert sim.kv_cache_manager.num_free_blocks == KNOBS["num_blocks"], "every block back in the pool at the end"
    assert not sim.scheduler.requests, "finished requests are forgotten, as vLLM's scheduler forgets them"


@pytest.mark.parametrize("model, gpu, tp", [("opt-13b", "A100-40GB", 1), ("llama-3-8b", "H100-SXM", 2)])
def test_the_fast_step_time_is_the_roofline_of_the_steps_composition(model, gpu, tp):
    spec = resolve_model(model)
    fast = GPUStepTime(spec, gpu, tp, step_overhead_s=0.004)
    rng = random.Random(0)
    for _ in range(100):
        prefills = [(rng.randint(1, 700), rng.randint(0, 1500)) for _ in range(rng.randint(0, 3))]
        decodes = [rng.randint(1, 2000) for _ in range(rng.randint(0 if prefills else 1, 64))]
        rows = len(prefills) + len(decodes)
        expected = step_time(spec, gpu, prefills, decodes, tp, num_sampled=rows, step_overhead_s=0.004).total_s
        assert fast.seconds(prefills, decodes, rows) == pytest.approx(expected, rel=1e-12), \
            f"prefills {prefills}, {len(decodes)} decodes: the simulation's clock must be step_time's"


def sharegpt_like(count: int, rate: float, seed: int = 0) -> list[SimRequest]:
    rng = random.Random(seed)
    arrivals = poisson_arrivals(count, rate, seed)
    return [SimRequest(a, [rng.randrange(50000) for _ in range(min(1500, 1 + int(rng.expovariate(1 / 161))))],
                       min(500, 1 + int(rng.expovariate(1 / 338)))) for a in arrivals]


def test_a_gpu_deployment_sizes_its_pool_and_paging_beats_reserving_the_maximum():
    from kvlab.analysis.kv_size import load_model_config
    from kvlab.simulation.capacity import kv_capacity

    requests = sharegpt_like(40, rate=float("inf"))
    paged = simulate(requests, "opt-13b", "A100-40GB", max_model_len=2048)
    assert paged.num_blocks == kv_capacity(load_model_config("opt-13b"), "A100-40GB", max_model_len=2048,
                                           max_num_batched_tokens=8192, max_num_seqs=256).num_blocks
    orca_max = simulate(requests, "opt-13b", "A100-40GB", max_model_len=2048, system="orca-max")
    assert all(len(t.token_times) == t.output_len for t in paged.timings + orca_max.timings)
    assert orca_max.num_preemptions == 0, "a reservation never runs out of blocks"
    assert normalized_latency(paged.timings) < normalized_latency(orca_max.timings) / 2, \
        "40 requests at once: Orca(Max) runs about 10 at a time (2048 slots each), paging all of them"


def test_static_batches_run_to_their_longest_member_and_return_together():
    requests = [SimRequest(0.0, [1] * 10, n) for n in (3, 7, 2, 5, 4)]
    passes = []
    result = run_static(requests, lambda step: passes.append(step) or 1.0, batch_size=2, max_model_len=64)
    finishes = [t.finish for t in result.timings]
    assert finishes == [7.0, 7.0, 12.0, 12.0, 16.0], \
        "one second per pass: batch (3, 7) takes 7 passes, (2, 5) 5 more, (4) 4 more, each member returned at its end"
    assert passes[0].prefills == [(10, 0), (10, 0)] and passes[1].decodes == [11, 11], \
        "a batch prefills together, then every member decodes each pass, finished or not"


def test_the_hit_rate_counts_whole_prompts_once_however_they_are_chunked_or_preempted():
    shared = [5] * 64
    requests = [SimRequest(0.01 * i, shared + [100 + i] * 40, 30) for i in range(8)]
    engine = SimulatedEngine(lambda step: 0.001, num_blocks=40, max_model_len=256, block_size=4, max_num_seqs=8,
                             max_num_batched_tokens=16)
    result = engine.run(requests)
    assert result.num_preemptions > 0, "set-up: 40 blocks of 4 must force preemptions"
    assert result.num_prompt_tokens == 8 * 104, "every prompt is looked up once, whole, though admitted in chunks"
    assert result.num_cached_prompt_tokens <= 7 * 64, "only the shared 64 tokens of the last seven can hit"
    assert engine.kv_cache_manager.preempted_hits > 0, "re-admissions find their own blocks, counted apart"


def test_bad_input_says_what_is_wrong():
    requests = [SimRequest(0.0, [1] * 8, 4)]
    with pytest.raises(ValueError, match="unknown GPU 'A100-41GB'"):
        simulate(requests, "opt-13b", "A100-41GB", max_model_len=2048)
    with pytest.raises(FileNotFoundError, match="no shipped config 'opt-14b'.*known: .*opt-13b"):
        simulate(requests, "opt-14b", "A100-40GB")
    with pytest.raises(ValueError, match=r"request 0: 2000 prompt \+ 100 output tokens = 2100 is longer than "
                                         r"max_model_len 2048"):
        simulate([SimRequest(0.0, [1] * 2000, 100)], "opt-13b", "A100-40GB", max_model_len=2048)
    with pytest.raises(ValueError, match="not sorted by arrival: request 1 arrives at 0.5 s, before request 0 at 1 s"):
        simulate([SimRequest(1.0, [1] * 8, 4), SimRequest(0.5, [1] * 8, 4)], "opt-13b", "A100-40GB",
                 max_model_len=2048)
    with pytest.raises(ValueError, match="can never fit"):
        simulate(requests, "opt-13b", "A100-40GB", max_model_len=2048, num_blocks=100, system="orca-max")
    with pytest.raises(ValueError, match="system must be one of"):
        simulate(requests, "opt-13b", "A100-40GB", max_model_len=2048, system="vllm")
    with pytest.raises(ValueError, match="give a reservation_policy too"):
        SimulatedEngine(lambda step: 0.001, 64, 2048, reservation_arena="buddy")
    with pytest.raises(ValueError, match="unknown arena 'slab'"):
        SimulatedEngine(lambda step: 0.001, 64, 2048, reservation_policy="oracle", reservation_arena="slab")
    with pytest.raises(ValueError, match="can never fit: .* but the BuddyArena's largest range is 64 blocks"):
        simulate([SimRequest(0.0, [1] * 1100, 100)], "opt-13b", "A100-40GB", max_model_len=2048, num_blocks=100,
                 system="orca-oracle", reservation_arena="buddy")
