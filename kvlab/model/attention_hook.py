"""The model-runner hook: a transformers model computes, kvlab's cache stores K/V and attends.

kvlab registers an attention implementation named "kvlab" with transformers. While `forward`
runs, the model's attention layers hand their rotated Q, K and V to the cache object passed in,
and the model itself keeps no cache (`use_cache=False`). Every cache in the course, from
Chapter 1's naive one to the paged ones, plugs in here by providing one method:

    cache.attend(layer_idx, query, key, value, scaling) -> out
        query [1, H, T, D], key and value [1, Hkv, T, D] for the T tokens of this forward pass;
        out [1, T, H, D]: attention of those tokens over everything the cache holds.

A sliding-window layer's call adds sliding_window=W (transformers passes each layer's window); only caches
with supports_sliding_window = True receive it, the others are refused for such models.
"""

from contextlib import contextmanager

import torch
from transformers import AttentionInterface

from kvlab.model.config import context_length

ATTENTION_NAME = "kvlab"


def _kvlab_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, kv_cache=None, **kwargs):
    if kv_cache is None:
        raise RuntimeError(
            "the model runs with attn_implementation='kvlab' but no kv_cache was given; "
            "call it through kvlab.model.attention_hook.forward(model, input_ids, positions, cache)"
        )
    window = kwargs.get("sliding_window")
    if window is None:
        return kv_cache.attend(module.layer_idx, query, key, value, scaling), None
    # transformers hands a sliding-window layer its window (Mistral, Gemma 2/3, Qwen2, gpt-oss): a cache that
    # cannot honour it would silently compute full attention, so it must say it can.
    if not getattr(kv_cache, "supports_sliding_window", False):
        raise ValueError(f"layer {module.layer_idx} attends over a sliding window of {window} tokens, but "
                         f"{type(kv_cache).__name__} computes full attention only; use a PagedKVCache or a "
                         f"HybridPagedCache (kvlab.cache)")
    return kv_cache.attend(module.layer_idx, query, key, value, scaling, sliding_window=window), None


AttentionInterface.register(ATTENTION_NAME, _kvlab_attention)


@contextmanager
def kvlab_attention(model):
    """Route the model's attention through kvlab for the duration of the block."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield model
    finally:
        config._attn_implementation = previous


@torch.inference_mode()
def forward(model, input_ids, positions, cache, logits_indices=None) -> torch.Tensor:
    """Run the model on T new tokens whose K/V go into `cache`; returns logits [T, vocab].

    input_ids, positions: [T] token ids and their absolute positions in their sequence.
    logits_indices: only these rows' logits are computed and returned, [len(logits_indices), vocab] (an engine
    needs one row per sequence, not one per prompt token: the LM head is skipped for the others).
    """
    # The position check reads host values: a list checked before it moves costs the GPU no sync.
    highest = max(positions, default=-1) if not isinstance(positions, torch.Tensor) else None
    input_ids = torch.as_tensor(input_ids, dtype=torch.long, device=model.device)
    positions = torch.as_tensor(positions, dtype=torch.long, device=model.device)
    if input_ids.ndim != 1 or input_ids.shape != positions.shape:
        raise ValueError(
            f"input_ids and positions must be 1-D and of equal length, got {tuple(input_ids.shape)} "
            f"and {tuple(positions.shape)}"
        )
    if input_ids.numel() == 0:
        raise ValueError("forward needs at least one token")
    limit = context_length(model)
    highest = int(positions.max()) if highest is None else int(highest)
    if highest >= limit:
        raise ValueError(f"position {highest} is beyond the model's context of {limit} tokens")
    keep = {} if logits_indices is None else \
        {"logits_to_keep": torch.as_tensor(logits_indices, dtype=torch.long, device=model.device)}
    with kvlab_attention(model):
        out = model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False, kv_cache=cache, **keep)
    return out.logits[0]
