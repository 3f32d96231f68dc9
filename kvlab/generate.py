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


def step_times(model, prompt_ids, max_new_tokens: int, use_cache: bool, repeats: int = 3,
               progress: bool = True) -> list[float]:
    """Seconds spent on each generated token, with the naive cache or recomputing everything.

    The generation runs `repeats` times and each step keeps its fastest time, so that a busy
    machine's hiccups do not show up as spikes in the plot.
    """
    from tqdm.auto import tqdm

    prompt = _as_ids(prompt_ids)
    check_fits_context(model, len(prompt), max_new_tokens)
    best = [float("inf")] * max_new_tokens
    label = "with cache" if use_cache else "no cache"
    bar = tqdm(total=repeats * max_new_tokens, desc=label, disable=not progress)
    for _ in range(repeats):
        ids = list(prompt)
        cache = NaiveKVCache(model.config.num_hidden_layers)
        for step in range(max_new_tokens):
            t0 = time.perf_counter()
            if not use_cache:
                logits = forward(model, ids, range(len(ids)), RecomputeCache())
            elif step == 0:
                logits = forward(model, ids, range(len(ids)), cache)
            else:
                logits = forward(model, ids[-1:], [len(ids) - 1], cache)
            ids.append(int(logits[-1].argmax()))
            best[step] = min(best[step], time.perf_counter() - t0)
            bar.update()
    bar.close()
    return best
