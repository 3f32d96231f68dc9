"""What the engine and every decoding loop need to know about a model: its context, its EOS ids, a prompt's ids."""

import torch


def context_length(model) -> int:
    """The longest sequence (prompt plus output) the model's position embeddings cover."""
    return int(model.config.max_position_embeddings)


def eos_token_ids(model) -> list[int]:
    """The token ids that end a sequence: the generation config's, else the model config's, else none."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def as_token_ids(prompt_ids) -> list[int]:
    """A prompt as a list of ints, from a list or a tensor of any shape."""
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.flatten().tolist()
    return [int(t) for t in prompt_ids]


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
