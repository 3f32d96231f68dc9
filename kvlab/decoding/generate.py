"""Greedy decoding on a kvlab cache, without one, and transformers' own `generate` as the oracle."""

from kvlab.cache.naive_cache import NaiveKVCache, RecomputeCache
from kvlab.model.attention_hook import forward
from kvlab.model.config import as_token_ids, check_fits_context


def greedy_generate(model, prompt_ids, max_new_tokens: int, cache=None) -> list[int]:
    """Prefill the prompt into `cache`, then decode one token at a time; returns the new token ids."""
    prompt_ids = as_token_ids(prompt_ids)
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
    ids = as_token_ids(prompt_ids)
    check_fits_context(model, len(ids), max_new_tokens)
    start = len(ids)
    while len(ids) - start < max_new_tokens:
        logits = forward(model, ids, range(len(ids)), RecomputeCache())
        ids.append(int(logits[-1].argmax()))
    return ids[start:]
