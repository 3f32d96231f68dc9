"""The block pool's KV-cache events, in vLLM's schema: what a router would rebuild an index from."""

import pytest

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    as_wire,
    from_wire,
)
from kvlab.core.prefix_cache import block_hashes

B = 4


def manager(num_blocks=8):
    return KVCacheManager(num_blocks, B, enable_prefix_caching=True, enable_kv_cache_events=True)


def test_a_prompt_that_fills_blocks_is_stored_in_one_event_with_its_chain_and_tokens():
    kv = manager()
    prompt = list(range(10))
    kv.allocate_slots("a", len(prompt), new_token_ids=prompt)
    (event,) = kv.take_events()
    assert event == BlockStored(block_hashes(prompt, B), None, prompt[:8], B), \
        "the two full blocks, in chain order, from the start of the sequence (parent None), with their 8 tokens"
    assert kv.take_events() == [], "each event is handed over once"
    kv.allocate_slots("a", 2, new_token_ids=[10, 11])  # the third block fills with two decodes
    (event,) = kv.take_events()
    hashes = block_hashes(prompt + [10, 11], B)
    assert event.block_hashes == [hashes[2]] and event.parent_block_hash == hashes[1], \
        "a block that fills later names the block before it as its parent"
    assert event.token_ids == [8, 9, 10, 11]


def test_a_hit_is_not_stored_again_and_an_eviction_is_removed():
    kv = manager(num_blocks=3)
    kv.allocate_slots("a", 8, new_token_ids=list(range(8)))
    kv.free("a")
    kv.take_events()
    hits, n = kv.get_computed_blocks("b", list(range(8)) + [99])
    kv.allocate_slots("b", 1, hits, new_token_ids=[99])
    assert n == 8 and kv.take_events() == [], "a cache hit stores nothing new"
    kv.free("b")
    kv.allocate_slots("c", 12, new_token_ids=list(range(100, 112)))  # needs every block: both cached ones go
    events = kv.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(block_hashes(list(range(8)), B)), \
        "each reused cached block is reported removed"
    assert isinstance(events[-1], BlockStored) and len(events[-1].block_hashes) == 3


def test_reset_prefix_cache_clears_everything_only_when_nothing_is_held():
    kv = manager()
    kv.allocate_slots("a", 8, new_token_ids=list(range(8)))
    kv.take_events()
    assert not kv.reset_prefix_cache(), "a held block cannot be dropped from under its request"
    kv.free("a")
    assert kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]
    assert kv.get_computed_blocks("b", list(range(9)))[1] == 0, "nothing is cached any more"


def test_events_are_off_by_default():
    kv = KVCacheManager(8, B)
    kv.allocate_slots("a", 8, new_token_ids=list(range(8)))
    assert kv.take_events() == []


def test_the_wire_form_is_vllms_tagged_arrays_and_reads_back():
    hashes = block_hashes(list(range(8)), B)
    batch = KVEventBatch(12.5, [BlockStored(hashes, None, list(range(8)), B), BlockRemoved(hashes[:1]),
                                AllBlocksCleared()])
    wire = as_wire(batch)
    assert wire == [12.5, [["BlockStored", hashes, None, list(range(8)), B, None, "GPU"],
                           ["BlockRemoved", hashes[:1], "GPU"], ["AllBlocksCleared"]]]
    assert from_wire(wire) == batch
    assert as_wire(KVEventBatch(1.0, [], data_parallel_rank=2)) == [1.0, [], 2]


@pytest.mark.parametrize("wire, named", [
    ([1.0], "KV event batch"), ([1.0, [["Bogus"]]], "led by one of"),
    ([1.0, [["BlockRemoved"]]], "missing"), ([1.0, [["BlockStored", [b"x"], None, [1, 2], 4, None, "GPU"]]], "4"),
])
def test_a_malformed_batch_is_refused_naming_what_is_wrong(wire, named):
    with pytest.raises(ValueError, match=named):
        from_wire(wire)
