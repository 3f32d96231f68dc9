"""Chapter 6's sampler: the next token of every request in the batch, each under its own SamplingParams."""

from collections.abc import Iterable

import torch

from kvlab.engine.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] with the tokens outside the top-k and outside the top-p nucleus set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p; the most likely one always stays.
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of logits [B, V]: argmax for temperature 0, else a draw from the filtered softmax."""
    tokens = []
    for row, p, gen in zip(logits.float().cpu(), params, generators):
        if p.greedy:
            tokens.append(int(row.argmax()))
            continue
        row = apply_top_k_top_p(row / p.temperature, p.top_k, p.top_p)
        tokens.append(int(torch.multinomial(torch.softmax(row, dim=-1), 1, generator=gen)))
    return tokens


def sampling_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from at each row of logits [N, V]: temperature, top-k, top-p, softmax."""
    rows = [torch.softmax(apply_top_k_top_p(row / p.temperature, p.top_k, p.top_p), dim=-1)
            for row in logits.float().cpu()]
    return torch.stack(rows)


def sample_with_probs(logits: torch.Tensor, params: list[SamplingParams],
                      generators: list[torch.Generator | None]) -> tuple[list[int], list[torch.Tensor | None]]:
    """sample(), also returning each row's distribution [V] (None for a greedy row: its draw is an argmax)."""
    tokens, probs = [], []
    for row, p, gen in zip(logits.float().cpu(), params, generators):
        if p.greedy:
            tokens.append(int(row.argmax()))
            probs.append(None)
            continue
        q = sampling_probs(row[None], p)[0]
        tokens.append(int(torch.multinomial(q, 1, generator=gen)))
        probs.append(q)
    return tokens, probs


def apply_min_tokens(logits: torch.Tensor, num_output_tokens: list[int], params: list[SamplingParams],
                     eos_token_ids: Iterable[int] = ()) -> torch.Tensor:
    """logits [N, V] with each row's stop tokens set to -inf while its request has fewer than min_tokens outputs.

    Row i samples its request's output number num_output_tokens[i] + 1; while num_output_tokens[i] <
    params[i].min_tokens its stop tokens (the model's EOS ids unless ignore_eos, and stop_token_ids) cannot
    be drawn (vLLM's MinTokensLogitsProcessor, vllm/v1/sample/logits_processor/builtin.py). The rows of
    one request verifying drafts come as consecutive rows, with consecutive counts: kvlab masks every
    verified position, so a drafted stop token is rejected where the target could not draw it. vLLM
    accepts min_tokens with speculative decoding too, but its rejection sampler applies only penalties,
    bad words and allowed ids to the drafted positions (vllm/v1/sample/rejection_sampler.py), so there an
    accepted draft can put EOS in the text before min_tokens; its scheduler's check_stop (v1/core/sched/
    utils.py) then keeps the request running. Returns logits itself when no row needs a mask, else a
    masked copy.
    """
    rows = [i for i, (n, p) in enumerate(zip(num_output_tokens, params)) if n < p.min_tokens]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    eos = tuple(eos_token_ids)
    for i in rows:
        p = params[i]
        stops = [t for t in {*p.stop_token_ids, *(() if p.ignore_eos else eos)} if 0 <= t < vocab]
        if stops:
            logits[i, stops] = float("-inf")
    return logits
