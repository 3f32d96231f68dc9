"""The oracles: transformers' own greedy `generate` and beam search, which kvlab's loops must equal."""

import torch

from kvlab.model.config import as_token_ids, check_fits_context, eos_token_ids


@torch.inference_mode()
def reference_generate(model, prompt_ids, max_new_tokens: int) -> list[int]:
    """transformers' own greedy `generate` (with its own cache): the oracle kvlab must equal."""
    ids = torch.tensor([as_token_ids(prompt_ids)], device=model.device)
    check_fits_context(model, ids.shape[1], max_new_tokens)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=model.config.pad_token_id or 0,
    )
    return out[0, ids.shape[1]:].tolist()


@torch.inference_mode()
def reference_beam_search(model, prompt_ids, beam_width: int, max_new_tokens: int, length_penalty: float = 1.0,
                          early_stopping: bool | str = False) -> list[tuple[list[int], float]]:
    """transformers' own beam search, as (generated token ids without padding, sequences_scores): the oracle."""
    prompt = as_token_ids(prompt_ids)
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), num_beams=beam_width, num_return_sequences=beam_width,
        do_sample=False, max_new_tokens=max_new_tokens, length_penalty=length_penalty,
        early_stopping=early_stopping, output_scores=True, return_dict_in_generate=True,
        pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0,
    )
    eos = set(eos_token_ids(model))
    results = []
    for row, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
        tokens = []
        for t in row:
            if t < 0:
                break
            tokens.append(t)
            if t in eos:
                break
        results.append((tokens, float(score)))
    return results


@torch.inference_mode()
def reference_speculative_generate(model, prompt_ids, max_new_tokens: int, prompt_lookup_num_tokens: int | None = None,
                                   assistant_model=None) -> list[int]:
    """transformers' own speculative greedy generate: prompt lookup (n-grams) or an assistant (draft) model.

    The oracle for kvlab's speculative engine: greedy speculation must give the target's greedy tokens.
    """
    if (prompt_lookup_num_tokens is None) == (assistant_model is None):
        raise ValueError("give prompt_lookup_num_tokens (n-gram lookup) or assistant_model (a draft), not both")
    ids = torch.tensor([as_token_ids(prompt_ids)], device=model.device)
    check_fits_context(model, ids.shape[1], max_new_tokens)
    # min_new_tokens (no early end of sequence) only for prompt lookup: with an assistant, transformers would
    # build that processor twice and warn; the course's models never emit their end-of-sequence token.
    extra = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens, "min_new_tokens": max_new_tokens} \
        if assistant_model is None else {"assistant_model": assistant_model}
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=model.config.pad_token_id or 0, **extra,
    )
    return out[0, ids.shape[1]:].tolist()
