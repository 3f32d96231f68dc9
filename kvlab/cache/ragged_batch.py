"""Chapters 3-6: one forward pass over several sequences' new tokens laid end to end, with no padding.

Every decoding loop in the course (paged, prefix-sharing, beam search, parallel sampling, the
engine's model runner, static batching) describes its step the same way: for each sequence, the
new tokens, the position of the first, the block table and the slot of every new token. From that
one builder derives what the cache and the model need, as nano-vllm's `Context` and vLLM's
per-step attention metadata do:

    input_ids, positions   [T]  the new tokens of all sequences, laid end to end
    slot_mapping           [T]  where each new token's K/V is written in the pool
    query_lens, context_lens, block_tables    per sequence (context = cached + new)
    query_start_loc        [num_seqs + 1]     offsets of each sequence's tokens in the T rows

Only the last new token of each sequence predicts its next token: `last_token_logits` keeps those rows.
"""

import dataclasses
from dataclasses import dataclass

import torch

from kvlab.core.paging import slot_mapping_for
from kvlab.model.attention_hook import forward


@dataclass(slots=True)
class BatchLayout:
    """Who owns the tokens of one forward pass, in order."""

    query_lens: list[int]           # new tokens of each sequence in this pass
    context_lens: list[int]         # tokens of each sequence after this pass (cached + new)
    block_tables: list[list[int]]   # each sequence's physical blocks
    slot_mapping: torch.Tensor      # [T] int64: pool slot of every new token

    @property
    def query_start_loc(self) -> list[int]:
        """Offsets of each sequence's new tokens in the pass, [num_seqs + 1], starting at 0 (vLLM's name)."""
        offsets = [0]
        for n in self.query_lens:
            offsets.append(offsets[-1] + n)
        return offsets


@dataclass(slots=True)
class SequenceChunk:
    """One sequence's share of a forward pass: its new tokens from position `start` on, and where they go."""

    token_ids: list[int]                # the new tokens (a prompt chunk, or one decode token)
    start: int                          # their first position = tokens of the sequence already cached
    block_table: list[int]              # the sequence's physical blocks, covering start + len(token_ids); a hybrid
                                        # model's: a tuple of one table per KV-cache group (forward_batch)
    slots: list[int] | None = None      # the new tokens' slots; None: computed from the block table


@dataclass(slots=True)
class RaggedBatch:
    """A built step: the model's inputs [T] and the cache's layout."""

    input_ids: list[int]
    positions: list[int]
    layout: BatchLayout


def build_batch(chunks: list[SequenceChunk], block_size: int, device=None) -> RaggedBatch:
    """Lay the chunks end to end: input ids, positions and slot mapping [T], per-sequence lengths and tables."""
    if not chunks:
        raise ValueError("a forward pass needs at least one sequence")
    input_ids, positions, slots = [], [], []
    query_lens, context_lens, tables = [], [], []
    for chunk in chunks:
        n = len(chunk.token_ids)
        if n == 0:
            raise ValueError("every sequence in a pass brings at least one new token")
        chunk_slots = (slot_mapping_for(chunk.block_table, chunk.start, n, block_size)
                       if chunk.slots is None else list(chunk.slots))
        if len(chunk_slots) != n:
            raise ValueError(f"{n} new tokens but {len(chunk_slots)} slots")
        input_ids += chunk.token_ids
        positions += range(chunk.start, chunk.start + n)
        slots += chunk_slots
        query_lens.append(n)
        context_lens.append(chunk.start + n)
        tables.append(list(chunk.block_table))
    layout = BatchLayout(query_lens, context_lens, tables, torch.tensor(slots, dtype=torch.long, device=device))
    return RaggedBatch(input_ids, positions, layout)


def forward_batch(model, cache, chunks: list[SequenceChunk], logits_indices=None) -> tuple[torch.Tensor, BatchLayout]:
    """One ragged forward pass of the model on `cache`; logits [T, vocab] of every new token, and the layout used.

    logits_indices: only these rows of the T (vLLM's name), [len(logits_indices), vocab]. Chunks whose block_table
    is a tuple (one table per KV-cache group) run on a HybridPagedCache, which takes one layout per group.
    """
    if isinstance(chunks[0].block_table, tuple):
        # A hybrid model: the same tokens laid out once per KV-cache group, each through that group's tables.
        batches = [build_batch([dataclasses.replace(c, block_table=c.block_table[g]) for c in chunks],
                               cache.block_size) for g in range(len(chunks[0].block_table))]
        batch = batches[0]
        cache.set_batch([b.layout for b in batches])
    else:
        batch = build_batch(chunks, cache.block_size)
        cache.set_batch(batch.layout)
    logits = forward(model, batch.input_ids, batch.positions, cache, logits_indices)
    cache.finish_pass()
    return logits, batch.layout


def last_token_logits(logits: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
    """The rows of each sequence's last new token: logits [T, vocab] -> [num_seqs, vocab]."""
    last_rows = torch.tensor(query_lens, device=logits.device).cumsum(0) - 1
    return logits[last_rows]
