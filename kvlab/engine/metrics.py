"""The engine's metrics under vLLM's names, as `LLM.get_metrics()` returns them (vLLM's v1/metrics/reader.py shape).

Each metric is an object with `name` and `value`: a Counter only grows, a Gauge is a reading now, a
Vector is a list of counts (accepted draft tokens per position), a Histogram counts observations
(latencies) per bucket, with their sum and count. The online server exports the same
list in Prometheus' text format, so a dashboard built on `vllm:` names reads kvlab too.
"""

import bisect
from dataclasses import dataclass, field

# vLLM's buckets (seconds) for time to first token, inter-token latency and end-to-end latency.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True, slots=True)
class Metric:
    """One named figure; labels as in Prometheus (empty for kvlab's single model)."""

    name: str
    value: object
    labels: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Counter(Metric):
    """A total that only grows (Prometheus adds _total when it exports it)."""


@dataclass(frozen=True, slots=True)
class Gauge(Metric):
    """A value as it is now."""


@dataclass(frozen=True, slots=True)
class Vector(Metric):
    """A list of counts, one per position (vLLM's reader uses it for accepted tokens per draft position)."""


@dataclass(frozen=True, slots=True)
class Histogram(Metric):
    """value: the observation count; buckets: upper bounds; counts: observations per bucket (+inf last); sum."""

    buckets: tuple = ()
    counts: tuple = ()
    sum: float = 0.0


class HistogramRecorder:
    """Observations in fixed buckets, read out as a Histogram."""

    def __init__(self, name: str, buckets: tuple):
        self.name, self.buckets = name, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def metric(self) -> Histogram:
        return Histogram(self.name, self.count, buckets=self.buckets, counts=tuple(self.counts), sum=self.sum)


class RequestLatencies:
    """TTFT, inter-token and end-to-end latencies of an engine's requests, in vLLM's histograms."""

    def __init__(self):
        self.ttft = HistogramRecorder("vllm:time_to_first_token_seconds", TTFT_BUCKETS)
        self.itl = HistogramRecorder("vllm:inter_token_latency_seconds", ITL_BUCKETS)
        self.e2e = HistogramRecorder("vllm:e2e_request_latency_seconds", E2E_BUCKETS)

    def metrics(self) -> list[Histogram]:
        return [self.ttft.metric(), self.itl.metric(), self.e2e.metric()]


def engine_metrics(engine) -> list[Metric]:
    """Every metric of an LLMEngine now, vLLM's names first-class."""
    sched, manager = engine.scheduler, engine.kv_cache_manager
    running, waiting = sched.get_request_counts()
    metrics = [
        Gauge("vllm:num_requests_running", running),
        Gauge("vllm:num_requests_waiting", waiting),  # preempted requests wait again; swapped ones too
        Gauge("vllm:kv_cache_usage_perc", manager.num_used_blocks / engine.num_blocks),
        Counter("vllm:num_preemptions", sched.num_preemptions),
        Counter("vllm:prefix_cache_queries", manager.queries),
        Counter("vllm:prefix_cache_hits", manager.hits),
        Counter("vllm:prompt_tokens", engine.num_prompt_tokens),
        Counter("vllm:generation_tokens", engine.num_generation_tokens),
        Counter("vllm:request_success", engine.num_finished_requests),
        *engine.latencies.metrics(),
    ]
    spec = engine.spec_stats
    if spec is not None:
        metrics += [
            Counter("vllm:spec_decode_num_drafts", spec.num_drafts),
            Counter("vllm:spec_decode_num_draft_tokens", spec.num_draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", spec.num_accepted_tokens),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", list(spec.num_accepted_tokens_per_pos)),
        ]
    return metrics
