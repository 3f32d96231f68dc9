"""The engine's metrics in Prometheus' text format, through prometheus_client, from what `LLM.get_metrics()` returns.

One list of kvlab.engine.metrics objects feeds both: Python reads `llm.get_metrics()`, a Prometheus
server scrapes GET /metrics. Counters get prometheus_client's `_total` suffix, as vLLM's do.
"""

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvlab.engine.metrics import Counter, Gauge, Histogram, Vector

HELP = {
    "vllm:num_requests_running": "Requests in the running queue (admitted, holding blocks).",
    "vllm:num_requests_waiting": "Requests waiting to be admitted (or swapped out).",
    "vllm:kv_cache_usage_perc": "Fraction of KV cache blocks in use (1 = full).",
    "vllm:num_preemptions": "Requests preempted to free KV blocks.",
    "vllm:prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "vllm:prefix_cache_hits": "Prompt tokens served from the prefix cache.",
    "vllm:prompt_tokens": "Prompt tokens of requests that produced their first token.",
    "vllm:generation_tokens": "Tokens generated.",
    "vllm:request_success": "Requests that finished (stop or length).",
    "vllm:time_to_first_token_seconds": "Seconds from a request's arrival to its first token.",
    "vllm:inter_token_latency_seconds": "Seconds between a request's consecutive token steps.",
    "vllm:e2e_request_latency_seconds": "Seconds from a request's arrival to its last token.",
    "vllm:spec_decode_num_drafts": "Verifications with at least one draft token.",
    "vllm:spec_decode_num_draft_tokens": "Draft tokens verified.",
    "vllm:spec_decode_num_accepted_tokens": "Draft tokens accepted.",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "Draft tokens accepted at each position.",
}


def metric_families(metrics: list, model_name: str):
    """prometheus_client metric families for kvlab's metrics, labelled with the served model's name."""
    for m in metrics:
        doc = HELP.get(m.name, m.name)
        if isinstance(m, Counter):
            family = CounterMetricFamily(m.name, doc, labels=["model_name"])
            family.add_metric([model_name], m.value)
        elif isinstance(m, Gauge):
            family = GaugeMetricFamily(m.name, doc, labels=["model_name"])
            family.add_metric([model_name], m.value)
        elif isinstance(m, Vector):
            family = CounterMetricFamily(m.name, doc, labels=["model_name", "position"])
            for pos, count in enumerate(m.value):
                family.add_metric([model_name, str(pos)], count)
        elif isinstance(m, Histogram):
            family = HistogramMetricFamily(m.name, doc, labels=["model_name"])
            cumulative, running = [], 0
            for bound, count in zip([*m.buckets, float("inf")], m.counts):
                running += count
                cumulative.append((str(bound) if bound != float("inf") else "+Inf", running))
            family.add_metric([model_name], cumulative, sum_value=m.sum)
        else:
            continue
        yield family


class EngineCollector(Collector):
    """A prometheus_client collector over the latest snapshot of the engine's metrics."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.snapshot: list = []

    def collect(self):
        yield from metric_families(self.snapshot, self.model_name)


def exposition(metrics: list, model_name: str) -> bytes:
    """The metrics as Prometheus' text exposition format (what GET /metrics returns)."""
    registry = CollectorRegistry(auto_describe=False)
    collector = EngineCollector(model_name)
    collector.snapshot = metrics
    registry.register(collector)
    return generate_latest(registry)
