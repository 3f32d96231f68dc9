"""Chapter 3: block tables, slot mapping, the paged K/V pools and multi-sequence decoding on them."""

import copy

import pytest

from kvlab.core.paging import BlockManager, num_blocks_needed, physical_slot


def _state(manager: BlockManager):
    return (list(manager.free_block_ids), copy.deepcopy(manager.block_tables), dict(manager.num_tokens))


def test_slot_is_block_times_block_size_plus_offset():
    table = [7, 2, 5]
    assert physical_slot(table, 0, 4) == 28
    assert physical_slot(table, 5, 4) == 2 * 4 + 1
    assert physical_slot(table, 11, 4) == 5 * 4 + 3
    with pytest.raises(IndexError, match="outside"):
        physical_slot(table, 12, 4)


@pytest.mark.parametrize("tokens, size, blocks", [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (5, 1, 5)])
def test_blocks_needed_is_the_ceiling(tokens, size, blocks):
    assert num_blocks_needed(tokens, size) == blocks


def test_a_new_block_only_when_the_last_one_is_full():
    manager = BlockManager(num_blocks=8, block_size=4)
    assert manager.allocate_slots("a", 3) == [0, 1, 2]
    assert manager.block_tables["a"] == [0]
    manager.allocate_slots("a", 1)
    assert manager.block_tables["a"] == [0] and manager.num_free_blocks == 7
    manager.allocate_slots("a", 1)
    assert manager.block_tables["a"] == [0, 1] and manager.num_tokens["a"] == 5
    manager.free("a")
    assert manager.num_free_blocks == 8 and "a" not in manager.block_tables


def test_sequences_interleave_in_the_pool():
    manager = BlockManager(num_blocks=8, block_size=2)
    manager.allocate_slots("a", 2)
    manager.allocate_slots("b", 3)
    assert manager.allocate_slots("a", 1) == [3 * 2]  # a's second block is the fourth handed out
    assert manager.owners() == {0: "a", 1: "b", 2: "b", 3: "a"}
    assert [manager.block_fill(b) for b in range(5)] == [2, 2, 1, 1, 0]


def test_freed_blocks_join_the_back_of_the_free_list_and_are_reused_oldest_first():
    manager = BlockManager(num_blocks=6, block_size=1)  # block size 1: a token's slot is its block id
    manager.allocate_slots("a", 2)  # blocks 0, 1
    manager.allocate_slots("b", 1)  # block 2
    manager.allocate_slots("c", 1)  # block 3
    manager.free("c")
    manager.free("a")
    assert list(manager.free_block_ids) == [4, 5, 3, 0, 1], (
        "free appends a sequence's blocks, in table order, behind the blocks already free: first in, first out")
    assert manager.allocate_slots("d", 5) == [4, 5, 3, 0, 1], (
        "blocks are handed out from the front: never-used blocks first, then the block freed longest ago; "
        "the most recently freed block (1) is reused last, not next")


def test_a_block_manager_has_no_prefix_cache():
    manager = BlockManager(num_blocks=4, block_size=2)
    assert manager.get_computed_blocks("a", [1, 2, 3]) == ([], 0), "Chapter 3's manager never finds computed blocks"
    with pytest.raises(ValueError, match="computed_blocks must be empty"):
        manager.allocate_slots("a", 1, computed_blocks=[0])
    assert manager.block_tables == {} and manager.num_free_blocks == 4


@pytest.mark.parametrize("size", [0, -4, 2.5, "16", True, None])
def test_block_size_must_be_a_positive_integer(size):
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        BlockManager(num_blocks=4, block_size=size)


def test_double_free_and_unknown_sequence_leave_the_pool_unchanged():
    manager = BlockManager(num_blocks=4, block_size=2)
    manager.allocate_slots("a", 3)
    manager.free("a")
    before = _state(manager)
    with pytest.raises(KeyError, match="already freed"):
        manager.free("a")
    with pytest.raises(KeyError, match="unknown"):
        manager.free("zzz")
    assert _state(manager) == before


def test_block_table_longer_than_allowed_is_rejected_without_change():
    manager = BlockManager(num_blocks=16, block_size=2, max_blocks_per_seq=3)
    manager.allocate_slots("a", 5)
    before = _state(manager)
    with pytest.raises(ValueError, match="at most 3"):
        manager.allocate_slots("a", 2)
    assert _state(manager) == before


def test_exhaustion_is_an_error_that_changes_nothing():
    manager = BlockManager(num_blocks=2, block_size=2)
    manager.allocate_slots("a", 3)
    before = _state(manager)
    with pytest.raises(MemoryError, match="only 0 are free"):
        manager.allocate_slots("b", 1)
    assert _state(manager) == before and manager.num_blocks_to_allocate("b", 1) > manager.num_free_blocks
    with pytest.raises(ValueError, match="positive integer"):
        manager.allocate_slots("a", 0)
