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
