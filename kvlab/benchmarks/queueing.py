"""Queueing figures of a replayed run, to set beside the formulas (utilisation, Little's law, the 1/(1-rho) wait).

    spans = []
    timings = replay(make_engine, prompts, output_lens, rate, spans=spans)   # kvlab.benchmarks.replay
    lam = arrival_rate([t.arrival for t in timings])         # lambda, requests per second
    service = busy_time(spans) / len(timings)                 # E[S]: the engine's busy time per request
    busy_fraction(spans, timings[-1].arrival)                 # rho measured, to compare with lam * service
    mean_in_system(spans, engine.history, makespan(timings))  # L from the dashboard, to compare with lambda * W

Queueing theory speaks of a server that is busy or idle and of requests that wait for it: utilisation
rho = lambda * E[S] (the share of time the server is busy), Little's law L = lambda * W (requests in the
system on average = arrival rate x mean time in it), and a single server's mean wait rho / (1 - rho) * E[S]
(Poisson arrivals, exponential service), which grows without bound as rho approaches 1. A continuous-
batching engine is such a server for its steps, but it serves many requests in each step, so E[S] (busy
time per request) falls as the load rises.
"""

_IN_ENGINE = ("running", "waiting", "preempted")


def arrival_rate(arrivals) -> float:
    """The measured arrival rate lambda (requests/s): arrivals after the first, over the time they span."""
    arrivals = list(arrivals)
    if len(arrivals) < 2 or arrivals[-1] <= arrivals[0]:
        raise ValueError("need at least two arrivals spread over time to measure a rate")
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def busy_time(spans) -> float:
    """Seconds the engine spent in steps; spans: each step's (start, end) on the virtual clock."""
    return sum(end - start for start, end in spans)


def busy_fraction(spans, until: float, since: float = 0.0) -> float:
    """Utilisation measured: the share of the window [since, until] that the engine spent in steps."""
    if until <= since:
        raise ValueError(f"the window must have a length, got [{since}, {until}]")
    return sum(max(0.0, min(end, until) - max(start, since)) for start, end in spans) / (until - since)


def makespan(timings) -> float:
    """From the first arrival to the last finish (s): the time over which the run's averages are taken."""
    return max(t.finish for t in timings) - min(t.arrival for t in timings)


def mean_in_system(spans, history, duration: float) -> float:
    """L read from the dashboard: the time-average over `duration` of the requests in the engine (running,
    waiting, preempted, or finishing) during each step; idle time counts as zero.

    spans and history pair up, one (start, end) and one StepRecord (kvlab.engine.stats) per step.
    """
    if len(spans) != len(history):
        raise ValueError(f"one span per step record, got {len(spans)} spans and {len(history)} records")
    total, before = 0.0, {}
    for (start, end), record in zip(spans, history):
        # A request that finished in this step was in the engine during it.
        inside = sum(1 for rid, status in record.status.items()
                     if status in _IN_ENGINE or before.get(rid, "waiting") in _IN_ENGINE)
        total += inside * (end - start)
        before = record.status
    return total / duration


def single_server_wait(rho: float, service: float) -> float:
    """Mean time in the queue of a single server with Poisson arrivals and exponential service (M/M/1):
    rho / (1 - rho) x E[S]; infinite from rho = 1 on (the queue grows for as long as requests arrive)."""
    if rho < 0 or service < 0:
        raise ValueError(f"rho and the service time must be >= 0, got {rho} and {service}")
    return float("inf") if rho >= 1 else rho / (1 - rho) * service
