"""Capacity planning (Chapter 10): a step's roofline, the highest rate under an SLO by bisection, the GPUs needed."""

import math

import pytest

from kvlab.analysis.kv_size import kv_cache_bytes_per_token, load_model_config
from kvlab.simulation.gpus import GPU, GPUS
from kvlab.simulation.planning import GPUPlan, gpus_needed, max_rate_under_slo, step_roofline
from kvlab.simulation.step_time import ModelSpec, step_time, weight_bytes_per_gpu

LLAMA3 = ModelSpec.from_config(load_model_config("llama-3-8b"))


def test_a_decode_step_reads_the_weights_once_and_each_context_token_once():
    one = step_roofline(LLAMA3, "A100-80GB", decodes=[100])
    kv = kv_cache_bytes_per_token(load_model_config("llama-3-8b"))
    assert one.bytes == weight_bytes_per_gpu(LLAMA3) + kv * (1 + 100), "weights + one token's K/V written + 100 read"
    assert one.bound == "memory" and one.seconds == one.memory_s
    eight = step_roofline(LLAMA3, "A100-80GB", decodes=[100] * 8)
    assert eight.bytes - one.bytes == 7 * kv * 101, "a request more adds only its own K/V, not the weights again"
    assert eight.seconds < 1.1 * one.seconds, "batching decodes is nearly free while the weights dominate"


def test_a_long_prefill_chunk_is_compute_bound_and_costs_its_flops():
    r = step_roofline(LLAMA3, "A100-80GB", prefills=[(2048, 0)])
    params = weight_bytes_per_gpu(LLAMA3) // 2
    pairs = 2048 * 2049 // 2
    assert r.flops == 2 * params * 2048 + 4 * 32 * 32 * 128 * pairs
    assert r.bound == "compute" and r.seconds == r.flops / GPUS["A100-80GB"].flops_per_s
    assert r.intensity > GPUS["A100-80GB"].ridge_flops_per_byte


def test_the_bound_flips_where_the_intensity_crosses_the_ridge_and_a_tie_is_memory():
    gpu = GPUS["H100-SXM"]
    batch = next(n for n in range(1, 5000) if step_roofline(LLAMA3, gpu, decodes=[1] * n).bound == "compute")
    below = step_roofline(LLAMA3, gpu, decodes=[1] * (batch - 1))
    above = step_roofline(LLAMA3, gpu, decodes=[1] * batch)
    assert below.intensity <= gpu.ridge_flops_per_byte < above.intensity
    # A GPU whose FLOP/s and bandwidth make one prefill token exactly balanced.
    r = step_roofline(LLAMA3, "A100-80GB", prefills=[(1, 0)])
    tie = GPU("tie", 1, float(r.bytes), float(r.flops), 1.0, "none", True, "made up for the test: 1 s either way")
    assert step_roofline(LLAMA3, tie, prefills=[(1, 0)]).bound == "memory"


def test_the_roofline_is_a_lower_bound_of_the_per_operator_model():
    """step_time adds efficiencies below the datasheet and fixed costs, so it is never faster than the roofline."""
    for prefills, decodes in [((), [512] * 32), ([(512, 0)], [256] * 16), ([(4096, 1024)], ())]:
        roof = step_roofline(LLAMA3, "A100-80GB", prefills, decodes).seconds
        assert roof < step_time(LLAMA3, "A100-80GB", prefills, decodes, step_overhead_s=0.0).total_s


def test_a_step_with_no_tokens_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        step_roofline(LLAMA3, "A100-80GB")


class Knee:
    """A fake simulation: TTFT and TPOT flat up to `knee` req/s, then far above any SLO; counts its calls."""

    def __init__(self, knee):
        self.knee, self.calls = knee, []

    def __call__(self, rate):
        self.calls.append(rate)
        return (0.1, 0.02) if rate <= self.knee else (1.0 + rate, 1.0 + rate)


def test_bisection_returns_a_rate_that_met_within_the_tolerance_of_the_knee():
    sim = Knee(3.3)
    rate = max_rate_under_slo(sim, 0.5, 0.05, 0.5, 16.0, 0.01)
    assert rate <= 3.3 < rate + 0.01, "a rate that meets the SLO, within the tolerance below the knee"
    assert sim.calls[:2] == [0.5, 16.0] and len(sim.calls) <= 2 + math.ceil(math.log2(15.5 / 0.01))


def test_bisection_edges_low_fails_high_meets_and_exact_widths():
    assert max_rate_under_slo(Knee(0.1), 0.05, 0.05, 0.5, 16.0, 0.01) is None, "no rate in range holds"
    assert max_rate_under_slo(Knee(100.0), 0.5, 0.05, 0.5, 16.0, 0.01) == 16.0, "the top of the range holds"
    # [1, 2] halves to widths 0.5 and 0.25: with tolerance 0.25 the search stops at width exactly 0.25.
    sim = Knee(1.3)
    assert max_rate_under_slo(sim, 0.5, 0.05, 1.0, 2.0, 0.25) == 1.25 and sim.calls == [1.0, 2.0, 1.5, 1.25]
    assert max_rate_under_slo(lambda r: (0.5, 0.05), 0.5, 0.05, 1.0, 2.0, 0.25) == 2.0, "equal to the SLO meets it"
    for bad in [dict(low=2.0, high=1.0), dict(low=0.0, high=1.0), dict(tolerance=0.0), dict(ttft_slo=-1.0)]:
        args = dict(ttft_slo=0.5, tpot_slo=0.05, low=1.0, high=2.0, tolerance=0.1) | bad
        with pytest.raises(ValueError):
            max_rate_under_slo(Knee(1.0), **args)


def test_gpus_needed_picks_the_fewest_gpus_and_the_smaller_degree_on_a_tie():
    assert gpus_needed(10.0, {1: 3.0, 2: 7.0, 4: 20.0}) == GPUPlan(4, 1, 4), "4 x 1 beats 2 x 2 = 4 on the tie, 4"
    assert gpus_needed(10.0, {1: 2.5, 2: 10.0}) == GPUPlan(2, 2, 1), "exactly 4 replicas of 2.5 (4 GPUs) vs 1 of 2"
    assert gpus_needed(10.0, {1: None, 2: 0.0, 4: 1.0}) == GPUPlan(40, 4, 10), "degrees that hold nothing are skipped"
    assert gpus_needed(10.0, {1: None}) is None
    with pytest.raises(ValueError):
        gpus_needed(0.0, {1: 1.0})
    with pytest.raises(ValueError):
        gpus_needed(1.0, {0: 1.0})
