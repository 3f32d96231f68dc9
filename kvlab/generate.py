"""Greedy decoding on a kvlab cache, without one, and transformers' own `generate` as the oracle."""

import time

import torch

from .naive_cache import NaiveKVCache, RecomputeCache
from .runner import context_length, forward


def check_fits_context(model, prompt_len: int, max_new_tokens: int) -> None:
    """Reject a request the model cannot hold before any cache is touched."""
    if prompt_len < 1:
        raise ValueError("the prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    limit = context_length(model)
    if prompt_len + max_new_tokens > limit:
        raise ValueError(
            f"prompt of {prompt_len} tokens plus {max_new_tokens} new tokens exceeds the model's "
            f"context of {limit} tokens"
        )


def _as_ids(prompt_ids) -> list[int]:
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.flatten().tolist()
    return [int(t) for t in prompt_ids]


def greedy_generate(model, prompt_ids, max_new_tokens: int, cache=None) -> list[int]:
    """Prefill the prompt into `cache`, then decode one token at a time; returns the new token ids."""
    prompt_ids = _as_ids(prompt_ids)
    check_fits_context(model, len(prompt_ids), max_new_tokens)
    cache = cache if cache is not None else NaiveKVCache(model.config.num_hidden_layers)
    logits = forward(model, prompt_ids, range(len(prompt_ids)), cache)
    out = [int(logits[-1].argmax())]
    while len(out) < max_new_tokens:
        position = len(prompt_ids) + len(out) - 1
        logits = forward(model, [out[-1]], [position], cache)
        out.append(int(logits[-1].argmax()))
    return out


def generate_without_cache(model, prompt_ids, max_new_tokens: int) -> list[int]:
    """Greedy decoding that recomputes K and V of the whole sequence at every step."""
    ids = _as_ids(prompt_ids)
    check_fits_context(model, len(ids), max_new_tokens)
    start = len(ids)
    while len(ids) - start < max_new_tokens:
        logits = forward(model, ids, range(len(ids)), RecomputeCache())
        ids.append(int(logits[-1].argmax()))
    return ids[start:]


@torch.inference_mode()
def reference_generate(model, prompt_ids, max_new_tokens: int) -> list[int]:
    """transformers' own greedy `generate` (with its own cache): the oracle kvlab must equal."""
    ids = torch.tensor([_as_ids(prompt_ids)], device=model.device)
    check_fits_context(model, ids.shape[1], max_new_tokens)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=model.config.pad_token_id or 0,
    )
    return out[0, ids.shape[1]:].tolist()


def step_times(model, prompt_ids, max_new_tokens: int, use_cache: bool, progress: bool = True) -> list[float]:
    """Seconds spent on each generated token, with the naive cache or recomputing everything."""
    from tqdm.auto import tqdm

    ids = _as_ids(prompt_ids)
    check_fits_context(model, len(ids), max_new_tokens)
    cache = NaiveKVCache(model.config.num_hidden_layers) if use_cache else None
    times = []
    bar = tqdm(range(max_new_tokens), desc="with cache" if use_cache else "no cache", disable=not progress)
    for step in bar:
        t0 = time.perf_counter()
        if use_cache and step > 0:
            logits = forward(model, ids[-1:], [len(ids) - 1], cache)
        elif use_cache:
            logits = forward(model, ids, range(len(ids)), cache)
        else:
            logits = forward(model, ids, range(len(ids)), RecomputeCache())
        ids.append(int(logits[-1].argmax()))
        times.append(time.perf_counter() - t0)
    return times
