"""Chapters 3-5: every block manager speaks one vocabulary (vLLM V1's names) with the same errors.

Chapter 3's BlockManager, Chapter 4's KVCacheManager (with and without prefix caching) and Chapter 5's
CowBlockManager run the same calls here and must agree on block tables, slots, counts and errors.
"""

import pytest

from kvlab.core.fork import CowBlockManager
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.paging import BaseBlockManager, BlockManager

MANAGERS = {
    "BlockManager": lambda n, size: BlockManager(n, size),
    "KVCacheManager": lambda n, size: KVCacheManager(n, size, enable_prefix_caching=False),
    "KVCacheManager+prefix caching": lambda n, size: KVCacheManager(n, size, enable_prefix_caching=True),
    "CowBlockManager": lambda n, size: CowBlockManager(n, size),
}


@pytest.fixture(params=list(MANAGERS), ids=list(MANAGERS))
def make(request):
    return MANAGERS[request.param]


def _state(m):
    return m.block_tables, dict(m.num_tokens), m.num_free_blocks


def _grow(m, rid, tokens):
    return m.allocate_slots(rid, len(tokens), new_token_ids=tokens)


def test_every_manager_is_a_base_block_manager_with_the_shared_queries(make):
    m = make(8, 4)
    assert isinstance(m, BaseBlockManager)
    assert (m.num_blocks, m.block_size, m.num_free_blocks, m.num_used_blocks) == (8, 4, 8, 0)
    assert m.block_tables == {} and m.num_tokens == {}


def test_the_same_calls_give_the_same_tables_and_slots(make):
    m = make(8, 4)
    assert _grow(m, "a", [1, 2, 3, 4, 5]) == [0, 1, 2, 3, 4]
    assert _grow(m, "b", [6, 7, 8]) == [8, 9, 10]
    assert _grow(m, "a", [9, 10, 11, 12]) == [5, 6, 7, 12], "a fills its last block, then takes the next free one"
    assert m.block_tables == {"a": [0, 1, 3], "b": [2]} and m.num_tokens == {"a": 9, "b": 3}
    assert (m.num_free_blocks, m.num_used_blocks) == (4, 4)
    m.free("a")
    assert m.block_tables == {"b": [2]} and m.num_tokens == {"b": 3} and m.num_free_blocks == 7


def test_num_blocks_to_allocate_is_what_allocate_slots_takes(make):
    m = make(8, 4)
    for rid, n in [("a", 3), ("a", 1), ("a", 1), ("b", 9), ("a", 7)]:
        expected = m.num_blocks_to_allocate(rid, n)
        before = m.num_free_blocks
        _grow(m, rid, list(range(n)))
        assert before - m.num_free_blocks == expected, f"{rid} + {n} tokens took a different number of blocks"
    assert m.num_blocks_to_allocate("a", 0) == 0


def test_a_new_request_has_no_computed_blocks_without_a_prefix_cache(make):
    m = make(8, 4)
    assert m.get_computed_blocks("a", [1, 2, 3, 4, 5]) == ([], 0)
    _grow(m, "a", [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="already running"):
        m.get_computed_blocks("a", [1, 2, 3, 4, 5])


def test_the_same_errors_and_none_changes_anything(make):
    m = make(3, 4)
    _grow(m, "a", [1, 2, 3, 4, 5])
    m.free("a")
    _grow(m, "b", [1, 2, 3, 4, 5, 6])
    before = _state(m)
    with pytest.raises(KeyError, match="'a' holds no blocks .*already freed"):
        m.free("a")
    with pytest.raises(KeyError, match="'zz' holds no blocks .*unknown"):
        m.free("zz")
    with pytest.raises(MemoryError, match="request 'c' needs 2 more blocks but only 1 are free"):
        _grow(m, "c", [0] * 5)
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots("b", 0, new_token_ids=[])
    with pytest.raises(ValueError, match="2 new token ids for 1"):
        m.allocate_slots("b", 1, new_token_ids=[1, 2])
    assert _state(m) == before, "a failed call changes nothing"
