"""The one ragged-batch builder: every decoding loop's step is laid out by it, so its arithmetic is pinned here."""

import pytest
import torch

from kvlab.cache.ragged_batch import SequenceChunk, build_batch, last_token_logits
from kvlab.core.paging import physical_slot, slot_mapping_for


def test_chunks_are_laid_end_to_end_with_their_positions_and_slots():
    """A 3-token prefill chunk starting at position 5 and a decode at position 9, on blocks of 4."""
    prefill = SequenceChunk([11, 12, 13], start=5, block_table=[7, 2])     # positions 5, 6, 7 -> block 2
    decode = SequenceChunk([21], start=9, block_table=[0, 3, 8])           # position 9 -> block 8, offset 1
    batch = build_batch([prefill, decode], block_size=4)
    assert batch.input_ids == [11, 12, 13, 21]
    assert batch.positions == [5, 6, 7, 9]
    assert batch.layout.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 8 * 4 + 1], \
        "slot = block_table[p // block_size] * block_size + p % block_size"
    assert batch.layout.query_lens == [3, 1]
    assert batch.layout.context_lens == [8, 10], "context = tokens cached before the pass + the new ones"
    assert batch.layout.block_tables == [[7, 2], [0, 3, 8]]
    assert batch.layout.query_start_loc == [0, 3, 4], "offsets of each sequence's rows, vLLM's query_start_loc"


def test_given_slots_are_used_as_they_are():
    """Managers that hand out slots themselves (copy-on-write, prefix hits) pass them through unchanged."""
    batch = build_batch([SequenceChunk([1, 2], 0, [5], slots=[40, 41])], block_size=8)
    assert batch.layout.slot_mapping.tolist() == [40, 41]
    assert batch.layout.slot_mapping.dtype == torch.long


@pytest.mark.parametrize("chunks,message", [
    ([], "at least one sequence"),
    ([SequenceChunk([], 0, [0])], "at least one new token"),
    ([SequenceChunk([1, 2], 0, [0], slots=[0])], "2 new tokens but 1 slots"),
])
def test_malformed_steps_are_refused(chunks, message):
    with pytest.raises(ValueError, match=message):
        build_batch(chunks, block_size=4)


def test_a_chunk_beyond_its_block_table_is_refused():
    """A sequence whose table does not cover its new positions has not been given its blocks yet."""
    with pytest.raises(IndexError, match="outside the sequence's 1 blocks"):
        build_batch([SequenceChunk([1, 2, 3], 3, [0])], block_size=4)


def test_last_token_logits_keeps_each_sequences_final_row():
    logits = torch.arange(6.0)[:, None].expand(6, 3)         # row r holds r
    rows = last_token_logits(logits, [3, 1, 2])
    assert rows[:, 0].tolist() == [2.0, 3.0, 5.0], "a prefill chunk predicts only from its last token"


def test_slot_mapping_for_is_physical_slot_position_by_position():
    table = [4, 0, 9]
    assert slot_mapping_for(table, 2, 7, 3) == [physical_slot(table, p, 3) for p in range(2, 9)]
