"""Chapter 5's beam search on the paged cache: beams are forked sequences, so shared history costs no memory.

The search itself follows transformers' `generate(num_beams=k)` (version 5.x) step for step, so
that its sequences and scores can be checked against it:

* each running beam carries the sum of the log-softmax probabilities of its generated tokens; the
  k beams start identical, with scores [0, -1e9, ..., -1e9] so the first step only expands beam 0;
* every step takes the top 2k (more generally max(2, 1 + #eos) * k) continuations over all beams;
* a continuation that hits a stopping criterion (an EOS token, or reaching max_new_tokens) cannot run
  on: the best k of the rest become the next running beams. If it is among the top k of the
  candidates it becomes a finished hypothesis scored sum_logprob / (generated_len ** length_penalty),
  generated_len counting the new token (EOS included) but not the prompt, and joins the best k
  finished hypotheses kept so far;
* the search stops when every candidate hits a stopping criterion (max_new_tokens reached), when
  early_stopping is True and k hypotheses are finished, or when the best running beam, scored at
  its current length (at max length for early_stopping="never" with a positive length penalty),
  can no longer beat the worst of k finished hypotheses.

On the cache side, each step's new beams are forked from their parents, then the old beams are
freed, and only then does each new beam ask for a slot: a parent with a single surviving child
hands it its last block outright, and only the extra children of a parent copy its partly filled
last block (copy-on-write). The copies run before the forward pass that writes the new tokens.
"""

import torch

from .fork import CowBlockManager, copy_blocks
from .generate import _as_ids, check_fits_context
from .paged_cache import BatchLayout, PagedKVCache
from .runner import forward

NEG = -1.0e9  # transformers' "impossible" score


def _eos_ids(model) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def beam_search(model, prompt_ids, beam_width: int, max_new_tokens: int, length_penalty: float = 1.0,
                early_stopping: bool | str = False, num_blocks: int | None = None, block_size: int = 16,
                stats: dict | None = None) -> list[tuple[list[int], float]]:
    """The beam_width best hypotheses as (generated token ids, score), best first.

    Equal to transformers' `generate(num_beams=beam_width, num_return_sequences=beam_width,
    do_sample=False, ...)` `sequences` (without prompt and padding) and `sequences_scores`.
    `stats`, when given, receives block-usage counters (peak used blocks, copies, forks).
    """
    _check_positive_int("beam_width", beam_width)
    _check_positive_int("max_new_tokens", max_new_tokens)
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    prompt = _as_ids(prompt_ids)
    check_fits_context(model, len(prompt), max_new_tokens)
    k, P = beam_width, len(prompt)
    max_length = P + max_new_tokens
    eos = set(_eos_ids(model))
    keep = max(2, 1 + len(eos)) * k
    if num_blocks is None:
        num_blocks = k * -(-max_length // block_size) + 1
    manager = CowBlockManager(num_blocks, block_size)
    cache = PagedKVCache.for_model(model, num_blocks, block_size)
    counters = {"peak_used_blocks": 0, "copies": 0, "forks": 0, "forward_passes": 0}

    # Prefill the prompt once; every beam starts as that one sequence.
    next_id = 0
    slots = manager.allocate(next_id, P)
    cache.set_batch(BatchLayout([P], [P], [manager.block_table(next_id)], torch.tensor(slots, dtype=torch.long)))
    logits = forward(model, prompt, range(P), cache)[-1:]
    counters["forward_passes"] += 1
    counters["peak_used_blocks"] = manager.num_used_blocks
    log_probs = torch.log_softmax(logits.float(), dim=-1).expand(k, -1)
    beam_seq = [next_id] * k
    next_id += 1

    run_tokens: list[list[int]] = [[] for _ in range(k)]
    run_scores = torch.full((k,), NEG, dtype=torch.float32)
    run_scores[0] = 0.0
    fin_tokens: list[list[int]] = [[] for _ in range(k)]
    fin_scores = torch.full((k,), NEG, dtype=torch.float32)
    fin_done = torch.zeros(k, dtype=torch.bool)
    improvable = True  # can a running beam still beat the worst kept hypothesis?
    in_top_k = torch.arange(keep) < k
    cur = P  # tokens in every running beam (prompt + generated)

    while True:
        vocab = log_probs.shape[-1]
        total = (log_probs + run_scores[:, None]).reshape(-1)
        cand_scores, cand_idx = torch.topk(total, keep)
        cand_parent = (cand_idx // vocab).tolist()
        cand_token = (cand_idx % vocab).tolist()
        reached_max = cur + 1 >= max_length
        hits = torch.tensor([reached_max or t in eos for t in cand_token], dtype=torch.bool)

        # The next running beams: the best candidates that can still continue.
        runnable = cand_scores + hits.to(torch.float32) * NEG
        chosen = torch.topk(runnable, k).indices.tolist()
        new_scores = runnable[chosen]

        # Finished hypotheses: candidates among the top k that just stopped, length-penalised.
        penalised = cand_scores / ((cur + 1 - P) ** length_penalty)
        if early_stopping is True and bool(fin_done.all()):
            penalised = penalised + NEG
        if not improvable:
            penalised = penalised + NEG
        just_finished = hits & in_top_k
        penalised = penalised + (~just_finished).to(torch.float32) * NEG
        merged_scores = torch.cat([fin_scores, penalised])
        merged_done = torch.cat([fin_done, just_finished])
        best = torch.topk(merged_scores, k).indices.tolist()
        merged_tokens = fin_tokens + [run_tokens[p] + [t] for p, t in zip(cand_parent, cand_token)]
        fin_tokens = [merged_tokens[i] for i in best]
        fin_scores, fin_done = merged_scores[best], merged_done[best]

        cur += 1
        if early_stopping == "never" and length_penalty > 0.0:
            best_len = max_length - P
        else:
            best_len = cur - P
        best_running = new_scores[0] / (best_len ** length_penalty)
        worst_kept = torch.where(fin_done, fin_scores.min(), torch.tensor(NEG))
        improvable = improvable and bool((best_running > worst_kept).any())
        all_kept_done = bool(fin_done.all()) and early_stopping is True
        if not improvable or all_kept_done or bool(hits.all()):
            break

        # Cache side: fork every surviving beam from its parent, free the old beams, then take slots.
        parents = [beam_seq[cand_parent[c]] for c in chosen]
        children = list(range(next_id, next_id + k))
        next_id += k
        for parent, child in zip(parents, children):
            manager.fork(parent, child)
        counters["forks"] += k
        for old in dict.fromkeys(beam_seq):
            manager.free(old)
        new_slots, copies = [], []
        for child in children:
            slot, copy = manager.append_slot(child)
            new_slots.append(slot)
            if copy is not None:
                copies.append(copy)
        copy_blocks(cache, copies)
        counters["copies"] += len(copies)
        counters["peak_used_blocks"] = max(counters["peak_used_blocks"], manager.num_used_blocks)
        beam_seq = children
        run_tokens = [run_tokens[cand_parent[c]] + [cand_token[c]] for c in chosen]
        run_scores = new_scores

        cache.set_batch(BatchLayout(
            query_lens=[1] * k,
            context_lens=[cur] * k,
            block_tables=[manager.block_table(c) for c in children],
            slot_mapping=torch.tensor(new_slots, dtype=torch.long),
        ))
        logits = forward(model, [toks[-1] for toks in run_tokens], [cur - 1] * k, cache)
        counters["forward_passes"] += 1
        log_probs = torch.log_softmax(logits.float(), dim=-1)

    for old in dict.fromkeys(beam_seq):
        manager.free(old)
    if stats is not None:
        stats.update(counters)
        stats["num_blocks"] = num_blocks
        stats["blocks_without_sharing"] = k * -(-(cur - 1) // block_size)
    return [(toks, float(score)) for toks, score in zip(fin_tokens, fin_scores.tolist())]


@torch.inference_mode()
def reference_beam_search(model, prompt_ids, beam_width: int, max_new_tokens: int, length_penalty: float = 1.0,
                          early_stopping: bool | str = False) -> list[tuple[list[int], float]]:
    """transformers' own beam search, as (generated token ids without padding, sequences_scores): the oracle."""
    prompt = _as_ids(prompt_ids)
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), num_beams=beam_width, num_return_sequences=beam_width,
        do_sample=False, max_new_tokens=max_new_tokens, length_penalty=length_penalty,
        early_stopping=early_stopping, output_scores=True, return_dict_in_generate=True,
        pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0,
    )
    eos = set(_eos_ids(model))
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
