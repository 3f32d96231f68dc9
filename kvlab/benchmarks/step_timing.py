"""Chapter 1's measurement: the time of each generated token, with kvlab's naive cache and without one."""

import sys
import time

from kvlab.cache.naive_cache import NaiveKVCache, RecomputeCache
from kvlab.model.attention_hook import forward
from kvlab.model.config import as_token_ids, check_fits_context


def step_times(model, prompt_ids, max_new_tokens: int, use_cache: bool, repeats: int = 3,
               progress: bool = True) -> list[float]:
    """Seconds spent on each generated token, with the naive cache or recomputing everything.

    The generation runs `repeats` times and each step keeps its fastest time, so that a busy
    machine's hiccups do not show up as spikes in the plot.
    """
    # tqdm's text bar, not its widget: a saved notebook keeps the final line, never a stuck 0% widget.
    from tqdm.std import tqdm

    prompt = as_token_ids(prompt_ids)
    check_fits_context(model, len(prompt), max_new_tokens)
    best = [float("inf")] * max_new_tokens
    label = "with cache" if use_cache else "no cache"
    bar = tqdm(total=repeats * max_new_tokens, desc=label, disable=not progress, file=sys.stdout, mininterval=0.5)
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
