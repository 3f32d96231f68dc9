"""Chapter 5's parallel sampling: n samples of one prompt, forked from a single prefill.

The prompt is prefilled once; its n samples are forks of that sequence, so they share every prompt
block. Full blocks stay shared for the whole generation; the partly filled last prompt block is
copied (copy-on-write) by all samples but the last one to write into it, which keeps the original.
Sampling draws from a torch.Generator seeded per call: the same seed gives the same samples.
"""

from dataclasses import dataclass

import torch

from kvlab.cache.paged_cache import PagedKVCache, copy_blocks
from kvlab.cache.ragged_batch import SequenceChunk, forward_batch, last_token_logits
from kvlab.core.fork import CowBlockManager
from kvlab.core.paging import num_blocks_needed
from kvlab.model.config import as_token_ids, check_fits_context
from kvlab.validation import check_positive_int


@dataclass
class ParallelSamples:
    """The n samples' new tokens, and the blocks they held at the end with sharing and without."""

    outputs: list[list[int]]
    blocks_with_sharing: int      # distinct blocks held by the n samples at the end
    blocks_without_sharing: int   # blocks n independent copies would hold
    shared_blocks: int            # blocks held by more than one sample at the end
    copies: int                   # copy-on-write block copies performed


def sample_n(model, prompt_ids, n: int, max_new_tokens: int, temperature: float = 1.0, seed: int = 0,
             num_blocks: int | None = None, block_size: int = 16) -> ParallelSamples:
    """n samples of max_new_tokens tokens each, at `temperature`, reproducible from `seed`."""
    check_positive_int("n", n)
    check_positive_int("max_new_tokens", max_new_tokens)
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")
    prompt = as_token_ids(prompt_ids)
    check_fits_context(model, len(prompt), max_new_tokens)
    P = len(prompt)
    per_seq = num_blocks_needed(P + max_new_tokens, block_size)
    if num_blocks is None:
        num_blocks = n * per_seq + 1
    manager = CowBlockManager(num_blocks, block_size)
    cache = PagedKVCache.for_model(model, num_blocks, block_size)
    generator = torch.Generator().manual_seed(seed)

    def draw(logits):
        probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()

    slots = manager.allocate_slots("prompt", P)
    logits, layout = forward_batch(model, cache, [SequenceChunk(prompt, 0, manager.block_tables["prompt"], slots)])
    last = last_token_logits(logits, layout.query_lens)
    outputs = [[t] for t in draw(last.expand(n, -1))]
    for i in range(n):
        manager.fork("prompt", i)
    manager.free("prompt")
    copies = 0
    for step in range(1, max_new_tokens):
        new_slots = [manager.allocate_slots(i, 1) for i in range(n)]
        orders = manager.take_copy_orders()  # copy-on-write of shared, partly filled last blocks
        copy_blocks(cache, orders)
        copies += len(orders)
        length = P + step
        block_tables = manager.block_tables
        chunks = [SequenceChunk([out[-1]], length - 1, block_tables[i], slots)
                  for i, (out, slots) in enumerate(zip(outputs, new_slots))]
        logits, _ = forward_batch(model, cache, chunks)  # one new token each: every row is a last token
        for out, token in zip(outputs, draw(logits)):
            out.append(token)
    block_tables = manager.block_tables
    tables = [block_tables[i] for i in range(n)]
    counts: dict[int, int] = {}
    for table in tables:
        for b in table:
            counts[b] = counts.get(b, 0) + 1
    result = ParallelSamples(outputs, len(counts), sum(len(t) for t in tables),
                             sum(c > 1 for c in counts.values()), copies)
    for i in range(n):
        manager.free(i)
    return result
