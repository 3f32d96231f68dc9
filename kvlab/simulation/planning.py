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

Replicas behind a plain load balancer (benchmarks/mooncake_serving.py: a production trace at its own rate):

    round_robin           request i to replica i mod k, arrival order kept: each replica is its own engine
    latency_percentiles   TTFT, TPOT, ITL and E2E at p50 / p90 / p99 over the union of the replicas' requests
    work_floor            the least time a token position, a prefill attention pair and a decode's context token
                          can cost on the step-time model: a floor on a replica's busy time
    replicas_lower_bound  the fewest replicas whose busiest one is not busy beyond the trace's span
    fewest_replicas       from that bound upward, the fewest replicas for which a deployment meets the SLO

The KV capacity of a deployment is kvlab.simulation.capacity.kv_capacity.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvlab.analysis.traces import load_trace
from kvlab.benchmarks.datasets import poisson_arrivals
from kvlab.benchmarks.latency import percentile
from kvlab.paths import ASSETS_DIR
from kvlab.simulation.engine import SimRequest
from kvlab.simulation.gpus import GPU, get_gpu
from kvlab.simulation.step_time import (
    DEFAULT_STEP_OVERHEAD_S,
    EFFICIENCY,
    ModelSpec,
    Op,
    _check_step,
    layer_ops,
    step_time,
    weight_bytes_per_gpu,
)
from kvlab.validation import check_number, check_positive_int

T = TypeVar("T")


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


# ---------------------------------------------------------------------------------------------
# Replicas behind a round-robin load balancer: the split, the latency summary, the lower bound, the search.


def round_robin(requests: Sequence[T], replicas: int) -> list[list[T]]:
    """The requests each of `replicas` independent engines gets from a round-robin balancer: request i (in arrival
    order) goes to replica i mod replicas, and each replica's share keeps arrival order.

    A plain balancer looks at no prompt, so requests that share a prefix land on different replicas and each
    replica's prefix cache sees only its share (cache-aware routing would keep them together).
    """
    check_positive_int("replicas", replicas)
    if not isinstance(requests, Sequence):
        raise ValueError(f"requests must be a sequence (a list in arrival order), got {type(requests).__name__}")
    return [list(requests[r::replicas]) for r in range(replicas)]


LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")


def latency_percentiles(timings: Iterable,
                        quantiles: Sequence[float] = (0.5, 0.9, 0.99)) -> dict[str, dict[str, float | None]]:
    """TTFT, TPOT, ITL and end-to-end latency of a run at each quantile, seconds: {"ttft": {"p50": ..., ...}, ...}.

    timings: RequestTiming of every request (of every replica: the union is what a client sees). The definitions
    are RequestTiming.metrics()' (kvlab.benchmarks.latency, the live server's): TPOT over requests of more than one
    token; ITL pools every gap between consecutive token arrivals of every request. Nearest-rank percentiles
    (kvlab.benchmarks.latency.percentile); a metric with no value (no request of two tokens) gets None.
    """
    values: dict[str, list[float]] = {name: [] for name in LATENCY_METRICS}
    for t in timings:
        m = t.metrics()
        values["ttft"].append(m.ttft)
        values["e2e"].append(m.e2e)
        if m.tpot is not None:
            values["tpot"].append(m.tpot)
        values["itl"].extend(m.itl)
    if not values["ttft"]:
        raise ValueError("no requests: a latency summary needs at least one finished request")
    for q in quantiles:
        check_number("quantile", q, what="quantile")
        if q > 1:
            raise ValueError(f"a quantile lies in [0, 1] (0.9 is p90), got {q}")
    return {name: {_quantile_name(q): (percentile(v, q) if v else None) for q in quantiles}
            for name, v in values.items()}


def _quantile_name(q: float) -> str:
    """0.5 -> 'p50', 0.9 -> 'p90', 0.99 -> 'p99', 0.999 -> 'p99.9'."""
    return f"p{100 * q:.10g}"


@dataclass(frozen=True, slots=True)
class WorkFloor:
    """The least GPU seconds each kind of work can cost on the step-time model (kvlab.simulation.step_time), over
    every possible batch: a floor on a replica's busy time.

    token_s: one token position through everything but attention and the LM head, the per-step cost included
    and spread over the step size that makes it cheapest (up to max_num_batched_tokens). prefill_pair_s: one
    causal (query, key) pair of prefill attention, its FLOPs at the attention kernel's efficiency. decode_context_s:
    one context token a decode reads, its K/V bytes at the attention kernel's efficiency. All layers included.
    """

    token_s: float
    prefill_pair_s: float
    decode_context_s: float

    def request_seconds(self, prompt_len: int, output_len: int, cached_tokens: int = 0) -> float:
        """A request's least busy time: its prompt past cached_tokens prefilled (positions and causal pairs), then
        output_len - 1 decodes over contexts prompt_len + 1, ..., prompt_len + output_len - 1.

        A preemption only adds work: recomputing a context of c tokens costs c positions, more than the one decode
        read of c tokens it stands in for.
        """
        p, n, h = prompt_len, output_len, cached_tokens
        if not 0 <= h < p or n < 1:
            raise ValueError(f"need 0 <= cached_tokens < prompt_len and output_len >= 1, got cached_tokens={h}, "
                             f"prompt_len={p}, output_len={n}")
        positions = p - h + n - 1
        pairs = (p * (p + 1) - h * (h + 1)) // 2          # position i attends to i + 1 keys
        contexts = (n - 1) * p + (n - 1) * n // 2
        return positions * self.token_s + pairs * self.prefill_pair_s + contexts * self.decode_context_s


def work_floor(model: ModelSpec, gpu: GPU | str, tensor_parallel_size: int = 1, max_num_batched_tokens: int = 8192,
               step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S) -> WorkFloor:
    """The WorkFloor of a model on tensor_parallel_size GPUs: each operator's roofline term that grows with the
    work (the max() of a roofline is at least either term), fixed per-kernel costs dropped except in token_s."""
    gpu = get_gpu(gpu)
    check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
    check_number("step_overhead_s", step_overhead_s, what="number of seconds")
    best = math.inf
    for n in range(1, max_num_batched_tokens + 1):
        st = step_time(model, gpu, prefills=[(n, 0)], tensor_parallel_size=tensor_parallel_size, num_sampled=0,
                       step_overhead_s=0.0)
        best = min(best, (st.total_s - st.num_layers * st.per_layer["attn_prefill"] + step_overhead_s) / n)

    def attention(prefills=(), decodes=()) -> Op:
        name = "attn_prefill" if prefills else "attn_decode"
        return next(op for op in layer_ops(model, 0, tensor_parallel_size, prefills, decodes) if op.name == name)

    eff = EFFICIENCY["attention"]
    pair_flops = attention(prefills=[(1, 0)]).flops                                   # one causal pair
    context_bytes = attention(decodes=[2]).bytes - attention(decodes=[1]).bytes     # one more context token
    return WorkFloor(best, model.num_layers * pair_flops / (eff.flops * gpu.flops_per_s),
                     model.num_layers * context_bytes / (eff.memory * gpu.memory_bytes_per_s))


def replicas_lower_bound(busy_seconds: Callable[[int], float], span_s: float, max_replicas: int) -> int | None:
    """The fewest replicas k whose busiest replica's lower-bound busy time, busy_seconds(k), fits in span_s (the
    trace's arrival span); None if none up to max_replicas does.

    busy_seconds(k) is typically the sum of WorkFloor.request_seconds over the busiest replica's share. A replica
    busy for longer than the span on a steady arrival rate falls behind for good: its queue, and so
    its requests' TTFT, grows through the run, so fewer replicas than this fail any TTFT objective; a search for
    the fewest that meet an SLO can start here (fewest_replicas).
    """
    check_number("span_s", span_s, allow_zero=False, what="number of seconds")
    check_positive_int("max_replicas", max_replicas)
    for k in range(1, max_replicas + 1):
        if busy_seconds(k) <= span_s:
            return k
    return None


@dataclass(frozen=True, slots=True)
class ReplicaSearch:
    """The fewest replicas that met (None if none up to the limit) and every count tried, in order: count -> met."""

    replicas: int | None
    tried: dict[int, bool]


def fewest_replicas(meets: Callable[[int], bool], low: int, high: int) -> ReplicaSearch:
    """The fewest replicas in [low, high] for which meets(replicas) is True, assuming that more replicas never
    turn a deployment that met into one that fails.

    low must be a justified lower bound (replicas_lower_bound): meets(low) is tried first and returned if True.
    Otherwise the count climbs by steps that double (low + 1, low + 2, low + 4, ...; high last) until one
    meets, then the gap between the last that failed and the first that met is halved: a few runs even when
    low is far off, and exactly low's run when the bound is tight.
    """
    check_positive_int("low", low)
    check_positive_int("high", high)
    if high < low:
        raise ValueError(f"high must be at least low: the search runs over [low, high], got low={low}, high={high}")
    tried: dict[int, bool] = {}

    def run(k: int) -> bool:
        tried[k] = bool(meets(k))
        return tried[k]

    if run(low):
        return ReplicaSearch(low, tried)
    failed, step = low, 1
    while True:
        k = min(low + step, high)
        if run(k):
            break
        if k == high:
            return ReplicaSearch(None, tried)
        failed, step = k, 2 * step
    met = k
    while met - failed > 1:
        mid = (failed + met) // 2
        if run(mid):
            met = mid
        else:
            failed = mid
    return ReplicaSearch(met, tried)
