"""Capacity planning on a simulated GPU (Chapter 10): a step's roofline, the highest rate under an SLO, GPUs needed.

    step_roofline       one step on one GPU at the datasheet peaks: the bytes it moves (weights once, K/V written
                        and read), its FLOPs (every token through every matrix, attention per (query, key) pair),
                        and its time, bound by memory or compute. The coarse twin of kvlab.simulation.step_time,
                        which does the same per operator with measured efficiencies and fixed costs.
    max_rate_under_slo  bisection over request rates with a simulation as a black box, assumed monotone: the
                        highest rate known to meet a TTFT and a TPOT objective, to a tolerance.
    gpus_needed         replicas x tensor-parallel degree for a target rate, from each degree's rate per replica.
    chat_requests       a workload for these: lengths drawn from the shipped ShareGPT-like chat trace, Poisson arrivals
                        (requests_with_fresh_prompts: the same for any list of lengths)
    slo_figures         a run's TTFT and TPOT at one percentile, the figures an SLO judges

The KV capacity of a deployment is kvlab.simulation.capacity.kv_capacity.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kvlab.analysis.traces import load_trace
from kvlab.benchmarks.datasets import poisson_arrivals
from kvlab.benchmarks.latency import percentile
from kvlab.paths import ASSETS_DIR
from kvlab.simulation.engine import SimRequest
from kvlab.simulation.gpus import GPU, get_gpu
from kvlab.simulation.step_time import ModelSpec, _check_step, weight_bytes_per_gpu
from kvlab.validation import check_number, check_positive_int


@dataclass(frozen=True, slots=True)
class Roofline:
    """One step on one GPU at the datasheet peaks: bytes through HBM, FLOPs, seconds and the bound that sets them."""

    bytes: int
    flops: int
    memory_s: float     # bytes / peak bandwidth
    compute_s: float    # FLOPs / peak FLOP/s

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def bound(self) -> str:
        """'compute' where the FLOPs take longer than the bytes, else 'memory' (a tie is memory-bound)."""
        return "compute" if self.compute_s > self.memory_s else "memory"

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved; above the GPU's ridge point (GPU.ridge_flops_per_byte) the step is compute-bound."""
        return self.flops / self.bytes


def step_roofline(model: ModelSpec, gpu: GPU | str, prefills: Iterable[tuple[int, int]] = (),
                  decodes: Iterable[int] = ()) -> Roofline:
    """The roofline of one step on one GPU: prefill chunks (num_new_tokens, num_computed_tokens), decode contexts.

    T tokens in the step (each chunk's new tokens, one per decode), P weight parameters (every layer's matrices
    and the LM head: weight_bytes_per_gpu / dtype bytes), k bytes of K and V per token over all layers:
        bytes = P x dtype bytes              the weights, read once whatever T is
              + k x T                        the new tokens' K/V written
              + k x (sum(new + computed) + sum(decode contexts))   the K/V attention reads
        FLOPs = 2 x P x T                    every token through every matrix (a multiply and an add)
              + 4 x layers x heads x head_dim x pairs   QK^T and PV over the causal (query, key) pairs:
                                             new x computed + new (new + 1) / 2 per chunk, the context per decode
    Left out: activations, the embedding gather, the LM head computing only rows that sample, every
    efficiency below the datasheet and every fixed cost (kvlab.simulation.step_time has them).
    """
    gpu = get_gpu(gpu)
    chunks, contexts = _check_step(prefills, decodes)
    params = weight_bytes_per_gpu(model, 1) // model.dtype_bytes
    kv_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.dtype_bytes
    tokens = sum(q for q, _ in chunks) + len(contexts)
    kv_read = sum(q + c for q, c in chunks) + sum(contexts)
    pairs = sum(q * c + q * (q + 1) // 2 for q, c in chunks) + sum(contexts)
    num_bytes = params * model.dtype_bytes + kv_per_token * (tokens + kv_read)
    flops = 2 * params * tokens + 4 * model.num_layers * model.num_heads * model.head_dim * pairs
    return Roofline(num_bytes, flops, num_bytes / gpu.memory_bytes_per_s, flops / gpu.flops_per_s)


def max_rate_under_slo(slo_figures: Callable[[float], tuple[float, float]], ttft_slo: float, tpot_slo: float,
                       low: float, high: float, tolerance: float) -> float | None:
    """The highest request rate known to meet both objectives, found by bisection between low and high.

    slo_figures(rate) returns the (TTFT, TPOT) figures the objectives judge (e.g. p90s, seconds); a rate meets
    them when TTFT <= ttft_slo and TPOT <= tpot_slo. The figures are assumed not to fall as the rate rises.
    slo_figures(low) is called first: None if it fails. Then slo_figures(high): high if it meets. Otherwise
    the bracket [low, high] (low meets, high fails) halves at its midpoint until high - low <= tolerance, and
    the low end is returned: a rate that met, within tolerance of the first that fails.
    """
    check_number("ttft_slo", ttft_slo, what="number of seconds")
    check_number("tpot_slo", tpot_slo, what="number of seconds")
    check_number("low", low, allow_zero=False, what="request rate")
    check_number("high", high, allow_zero=False, what="request rate")
    check_number("tolerance", tolerance, allow_zero=False, what="request rate")
    if not high > low:
        raise ValueError(f"high must be above low: the search runs over [low, high], got low={low}, high={high}")

    def meets(rate: float) -> bool:
        ttft, tpot = slo_figures(rate)
        return ttft <= ttft_slo and tpot <= tpot_slo

    if not meets(low):
        return None
    if meets(high):
        return high
    while high - low > tolerance:
        mid = (low + high) / 2
        if meets(mid):
            low = mid
        else:
            high = mid
    return low


@dataclass(frozen=True, slots=True)
class GPUPlan:
    """A deployment: `replicas` copies of the model, each over `tensor_parallel_size` GPUs."""

    num_gpus: int
    tensor_parallel_size: int
    replicas: int


def gpus_needed(target_rate: float, rate_per_replica: Mapping[int, float | None]) -> GPUPlan | None:
    """The fewest GPUs that hold target_rate: for each tensor-parallel degree p with a rate r per replica (the
    highest it holds under the SLO; None or 0 where a replica holds none), ceil(target / r) replicas of p GPUs.
    Ties go to the smaller degree (more, smaller replicas). None when no degree holds any rate."""
    check_number("target_rate", target_rate, allow_zero=False, what="request rate")
    best = None
    for tp, rate in rate_per_replica.items():
        check_positive_int("tensor_parallel_size", tp)
        if rate is None:
            continue
        check_number(f"rate_per_replica[{tp}]", rate, what="request rate")
        if rate == 0:
            continue
        replicas = math.ceil(target_rate / rate)
        plan = GPUPlan(replicas * tp, tp, replicas)
        if best is None or (plan.num_gpus, plan.tensor_parallel_size) < (best.num_gpus, best.tensor_parallel_size):
            best = plan
    return best


def chat_requests(count: int, rate: float, seed: int) -> list[SimRequest]:
    """count requests with lengths drawn (seeded, with replacement) from assets/traces/chat.csv (ShareGPT-like,
    means 152 in / 310 out), prompts of fresh token ids (no shared prefixes), Poisson arrivals at rate."""
    check_positive_int("count", count)
    trace = load_trace(ASSETS_DIR / "traces" / "chat.csv")
    rng = random.Random(seed)
    return requests_with_fresh_prompts([rng.choice(trace) for _ in range(count)], rate, seed, rng)


def requests_with_fresh_prompts(lengths, rate: float, seed: int, rng: random.Random) -> list[SimRequest]:
    """One request per entry of lengths (each with prompt_len and output_len), prompts of fresh token ids drawn from
    rng (no shared prefixes), arriving as a Poisson process at rate (seeded)."""
    return [SimRequest(a, [rng.randrange(50000) for _ in range(r.prompt_len)], r.output_len)
            for a, r in zip(poisson_arrivals(len(lengths), rate, seed), lengths)]


def slo_figures(timings, q: float = 0.9) -> tuple[float, float]:
    """(TTFT, TPOT) at the q-quantile over a run's requests (RequestTiming), seconds; requests of one token have no
    TPOT and are left out of it."""
    tpots = [t.metrics().tpot for t in timings if t.output_len > 1]
    return percentile([t.ttft for t in timings], q), percentile(tpots, q) if tpots else 0.0
