"""Serving latencies from a request's timestamps, as `vllm bench serve` defines them, and the decisions made with them.

    arrival ----- first token ---- token ---- token ---- ... ---- last token
            TTFT              ITL       ITL                          (E2E = last - arrival)

TPOT (time per output token) averages the decode part: (E2E - TTFT) / (tokens - 1). ITL lists every
gap between consecutive token arrivals; with streaming, a chunk that carries several tokens (a
speculative step) is one arrival. `knee_rate` finds the highest request rate before latency
shoots up; `pick_token_budget` chooses max_num_batched_tokens for a p99 TTFT and a p99 ITL target,
`meets_slos` and `goodput_budget` judge each request against SLOs as `vllm bench serve --goodput` does;
`normalized_latency` is the vLLM paper's metric (Figure 12), `percentile` the p50 / p99 of a list.

The same definitions serve the engine's histograms (kvlab.engine.metrics), the replay on a virtual
clock (kvlab.benchmarks.replay), the load generator against a live server (benchmarks/bench_serve.py)
and Chapter 9.
"""

import statistics
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LatencyMetrics:
    """One request's latencies (seconds)."""

    ttft: float
    tpot: float | None       # None for a single-token output: there is no decode part
    itl: tuple[float, ...]
    e2e: float


def latency_metrics(arrival: float, token_times, num_tokens: int | None = None) -> LatencyMetrics:
    """TTFT, TPOT, ITL and E2E of a request that arrived at `arrival` and got tokens at token_times (sorted).

    num_tokens: tokens generated, when an arrival can carry several (default: one per arrival).
    """
    times = [float(t) for t in token_times]
    if not times:
        raise ValueError("a request with no tokens has no latencies")
    if any(b < a for a, b in zip(times, times[1:])) or times[0] < arrival:
        raise ValueError("token times must be sorted and not before the arrival")
    n = len(times) if num_tokens is None else num_tokens
    if n < len(times):
        raise ValueError(f"{len(times)} token arrivals cannot carry only {n} tokens")
    ttft, e2e = times[0] - arrival, times[-1] - arrival
    tpot = (e2e - ttft) / (n - 1) if n > 1 else None
    return LatencyMetrics(ttft, tpot, tuple(b - a for a, b in zip(times, times[1:])), e2e)


def knee_rate(rates, latencies, factor: float = 2.0) -> float:
    """The highest rate whose latency stays within factor x the latency at the lowest rate (0 if none after it).

    rates and latencies pair up; rates above the first one that breaks the bound do not count, even if
    a later one happens to dip below it again.
    """
    pairs = sorted(zip(rates, latencies))
    if not pairs:
        raise ValueError("no measurements")
    if factor < 1:
        raise ValueError(f"factor must be >= 1, got {factor}")
    bound = factor * pairs[0][1]
    best = pairs[0][0]
    for rate, latency in pairs:
        if latency > bound:
            break
        best = rate
    return best


def pick_token_budget(measurements: dict, ttft_slo: float, itl_slo: float) -> int | None:
    """The max_num_batched_tokens to run: of the budgets whose p99 ITL and p99 TTFT meet their SLOs, the one
    with the lowest TTFT (ties: the smaller budget); None when no budget meets both.

    measurements: budget -> (ttft_p99, itl_p99) in the same unit as the SLOs.
    """
    ok = [(ttft, budget) for budget, (ttft, itl) in measurements.items() if ttft <= ttft_slo and itl <= itl_slo]
    return min(ok)[1] if ok else None


SLO_METRICS = ("ttft", "tpot", "e2el")   # the names `vllm bench serve --goodput` takes (vllm/benchmarks/serve.py)


def meets_slos(metrics: LatencyMetrics, slos: dict) -> bool:
    """Whether one request met every SLO given: slos maps "ttft", "tpot", "e2el" to seconds (any subset).

    A value equal to its SLO meets it; a single-token request has no decode part and meets any TPOT SLO
    (vLLM counts its TPOT as 0).
    """
    unknown = set(slos) - set(SLO_METRICS)
    if unknown:
        raise ValueError(f"unknown SLO metric(s) {sorted(unknown)}: use {', '.join(SLO_METRICS)}")
    values = {"ttft": metrics.ttft, "tpot": metrics.tpot or 0.0, "e2el": metrics.e2e}
    return all(values[name] <= limit for name, limit in slos.items())


def goodput_budget(runs: dict, slos: dict) -> int | None:
    """The max_num_batched_tokens under which the most requests met every SLO (ties: the smaller budget);
    None when no request met them under any budget.

    runs: budget -> [(arrival, token_times, num_tokens), ...], the same requests served under each budget
    (num_tokens None: one token per time); slos as for meets_slos.
    """
    meets_slos(LatencyMetrics(0.0, None, (), 0.0), slos)   # an unknown metric is an error even with no requests
    best = None
    for budget, requests in runs.items():
        good = sum(meets_slos(latency_metrics(arrival, times, n), slos) for arrival, times, n in requests)
        if good and (best is None or (-good, budget) < best):
            best = (-good, budget)
    return None if best is None else best[1]


def normalized_latency(timings) -> float:
    """The paper's metric: the mean over requests of end-to-end latency divided by output length (s/token).

    timings: objects with e2e (seconds) and output_len (tokens), e.g. kvlab.benchmarks.replay.RequestTiming.
    """
    return statistics.fmean(t.e2e / t.output_len for t in timings)


def percentile(values, q: float) -> float:
    """The q-quantile (0..1) by nearest rank; values need not be sorted."""
    values = sorted(values)
    if not values:
        raise ValueError("no values")
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]
