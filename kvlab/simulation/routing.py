"""Cache-aware routing at scale, simulated: N replicas of the simulated engine on one virtual clock behind a router.

Each replica is a kvlab.simulation.engine.SimulatedEngine (kvlab's real Scheduler and KVCacheManager, step times
from the step-time model). The router places every request at its arrival time with a RoutingPolicy of
kvlab.router.policies, the module the live HTTP router uses, given

    block_hashes   the prompt's full-block hashes, chained exactly as the replicas' KVCacheManager chains them
                   (its hash function and root), so the router and the replicas name blocks alike
    loads          per replica a ReplicaLoad: num_waiting, num_running and kv_cache_usage as the engine stood at
                   the end of its last finished step (vLLM refreshes its metrics once per step), num_waiting plus
                   the requests added after that step began; in_flight and active_blocks counted by the router
                   (active_blocks: ceil((prompt + outputs received so far) / block_size) per unfinished request)

precise-prefix and kv-cost read a kvlab.router.KVBlockIndex fed only by the replicas' own KV-cache events
(BlockStored / BlockRemoved from each engine's block pool, enable_kv_cache_events), one KVEventBatch per step
with a sequence number per replica, delivered when the step ends on the virtual clock: no shortcut reads a pool.

The clock: the replica whose next step starts earliest steps next, and every arrival at or before that instant is
dispatched first. A step is computed when it starts, but what the router learns from it (its events, its tokens,
the engine's counts) is delivered at its end, so a request placed while a step is in flight sees that replica as
it was before the step. An idle replica waits for its next request. Results per run (RoutingResult):

    per request      its RequestTiming (TTFT, TPOT, ITL, E2E by kvlab.benchmarks.latency) and its replica
    prefix hit rate  prompt tokens the replicas' prefix caches served / prompt tokens (each prompt counted once, at
                     its first admission, as vLLM exports it)
    prefill tokens   per replica, prompt tokens it computed (looked up less served)
    imbalance        max / mean over replicas of the prefill tokens computed (1.0: perfectly even; the work a
                     cache-aware router moves around), and request_imbalance, the same of request counts
    busy time        per replica, the sum of its steps' times
    SLO attainment   the share of requests with TTFT <= ttft_slo and TPOT <= tpot_slo (a one-token request is judged
                     by its TTFT alone)

Workloads: mooncake_requests, a slice of the Mooncake conversation trace with its arrivals compressed by a rate
scale (prompts from kvlab.analysis.mooncake.PromptSynthesizer: equal hash ids give equal tokens), and
hot_prefix_requests, where a share of requests opens with one long common prefix.

max_rate_scale_under_slo finds, per policy and replica count, the highest rate scale at which a deployment still
meets the objective, by kvlab.simulation.planning.max_rate_under_slo's bisection. The objective, by default: p90
TTFT <= 2 s and p90 TPOT <= 100 ms over all requests, benchmarks/mooncake_serving.py's (the trace's p90 prompt,
27,367 tokens, takes 1.0 s to prefill alone on one H100 in the step-time model, so 2 s leaves room to queue;
100 ms per token is faster than anyone reads). Percentiles rather than joint attainment, so that the search
judges exactly what the single-deployment planning of Chapter 10 judges; attainment is reported beside it.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from kvlab.benchmarks.datasets import poisson_arrivals
from kvlab.benchmarks.replay import RequestTiming
from kvlab.core.kv_events import KVEventBatch
from kvlab.core.prefix_cache import chain_hashes
from kvlab.router.kv_index import KVBlockIndex
from kvlab.router.policies import POLICIES, ReplicaLoad, make_policy
from kvlab.simulation.capacity import kv_capacity
from kvlab.simulation.engine import GPUStepTime, SimRequest, SimulatedEngine, model_config, resolve_model
from kvlab.simulation.planning import latency_percentiles, max_rate_under_slo, slo_figures
from kvlab.simulation.step_time import DEFAULT_STEP_OVERHEAD_S
from kvlab.validation import check_number, check_positive_int

DEFAULT_TTFT_SLO = 2.0    # seconds, at DEFAULT_SLO_QUANTILE
DEFAULT_TPOT_SLO = 0.1    # seconds per output token, at DEFAULT_SLO_QUANTILE
DEFAULT_SLO_QUANTILE = 0.9
MOONCAKE_MAX_MODEL_LEN = 131072  # the trace's longest request is 126,195 prompt tokens + output (Llama-3.1's context)


# ---------------------------------------------------------------------------------------------
# What a run gives.


@dataclass
class RoutingResult:
    """One trace through N replicas behind one policy: per request its timing and replica, per replica its counters."""

    policy: str
    num_replicas: int
    timings: list[RequestTiming]          # trace order
    replica_of: list[int]                 # per request, the replica it ran on
    prompt_tokens: list[int]              # per replica, prompt tokens looked up at first admission
    cached_prompt_tokens: list[int]       # per replica, of which its prefix cache served
    busy_s: list[float]                   # per replica, the sum of its steps' times
    num_steps: list[int]                  # per replica
    num_preemptions: int
    simulated_s: float                    # the virtual clock when the last replica finished
    wall_s: float                         # what the simulation took on this machine
    index_blocks: int = 0                 # (block, replica) entries in the router's index at the end
    extra: dict = field(default_factory=dict)

    @property
    def requests_per_replica(self) -> list[int]:
        counts = [0] * self.num_replicas
        for r in self.replica_of:
            counts[r] += 1
        return counts

    @property
    def prefill_tokens(self) -> list[int]:
        """Per replica, the prompt tokens it computed: looked up at first admission less what its cache served."""
        return [p - c for p, c in zip(self.prompt_tokens, self.cached_prompt_tokens)]

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the replicas' prefix caches / prompt tokens."""
        total = sum(self.prompt_tokens)
        return sum(self.cached_prompt_tokens) / total if total else 0.0

    @property
    def imbalance(self) -> float:
        """max / mean of per-replica prefill tokens computed (1.0: even); 1.0 when no replica computed any."""
        return _max_over_mean(self.prefill_tokens)

    @property
    def request_imbalance(self) -> float:
        """max / mean of per-replica request counts (1.0: even)."""
        return _max_over_mean(self.requests_per_replica)

    def slo_attainment(self, ttft_slo: float = DEFAULT_TTFT_SLO, tpot_slo: float = DEFAULT_TPOT_SLO) -> float:
        """The share of requests with TTFT <= ttft_slo and TPOT <= tpot_slo (TTFT alone for one-token requests)."""
        check_number("ttft_slo", ttft_slo, what="number of seconds")
        check_number("tpot_slo", tpot_slo, what="number of seconds")
        met = 0
        for t in self.timings:
            m = t.metrics()
            met += m.ttft <= ttft_slo and (m.tpot is None or m.tpot <= tpot_slo)
        return met / len(self.timings) if self.timings else 0.0

    def latency(self, quantiles: Sequence[float] = (0.5, 0.9, 0.99)) -> dict:
        """TTFT, TPOT, ITL and E2E at each quantile over every request (planning.latency_percentiles)."""
        return latency_percentiles(self.timings, quantiles)

    def summary(self, ttft_slo: float = DEFAULT_TTFT_SLO, tpot_slo: float = DEFAULT_TPOT_SLO) -> dict:
        """The run's figures as plain numbers (what a table row or a plot reads)."""
        lat = self.latency()
        return dict(policy=self.policy, replicas=self.num_replicas, requests=len(self.timings),
                    hit_rate=self.prefix_hit_rate, ttft_p50=lat["ttft"]["p50"], ttft_p90=lat["ttft"]["p90"],
                    ttft_p99=lat["ttft"]["p99"], tpot_p90=lat["tpot"]["p90"], imbalance=self.imbalance,
                    request_imbalance=self.request_imbalance, slo_attainment=self.slo_attainment(ttft_slo, tpot_slo),
                    prefill_tokens=sum(self.prefill_tokens), requests_per_replica=self.requests_per_replica,
                    busy_s=[round(b, 3) for b in self.busy_s], preemptions=self.num_preemptions,
                    simulated_s=self.simulated_s, wall_s=round(self.wall_s, 2))


def _max_over_mean(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


# ---------------------------------------------------------------------------------------------
# The replicas and the router on one clock.


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, hash_fn: Callable, root=None) -> list[Hashable]:
    """The full blocks' hashes of a prompt, chained from root as KVCacheManager chains them: (num_full_blocks,)."""
    return chain_hashes(token_ids, block_size, hash_fn, root)


@dataclass(slots=True)
class _Placed:
    """The router's record of one request it placed and that has not finished."""

    replica: int
    num_tokens: int     # prompt + outputs received so far
    blocks: int         # ceil(num_tokens / block_size), its share of the replica's active_blocks


class _Replica:
    """One engine and what the router has learnt of it: the published snapshot, its counters, its next step."""

    def __init__(self, engine: SimulatedEngine):
        self.engine = engine
        self.next_start: float | None = None   # None: idle, no unfinished request
        self.clock = 0.0                       # when its last step ended
        self.pending = None                    # (end, events, outputs, waiting, running, usage, joined) undelivered
        self.seq = 0                           # KV event batches published
        self.waiting = self.running = 0       # as of its last delivered step
        self.usage = 0.0
        self.joined = 0                        # requests added to it so far
        self.joined_seen = 0                   # of which the last delivered step's counts include
        self.in_flight = 0
        self.active_blocks = 0
        self.busy_s = 0.0


def _policy_for(policy, index: KVBlockIndex, block_size: int, overlap_score_weight: float,
                approx_capacity_blocks: int | None):
    """A RoutingPolicy from a name of kvlab.router.policies.POLICIES, or from a function of the index building one."""
    if callable(policy) and not isinstance(policy, str):
        return policy(index)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)} (or a function of a KVBlockIndex returning a "
                         f"RoutingPolicy), got {policy!r}")
    return make_policy(policy, block_size, index=index, overlap_score_weight=overlap_score_weight,
                       approx_capacity_blocks=approx_capacity_blocks)


def replica_deployment(model="llama-3-8b", gpu="H100-SXM", tensor_parallel_size: int = 1,
                       max_model_len: int | None = None, num_blocks: int | None = None, block_size: int = 16,
                       max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                       gpu_memory_utilization: float = 0.92,
                       step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S) -> tuple[GPUStepTime, int, int]:
    """(step-time function, num_blocks, max_model_len) of one replica, sized as simulate() sizes its deployment."""
    config = model_config(model)
    spec = resolve_model(config)
    if max_model_len is None:
        max_model_len = int(config["max_position_embeddings"])
    check_positive_int("max_model_len", max_model_len)
    if num_blocks is None:
        budget = kv_capacity(config, gpu, tensor_parallel_size, gpu_memory_utilization, block_size,
                             max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len)
        if budget.num_blocks < 1:
            raise ValueError(f"{spec.name} leaves no memory for KV blocks on {tensor_parallel_size} x {gpu}: add GPUs "
                             f"(tensor_parallel_size)")
        num_blocks = budget.num_blocks
    return GPUStepTime(spec, gpu, tensor_parallel_size, step_overhead_s), num_blocks, max_model_len


def simulate_routing(requests: Sequence[SimRequest], policy, num_replicas: int, model="llama-3-8b",
                     gpu="H100-SXM", tensor_parallel_size: int = 1, max_model_len: int | None = None,
                     num_blocks: int | None = None, block_size: int = 16, max_num_seqs: int = 256,
                     max_num_batched_tokens: int = 8192, overlap_score_weight: float = 1.0,
                     approx_capacity_blocks: int | None = None, step_time_fn=None,
                     prefix_caching_hash_algo: str = "builtin", hash_seed: str | None = None,
                     max_steps: int = 10**8) -> RoutingResult:
    """Serve a trace (SimRequests sorted by arrival) on num_replicas simulated engines behind one routing policy.

    policy: a name of kvlab.router.policies.POLICIES (made with make_policy and this run's KVBlockIndex,
    overlap_score_weight and approx_capacity_blocks), or a function of the KVBlockIndex returning a RoutingPolicy.
    Every replica is the same deployment: model on tensor_parallel_size x gpu, its pool sized by kv_capacity unless
    num_blocks is given (replica_deployment); step_time_fn replaces the step-time model. prefix_caching_hash_algo:
    "builtin" (fast, one process) as the other Mooncake simulations use, or "sha256", the live engine's. hash_seed:
    the replicas' (and so the router's) root of the block-hash chain, as `kvlab serve --hash-seed`.
    """
    started = time.perf_counter()
    check_positive_int("num_replicas", num_replicas)
    check_number("overlap_score_weight", overlap_score_weight, what="weight")
    if not isinstance(requests, Sequence):
        raise ValueError(f"requests must be a sequence of SimRequest sorted by arrival, got {type(requests).__name__}")
    for i, r in enumerate(requests):
        if not isinstance(r, SimRequest):
            raise ValueError(f"requests[{i}] must be a SimRequest, got {type(r).__name__}")
        if isinstance(r.arrival, bool) or not isinstance(r.arrival, (int, float)) or not math.isfinite(r.arrival) \
                or r.arrival < 0:
            raise ValueError(f"requests[{i}].arrival must be a finite number of seconds >= 0, got {r.arrival!r}")
        if i and r.arrival < requests[i - 1].arrival:
            raise ValueError(f"requests must be sorted by arrival: requests[{i}] arrives at {r.arrival:g} s, before "
                             f"requests[{i - 1}] at {requests[i - 1].arrival:g} s")
    default_fn, num_blocks, max_model_len = replica_deployment(model, gpu, tensor_parallel_size, max_model_len,
                                                               num_blocks, block_size, max_num_seqs,
                                                               max_num_batched_tokens)
    step_time_fn = default_fn if step_time_fn is None else step_time_fn
    replicas = [_Replica(SimulatedEngine(step_time_fn, num_blocks, max_model_len, block_size, max_num_seqs,
                                         max_num_batched_tokens, True,
                                         prefix_caching_hash_algo=prefix_caching_hash_algo,
                                         enable_kv_cache_events=True, hash_seed=hash_seed))
                for _ in range(num_replicas)]
    manager = replicas[0].engine.kv_cache_manager
    # The router hashes prompts as the replicas do: their hash function, from their seed's root.
    hash_fn, root = manager.hash_fn, manager.none_hash
    index = KVBlockIndex(block_size, hash_fn=hash_fn, hash_seed=manager.hash_seed)
    router = _policy_for(policy, index, block_size, overlap_score_weight, approx_capacity_blocks)
    name = getattr(router, "name", str(policy))
    for i, r in enumerate(requests):  # every request must fit one replica, as simulate() checks its own
        replicas[0].engine.check_request(str(i), len(r.prompt_token_ids), r.output_len)

    timings: list[RequestTiming] = []
    replica_of: list[int] = []
    placed: dict[str, _Placed] = {}
    steps_left = max_steps

    def deliver(rep_id: int, rep: _Replica) -> None:
        """What a finished step tells the router: its KV events, its requests' tokens, the engine's counts."""
        end, events, outputs, waiting, running, usage, joined = rep.pending
        rep.pending = None
        if events:
            rep.seq += 1
            index.apply(rep_id, KVEventBatch(end, events), rep.seq)
        for out in outputs:
            p = placed[out.request_id]
            p.num_tokens += len(out.new_token_ids)
            blocks = -(-p.num_tokens // block_size)
            rep.active_blocks += blocks - p.blocks
            p.blocks = blocks
            if out.status.finished:
                rep.active_blocks -= p.blocks
                rep.in_flight -= 1
                del placed[out.request_id]
        rep.waiting, rep.running, rep.usage, rep.joined_seen = waiting, running, usage, joined

    def deliver_until(now: float) -> None:
        for rep_id, rep in enumerate(replicas):
            if rep.pending is not None and rep.pending[0] <= now:
                deliver(rep_id, rep)

    next_request = 0
    while True:
        busy = [(rep.next_start, i) for i, rep in enumerate(replicas) if rep.next_start is not None]
        first_start, first = min(busy) if busy else (math.inf, -1)
        if next_request < len(requests) and requests[next_request].arrival <= first_start:
            request = requests[next_request]
            now = request.arrival
            deliver_until(now)
            hashes = prompt_block_hashes(request.prompt_token_ids, block_size, hash_fn, root)
            loads = {i: _load(rep) for i, rep in enumerate(replicas)}
            chosen = router.choose(hashes, loads)
            if chosen not in loads:
                raise RuntimeError(f"policy {name} chose {chosen!r}, not one of the replicas {list(loads)}")
            router.on_routed(chosen, hashes)
            rep = replicas[chosen]
            rid = str(next_request)
            rep.engine.add_request(rid, request.prompt_token_ids, request.output_len, request.output_token_ids)
            prompt_len = len(request.prompt_token_ids)
            blocks = -(-prompt_len // block_size)
            placed[rid] = _Placed(chosen, prompt_len, blocks)
            rep.in_flight += 1
            rep.active_blocks += blocks
            rep.joined += 1
            if rep.next_start is None:
                rep.next_start = max(rep.clock, now)
            timings.append(RequestTiming(request.arrival, prompt_len, request.output_len))
            replica_of.append(chosen)
            next_request += 1
            continue
        if first < 0:
            break
        if steps_left == 0:
            raise RuntimeError(f"the replicas did not finish within {max_steps} steps")
        steps_left -= 1
        rep = replicas[first]
        if rep.pending is not None:
            deliver(first, rep)
        engine = rep.engine
        engine.now = first_start
        seconds, scheduler_output, outputs = engine.step()
        if not scheduler_output.total_num_scheduled_tokens and not engine.scheduler.running:
            raise RuntimeError(f"replica {first} is stuck at {first_start:.6g} s: nothing runs and the first of its "
                               f"{len(engine.scheduler.waiting)} waiting requests does not fit in its "
                               f"{engine.kv_cache_manager.num_free_blocks} free blocks")
        end = first_start + seconds
        rep.busy_s += seconds
        for out in outputs:
            timings[int(out.request_id)].got_tokens(end, out.status.finished)
        kv = engine.kv_cache_manager
        rep.pending = (end, kv.take_events(), outputs, len(engine.scheduler.waiting), len(engine.scheduler.running),
                       kv.num_used_blocks / kv.num_blocks, rep.joined)
        rep.clock = end
        rep.next_start = end if engine.has_unfinished_requests() else None
    for i, rep in enumerate(replicas):
        if rep.pending is not None:
            deliver(i, rep)
    kvs = [rep.engine.kv_cache_manager for rep in replicas]
    return RoutingResult(name, num_replicas, timings, replica_of, [kv.queries for kv in kvs], [kv.hits for kv in kvs],
                         [rep.busy_s for rep in replicas], [rep.engine.step_count for rep in replicas],
                         sum(rep.engine.scheduler.num_preemptions for rep in replicas),
                         max(rep.clock for rep in replicas), time.perf_counter() - started,
                         sum(len(h) for h in index.held.values()),
                         extra=dict(index=index, engines=[rep.engine for rep in replicas]))


def _load(rep: _Replica) -> ReplicaLoad:
    return ReplicaLoad(num_waiting=rep.waiting + rep.joined - rep.joined_seen, num_running=rep.running,
                       kv_cache_usage=rep.usage, in_flight=rep.in_flight, active_blocks=rep.active_blocks)


# ---------------------------------------------------------------------------------------------
# Workloads.


def mooncake_requests(limit: int | None = None, rate_scale: float = 1.0, vocab_size: int = 128256,
                      max_model_len: int = MOONCAKE_MAX_MODEL_LEN, trace=None) -> list[SimRequest]:
    """The Mooncake conversation trace's first `limit` requests with arrivals divided by rate_scale (2.0: twice the
    rate), prompts from PromptSynthesizer(vocab_size) as benchmarks/mooncake_serving.py builds them.

    trace: already loaded MooncakeRequests to use instead of reading the file. Requests longer than max_model_len
    (prompt + output) are an error, as in simulate().
    """
    from kvlab.analysis.mooncake import PromptSynthesizer, load_mooncake_trace

    check_number("rate_scale", rate_scale, allow_zero=False, what="factor")
    if trace is None:
        trace = load_mooncake_trace("conversation", limit=limit)
    elif limit is not None:
        trace = trace[:limit]
    synth = PromptSynthesizer(vocab_size)
    start = trace[0].arrival_s if trace else 0.0
    out = []
    for r in trace:
        if r.input_length + r.output_length > max_model_len:
            raise ValueError(f"Mooncake request {r.request_id}: {r.input_length} + {r.output_length} tokens exceed "
                             f"max_model_len {max_model_len}")
        out.append(SimRequest((r.arrival_s - start) / rate_scale, synth.prompt_token_ids(r).tolist(), r.output_length))
    return out


def rescale_arrivals(requests: Sequence[SimRequest], rate_scale: float) -> list[SimRequest]:
    """The same requests with every arrival divided by rate_scale (the prompts are shared, not copied)."""
    check_number("rate_scale", rate_scale, allow_zero=False, what="factor")
    return [SimRequest(r.arrival / rate_scale, r.prompt_token_ids, r.output_len, r.output_token_ids)
            for r in requests]


def hot_prefix_requests(count: int, rate: float, hot_fraction: float = 0.8, prefix_len: int = 6144,
                        suffix_len: int = 128, cold_prompt_len: int = 1024, output_len: int = 512,
                        vocab_size: int = 128256, lead_in_s: float = 1.0, seed: int = 0) -> list[SimRequest]:
    """A prefix that turns hot: one request with it at time 0, then, from lead_in_s on, count - 1 requests arriving as
    a Poisson process at `rate` per second, each with probability hot_fraction the shared prefix of prefix_len tokens
    (a long system prompt or document) followed by suffix_len fresh tokens, otherwise cold_prompt_len fresh tokens.
    Every request generates output_len tokens. Fresh tokens come from a seeded generator, so only the hot prefix is
    shared: prompts of shape (prefix_len + suffix_len,) or (cold_prompt_len,).

    By the time the stream starts, one replica has cached the prefix (lead_in_s is longer than its prefill) and
    its KV events have told the router so. At a rate whose hot share is more than one replica can serve, a router
    that follows the prefix alone (precise-prefix) keeps sending every hot request to that replica, whose queue
    grows while the others idle; kv-cost sends one elsewhere once the holder's active blocks exceed another's by
    overlap_score_weight x the prefix's blocks, and the new holder then shares the load.
    """
    check_positive_int("count", count)
    check_number("rate", rate, allow_zero=False, what="request rate")
    check_number("hot_fraction", hot_fraction, what="fraction")
    if hot_fraction > 1:
        raise ValueError(f"hot_fraction is a share of requests in [0, 1], got {hot_fraction}")
    for name, value in (("prefix_len", prefix_len), ("suffix_len", suffix_len), ("cold_prompt_len", cold_prompt_len),
                        ("output_len", output_len), ("vocab_size", vocab_size)):
        check_positive_int(name, value)
    check_number("lead_in_s", lead_in_s, what="number of seconds")
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    out = [SimRequest(0.0, prefix + [rng.randrange(vocab_size) for _ in range(suffix_len)], output_len)]
    for arrival in poisson_arrivals(count - 1, rate, seed) if count > 1 else ():
        arrival += lead_in_s
        if rng.random() < hot_fraction:
            prompt = prefix + [rng.randrange(vocab_size) for _ in range(suffix_len)]
        else:
            prompt = [rng.randrange(vocab_size) for _ in range(cold_prompt_len)]
        out.append(SimRequest(arrival, prompt, output_len))
    return out


# ---------------------------------------------------------------------------------------------
# The rate at which a policy stops holding the objective.


@dataclass(frozen=True, slots=True)
class RateSearch:
    """The highest rate scale found to meet the objective (None: not even the lowest); every run, scale -> figures."""

    rate_scale: float | None
    runs: dict


def max_rate_scale_under_slo(requests: Sequence[SimRequest], policy, num_replicas: int, low: float, high: float,
                             tolerance: float, ttft_slo: float = DEFAULT_TTFT_SLO, tpot_slo: float = DEFAULT_TPOT_SLO,
                             quantile: float = DEFAULT_SLO_QUANTILE, **routing_knobs) -> RateSearch:
    """The highest scale of the trace's arrival rate in [low, high] (to tolerance) at which num_replicas behind policy
    still meet p{quantile} TTFT <= ttft_slo and TPOT <= tpot_slo: planning.max_rate_under_slo over simulate_routing
    of rescale_arrivals(requests, scale); routing_knobs go to simulate_routing."""
    check_number("quantile", quantile, what="quantile")
    runs: dict[float, dict] = {}

    def figures(scale: float) -> tuple[float, float]:
        result = simulate_routing(rescale_arrivals(requests, scale), policy, num_replicas, **routing_knobs)
        ttft, tpot = slo_figures(result.timings, quantile)
        runs[scale] = dict(ttft=ttft, tpot=tpot, met=ttft <= ttft_slo and tpot <= tpot_slo,
                           attainment=result.slo_attainment(ttft_slo, tpot_slo), hit_rate=result.prefix_hit_rate,
                           wall_s=round(result.wall_s, 2))
        return ttft, tpot

    return RateSearch(max_rate_under_slo(figures, ttft_slo, tpot_slo, low, high, tolerance), runs)


# ---------------------------------------------------------------------------------------------
# Data for the chapter's plots.


def weight_sweep(requests: Sequence[SimRequest], num_replicas: int, weights: Sequence[float],
                 ttft_slo: float = DEFAULT_TTFT_SLO, tpot_slo: float = DEFAULT_TPOT_SLO,
                 baselines: Sequence[str] = ("least-loaded", "precise-prefix"), **routing_knobs) -> dict:
    """kv-cost at each overlap_score_weight, and each baseline policy once, on one workload: {"kv-cost": [summary
    per weight, with its "weight"], baseline: summary}; a plot draws TTFT p99 or SLO attainment against the weight
    with the baselines as horizontal lines."""
    if not weights:
        raise ValueError("weights must list at least one overlap_score_weight")
    sweep = []
    for w in weights:
        result = simulate_routing(requests, "kv-cost", num_replicas, overlap_score_weight=w, **routing_knobs)
        sweep.append(dict(result.summary(ttft_slo, tpot_slo), weight=w))
    out: dict = {"kv-cost": sweep}
    for name in baselines:
        out[name] = simulate_routing(requests, name, num_replicas, **routing_knobs).summary(ttft_slo, tpot_slo)
    return out


def policy_grid(requests: Sequence[SimRequest], policies: Sequence[str], replica_counts: Sequence[int],
                ttft_slo: float = DEFAULT_TTFT_SLO, tpot_slo: float = DEFAULT_TPOT_SLO, **routing_knobs) -> list[dict]:
    """RoutingResult.summary() of every policy at every replica count on one workload, in that order: the rows a
    chapter's plot of hit rate, TTFT or SLO attainment against the replica count reads."""
    return [simulate_routing(requests, p, n, **routing_knobs).summary(ttft_slo, tpot_slo)
            for n in replica_counts for p in policies]
