"""Chapter 6's model runner: one ragged forward pass for a whole scheduled batch of prefill chunks and decodes.

The batch is the concatenation of every scheduled request's new tokens: no padding to the longest
request. The paged cache learns from a BatchLayout which tokens belong to whom, writes their K/V by
slot and lets each request attend over its own blocks. Only the logits of each request's last new
token are kept: a prefill chunk that does not finish its prompt produces no token.
"""

import torch

from kvlab.cache.ragged_batch import SequenceChunk, forward_batch, last_token_logits
from kvlab.engine.scheduler import SchedulerOutput


class ModelRunner:
    """Runs a transformers model on kvlab's paged cache, one scheduled step at a time."""

    def __init__(self, model, cache):
        self.model = model
        self.cache = cache
        self.num_forward_passes = 0

    def execute(self, sched: SchedulerOutput, block_tables: dict) -> torch.Tensor:
        """Logits [num_scheduled, vocab] of the last new token of each scheduled request."""
        chunks = []
        for s in sched.scheduled:
            req, start = s.request, s.request.num_computed_tokens
            chunks.append(SequenceChunk(req.all_token_ids[start:start + s.num_new_tokens], start,
                                        block_tables[req.request_id], s.slots))
        logits, layout = forward_batch(self.model, self.cache, chunks)
        self.num_forward_passes += 1
        return last_token_logits(logits, layout.query_lens)
