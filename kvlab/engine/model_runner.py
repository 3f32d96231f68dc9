"""Chapter 6's model runner: one ragged forward pass for a whole scheduled batch of prefill chunks and decodes.

The batch is the concatenation of every scheduled request's new tokens: no padding to the longest
request. The paged cache learns from a BatchLayout which tokens belong to whom, writes their K/V by
slot and lets each request attend over its own blocks. Only the logits of each request's last new
token are kept: a prefill chunk that does not finish its prompt produces no token.
"""

import torch

from kvlab.cache.ragged_batch import SequenceChunk, forward_batch
from kvlab.engine.scheduler import SchedulerOutput


class ModelRunner:
    """Runs a transformers model on kvlab's paged cache, one scheduled step at a time."""

    def __init__(self, model, cache):
        self.model = model
        self.cache = cache
        self.num_forward_passes = 0

    def execute(self, sched: SchedulerOutput, block_tables: dict) -> torch.Tensor:
        """Logits [sum of (num_draft_tokens + 1), vocab]: per scheduled request, its last 1 + num_draft_tokens rows.

        Without drafts that is the last new token of each request, the one that predicts its next token.
        """
        chunks, logits_indices, end = [], [], 0
        for s in sched.scheduled:
            req, start = s.request, s.request.num_computed_tokens
            tokens = (req.all_token_ids + req.spec_token_ids)[start:start + s.num_new_tokens]
            chunks.append(SequenceChunk(tokens, start, block_tables[req.request_id], s.slots))
            end += s.num_new_tokens
            logits_indices += range(end - 1 - s.num_draft_tokens, end)  # vLLM's name for the rows it keeps
        logits, _ = forward_batch(self.model, self.cache, chunks)
        self.num_forward_passes += 1
        return logits[logits_indices]
