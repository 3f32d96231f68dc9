"""Synthetic request traces for the memory simulator: arrival step, prompt length, output length.

Nothing is downloaded: lengths are drawn from lognormal distributions whose means follow the
datasets the vLLM paper replays (its Figure 11), and arrivals are a Poisson process over
scheduler steps. Every generator takes a seed and is deterministic for a given seed.

* `chat_trace` (ShareGPT-like conversations): prompt lengths lognormal with mean 161 tokens
  and log-space sigma 1.0, output lengths lognormal with mean 338 and sigma 0.8.
* `instruct_trace` (Alpaca-like instructions): prompt mean 19, sigma 0.6; output mean 58,
  sigma 0.7.

Lengths are rounded to integers and at least 1. A prompt is clipped to `max_model_len - 1` and
then the output to what is left of `max_model_len`, so the clipped means are slightly lower.
Arrival steps come from exponential gaps of mean `1 / arrival_rate` steps, summed and floored,
so each step sees a Poisson number of arrivals with mean `arrival_rate`.
"""

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CSV_FIELDS: tuple[str, ...] = ("request_id", "arrival_step", "prompt_len", "output_len")


@dataclass(slots=True, frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives and how many tokens it reads and writes."""

    request_id: int
    arrival_step: int
    prompt_len: int
    output_len: int

    def __post_init__(self) -> None:
        if self.request_id < 0 or self.arrival_step < 0:
            raise ValueError(f"request_id and arrival_step must be >= 0: {self}")
        if self.prompt_len <= 0 or self.output_len <= 0:
            raise ValueError(f"prompt_len and output_len must be positive: {self}")

    @property
    def final_len(self) -> int:
        """Tokens held in the KV cache once the last output token is stored."""
        return self.prompt_len + self.output_len


def _lognormal_lengths(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    """Draw `n` integer lengths >= 1 from a lognormal with the given mean and log-space sigma."""
    # E[exp(N(mu, sigma^2))] = exp(mu + sigma^2 / 2), so solve for mu to hit the requested mean.
    mu = math.log(mean) - sigma**2 / 2
    return np.maximum(np.rint(rng.lognormal(mu, sigma, n)), 1).astype(np.int64)


def generate_trace(num_requests: int, *, arrival_rate: float, prompt_mean: float, prompt_sigma: float,
                   output_mean: float, output_sigma: float, max_model_len: int, seed: int) -> list[TraceRequest]:
    """Draw a trace with lognormal prompt and output lengths and Poisson arrivals per step."""
    if num_requests <= 0:
        raise ValueError(f"num_requests must be positive, got {num_requests}")
    if arrival_rate <= 0:
        raise ValueError(f"arrival_rate must be positive, got {arrival_rate}")
    if min(prompt_mean, output_mean) <= 0 or min(prompt_sigma, output_sigma) < 0:
        raise ValueError("length means must be positive and sigmas non-negative")
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be at least 2 (prompt + output), got {max_model_len}")
    rng = np.random.default_rng(seed)
    # Draw each quantity as one block, so changing one distribution doesn't reshuffle the others.
    gaps = rng.exponential(1.0 / arrival_rate, num_requests)
    prompts = _lognormal_lengths(rng, prompt_mean, prompt_sigma, num_requests)
    outputs = _lognormal_lengths(rng, output_mean, output_sigma, num_requests)
    arrivals = np.floor(np.cumsum(gaps) - gaps[0]).astype(np.int64)  # first request at step 0
    prompts = np.minimum(prompts, max_model_len - 1)
    outputs = np.minimum(outputs, max_model_len - prompts)
    return [TraceRequest(i, int(a), int(p), int(o)) for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs))]


# The two datasets' length distributions (means in tokens, sigmas in log space), as in the module docstring.
CHAT_LENGTHS = dict(prompt_mean=161.0, prompt_sigma=1.0, output_mean=338.0, output_sigma=0.8)
INSTRUCT_LENGTHS = dict(prompt_mean=19.0, prompt_sigma=0.6, output_mean=58.0, output_sigma=0.7)


def chat_trace(num_requests: int = 400, *, arrival_rate: float = 0.1, max_model_len: int = 2048,
               seed: int = 0) -> list[TraceRequest]:
    """A ShareGPT-like trace: long conversational prompts and long, heavy-tailed answers."""
    return generate_trace(num_requests, arrival_rate=arrival_rate, max_model_len=max_model_len, seed=seed,
                          **CHAT_LENGTHS)


def instruct_trace(num_requests: int = 400, *, arrival_rate: float = 1.0, max_model_len: int = 2048,
                   seed: int = 0) -> list[TraceRequest]:
    """An Alpaca-like trace: short instructions and short answers."""
    return generate_trace(num_requests, arrival_rate=arrival_rate, max_model_len=max_model_len, seed=seed,
                          **INSTRUCT_LENGTHS)


def save_trace(requests: list[TraceRequest], path: str | Path) -> None:
    """Write a trace as CSV with a header row `request_id,arrival_step,prompt_len,output_len`."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_FIELDS)
        for r in requests:
            writer.writerow((r.request_id, r.arrival_step, r.prompt_len, r.output_len))


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a trace written by `save_trace`, raising ValueError on a malformed file."""
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != CSV_FIELDS:
            raise ValueError(f"{path}: expected header {','.join(CSV_FIELDS)}, got {header}")
        requests = []
        for line_no, row in enumerate(reader, start=2):
            if not row:
                continue
            try:
                requests.append(TraceRequest(*(int(v) for v in row)))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}:{line_no}: bad request row {row}: {e}") from None
    return requests
