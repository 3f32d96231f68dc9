"""The requests a benchmark sends: lengths from a trace, prompts cut from a text, arrivals in time (vLLM's
vllm/benchmarks/datasets.py).

    requests = scale_to_context(load_trace(ASSETS_DIR / "traces" / "chat.csv")[:64], 240)
    prompts = prompts_from_text(requests, text, lambda s: tokenizer(s)["input_ids"])
    arrivals = poisson_arrivals(len(prompts), rate=8.0, seed=0)

`chat_workload` does all of it for the shipped chat trace (ShareGPT-like lengths) and text;
`mixed_workload` draws short prompts with widely mixed output lengths, the case where static batches
wait longest for their longest member.
"""

import random

from kvlab.analysis.traces import TraceRequest, load_trace
from kvlab.paths import ASSETS_DIR


def fit_to_context(requests: list[TraceRequest], max_tokens: int) -> list[TraceRequest]:
    """The requests scaled so that prompt + output <= max_tokens, each keeping its prompt-to-output ratio.

    A small model's context (the embedded model's is 256) cannot hold ShareGPT-length requests;
    scaling keeps the mix of short and long requests and the share of prompt tokens.
    """
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2 (one prompt and one output token), got {max_tokens}")
    fitted = []
    for r in requests:
        scale = min(1.0, max_tokens / r.final_len)
        prompt_len = max(1, round(r.prompt_len * scale))
        output_len = max(1, min(max_tokens - prompt_len, round(r.output_len * scale)))
        fitted.append(TraceRequest(r.request_id, r.arrival_step, prompt_len, output_len))
    return fitted


def scale_to_context(requests: list[TraceRequest], max_tokens: int, quantile: float = 0.95) -> list[TraceRequest]:
    """The requests' lengths times one common factor, so the `quantile` of prompt + output fits max_tokens.

    Unlike fit_to_context this keeps the spread of lengths (short requests stay short); the few
    requests still too long are clipped, the prompt to at most max_tokens // 2 first, then the output.
    """
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2 (one prompt and one output token), got {max_tokens}")
    if not requests:
        return []
    lengths = sorted(r.final_len for r in requests)
    target = lengths[min(len(lengths) - 1, int(quantile * len(lengths)))]
    scale = min(1.0, max_tokens / target)
    scaled = []
    for r in requests:
        prompt_len = max(1, round(r.prompt_len * scale))
        output_len = max(1, round(r.output_len * scale))
        if prompt_len + output_len > max_tokens:
            prompt_len = min(prompt_len, max(1, max_tokens // 2))
            output_len = min(output_len, max_tokens - prompt_len)
        scaled.append(TraceRequest(r.request_id, r.arrival_step, prompt_len, output_len))
    return scaled


def prompts_from_text(requests: list[TraceRequest], text: str, tokenize) -> list[list[int]]:
    """Prompt token ids of each request's prompt_len, cut from `text` at a place that depends on its id.

    tokenize(str) -> list[int]; with a character-level tokenizer one character is one token.
    """
    prompts = []
    for r in requests:
        window = r.prompt_len + 16  # enough characters for a character-level tokenizer; checked below
        if len(text) <= window:
            raise ValueError(f"the text has {len(text)} characters, too few for a {r.prompt_len}-token prompt")
        start = (r.request_id * 7919) % (len(text) - window)
        ids = list(tokenize(text[start : start + window]))[: r.prompt_len]
        if len(ids) < r.prompt_len:
            raise ValueError(f"request {r.request_id}: only {len(ids)} tokens in its slice of the text")
        prompts.append(ids)
    return prompts


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s) of num requests at `rate` per second: the first at 0, then exponential gaps of mean 1/rate
    (one seeded draw each); all at 0 for an infinite rate.

    vLLM's `vllm bench serve` draws gamma gaps (--burstiness, 1 = exponential), the first one before the first
    request, and rescales them so that the last request goes out at exactly num / rate; this does not rescale.
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests per second, got {rate}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(num):
        times.append(t)
        if rate != float("inf"):
            t += rng.expovariate(rate)
    return times


def chat_workload(count: int, tokenizer, max_tokens: int, quantile: float = 0.95) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids, output lengths) of the shipped chat trace's first `count` requests, scaled so that the
    quantile of prompt + output fits max_tokens, prompts cut from the shipped Shakespeare text."""
    fitted = scale_to_context(load_trace(ASSETS_DIR / "traces" / "chat.csv")[:count], max_tokens, quantile)
    text = (ASSETS_DIR / "text" / "shakespeare.txt").read_text(encoding="utf-8")
    prompts = prompts_from_text(fitted, text, lambda s: tokenizer(s)["input_ids"])
    return prompts, [r.output_len for r in fitted]


def mixed_workload(count: int, tokenizer, max_tokens: int, prompt_range: tuple[int, int] = (4, 24),
                   seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids, output lengths): short prompts and output lengths spread log-uniformly from 1 to what the
    context leaves, seeded; prompts cut from the shipped text."""
    if count < 1 or max_tokens < prompt_range[1] + 1:
        raise ValueError(f"need count >= 1 and max_tokens > the longest prompt, got {count} and {max_tokens}")
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        prompt_len = rng.randint(*prompt_range)
        longest = max_tokens - prompt_len
        requests.append(TraceRequest(i, 0, prompt_len, max(1, min(longest, round(longest ** rng.random())))))
    text = (ASSETS_DIR / "text" / "shakespeare.txt").read_text(encoding="utf-8")
    prompts = prompts_from_text(requests, text, lambda s: tokenizer(s)["input_ids"])
    return prompts, [r.output_len for r in requests]
