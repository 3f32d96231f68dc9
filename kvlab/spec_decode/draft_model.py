"""The draft-model proposer: a small model with its own paged KV cache, kept in lockstep with the target's blocks.

As in vLLM V1, the draft model's K/V live in their own tensors (its layers and heads differ from the
target's) but under the same block ids: block b of a request's block table holds the target's K/V
of those positions in the target's pools and the draft's in the draft's pools. So one block table,
one allocation and one free serve both, and a prefix-cache hit gives the draft its K/V too.

Each step, after the target verified, the draft model catches up on every token it has not seen
(the accepted drafts and the token just sampled; a prefill chunk's tokens) in one ragged pass, and
then guesses k tokens one pass at a time. Its K/V for the guessed tokens go to lookahead slots past
the sequence, which the scheduler held for it (num_lookahead_tokens); they are overwritten once the
target verifies. The target computes its own K/V for the draft tokens when it verifies them: the
draft's K/V are never reused by the target.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvlab.cache.paged_cache import PagedKVCache
from kvlab.cache.ragged_batch import SequenceChunk, forward_batch, last_token_logits
from kvlab.model.config import context_length


@dataclass(slots=True)
class DraftRequest:
    """One request's share of a drafting step."""

    request_id: str
    token_ids: list[int]     # the verified sequence: prompt and outputs, the token just sampled included
    block_table: list[int]   # the request's blocks (the target's table: lockstep)
    num_computed_tokens: int  # the target's tokens with K/V: the draft's K/V must cover them too
    num_drafts: int          # tokens to guess (0: only catch up, e.g. a prefill chunk or a finished request)
    params: object = None    # the request's SamplingParams, for the draft's own sampling
    generator: torch.Generator | None = None


def load_draft_model(source, target):
    """The draft model speculative_config names (None: the course's embedded draft), in the target's dtype and on
    its device; checked against the target (same vocabulary, at least its context)."""
    if source is None or isinstance(source, str) or hasattr(source, "__fspath__"):
        from kvlab.model.loader import load_model
        from kvlab.paths import DEFAULT_DRAFT_MODEL_DIR

        draft, _ = load_model(DEFAULT_DRAFT_MODEL_DIR if source is None else source, dtype=target.dtype,
                              device=str(target.device))
    else:
        draft = source
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) differs from the "
                         f"target's ({target.config.vocab_size}): a draft must share the target's tokenizer")
    if context_length(draft) < context_length(target):
        raise ValueError(f"the draft model's context ({context_length(draft)} tokens) is shorter than the "
                         f"target's ({context_length(target)})")
    return draft


# (logits [N, vocab], params per row, generators per row) -> (token per row, probabilities [N, vocab] or None rows)
DraftSampler = Callable[[torch.Tensor, list, list], tuple[list[int], list[torch.Tensor | None]]]


class DraftModelProposer:
    """A draft model, its paged cache (same num_blocks and block_size as the target's) and how far each request is."""

    def __init__(self, model, num_blocks: int, block_size: int, num_speculative_tokens: int, sampler: DraftSampler,
                 attention_backend: str = "auto", kv_cache_dtype: str = "auto", keep_draft_probs: bool = True):
        self.model = model
        self.k = num_speculative_tokens
        self.sampler = sampler
        # False: hand no distributions to verification (vLLM V1's draft_probs=None), so drafts count as one-hot.
        self.keep_draft_probs = keep_draft_probs
        self.cache = PagedKVCache.for_model(model, num_blocks, block_size, attention_backend=attention_backend,
                                            kv_cache_dtype=kv_cache_dtype)
        self.num_computed: dict[str, int] = {}  # request id -> positions whose draft K/V are valid
        self.num_forward_passes = 0

    def admit(self, request_id: str, num_cached_tokens: int) -> None:
        """A request starts (or restarts) with num_cached_tokens prefix-cache hits: their blocks hold draft K/V too."""
        self.num_computed[request_id] = num_cached_tokens

    def keep(self, request_id: str, num_tokens: int) -> None:
        """The draft's K/V stay valid for at most num_tokens positions (a swap keeps only the target's tokens)."""
        self.num_computed[request_id] = min(self.num_computed.get(request_id, 0), num_tokens)

    def free(self, request_id: str) -> None:
        self.num_computed.pop(request_id, None)

    def propose(self, requests: list[DraftRequest]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Per request: its draft tokens and their draft distributions [num_drafts, vocab].

        The distributions are None for greedy requests, and for every request when keep_draft_probs is False.
        """
        results: list[tuple[list[int], list]] = [([], []) for _ in requests]
        chunks, proposing = [], []
        for i, r in enumerate(requests):
            end = len(r.token_ids) if r.num_drafts else r.num_computed_tokens
            start = self.num_computed.get(r.request_id, 0)
            if r.num_drafts:
                start = min(start, end - 1)  # the last token's logits are needed even if its K/V were written
            if end > start:
                chunks.append(SequenceChunk(r.token_ids[start:end], start, r.block_table))
                if r.num_drafts:
                    proposing.append((i, len(chunks) - 1))
            self.num_computed[r.request_id] = max(start, end)
        if not chunks:
            return [(ids, None) for ids, _ in results]
        logits, layout = forward_batch(self.model, self.cache, chunks)
        self.num_forward_passes += 1
        last = last_token_logits(logits, layout.query_lens)
        active = [i for i, _ in proposing]
        rows = last[[row for _, row in proposing]] if proposing else None
        for step in range(self.k):
            if not active:
                break
            tokens, probs = self.sampler(rows, [requests[i].params for i in active],
                                         [requests[i].generator for i in active])
            for i, token, q in zip(active, tokens, probs):
                results[i][0].append(token)
                results[i][1].append(q)
            active = [i for i in active if len(results[i][0]) < requests[i].num_drafts]
            if not active or step == self.k - 1:
                break
            # The guessed token's K/V go to its lookahead slot; its logits give the next guess.
            chunk_list = [SequenceChunk([results[i][0][-1]], len(requests[i].token_ids) + len(results[i][0]) - 1,
                                        requests[i].block_table) for i in active]
            step_logits, _ = forward_batch(self.model, self.cache, chunk_list)
            self.num_forward_passes += 1
            rows = step_logits
        out = []
        for ids, qs in results:
            keep = self.keep_draft_probs and qs and all(q is not None for q in qs)
            probs = torch.stack(qs) if keep else None
            out.append((ids, probs))
        return out
