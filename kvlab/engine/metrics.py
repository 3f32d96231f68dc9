"""The engine's metrics under vLLM's names, as `LLM.get_metrics()` returns them (vLLM's v1/metrics/reader.py shape).

Each metric is an object with `name` and `value`: a Counter only grows, a Gauge is a reading now, a
Vector is a list of counts (accepted draft tokens per position). The online server exports the same
list in Prometheus' text format, so a dashboard built on `vllm:` names reads kvlab too.
"""

from dataclasses import dataclass, field


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


def engine_metrics(engine) -> list[Metric]:
    """Every metric of an LLMEngine now, vLLM's names first-class."""
    sched, manager = engine.scheduler, engine.kv_cache_manager
    metrics = [
        Gauge("vllm:num_requests_running", len(sched.running)),
        Gauge("vllm:num_requests_waiting", len(sched.waiting) + len(sched.swapped)),
        Gauge("vllm:kv_cache_usage_perc", manager.num_used_blocks / engine.num_blocks),
        Counter("vllm:num_preemptions", sched.num_preemptions),
        Counter("vllm:prefix_cache_queries", manager.queries),
        Counter("vllm:prefix_cache_hits", manager.hits),
        Counter("vllm:prompt_tokens", engine.num_prompt_tokens),
        Counter("vllm:generation_tokens", engine.num_generation_tokens),
        Counter("vllm:request_success", engine.num_finished_requests),
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
