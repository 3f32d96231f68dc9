"""Chapter 4: the reference-counted block pool and its free queue in least-recently-used order.

The free queue follows vLLM V1's BlockPool.free_blocks: a freed block WITHOUT a hash goes to the
front (reused first, it holds nothing a later request could hit), a freed cached block to the back
(evicted last, least recently freed first). Until kvlab matched this, every freed block went to the
back; the tests below whose expectations changed with that say so.
"""

import pytest

from kvlab.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def _pool_state(pool: BlockPool):
    return (pool.free_block_queue.block_ids(), [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            dict(pool.cached_block_hash_to_block), pool.num_evictions)


# --- the free queue -------------------------------------------------------------------------------

def test_free_queue_pops_in_order_and_removes_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4] and len(queue) == 4
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    assert queue.block_ids() == [1, 3, 4, 2]
    with pytest.raises(ValueError, match="block 2 is already in the free queue"):
        queue.append(blocks[2])
    with pytest.raises(ValueError, match="block 0 is not in the free queue"):
        queue.remove(blocks[0])
    for _ in range(4):
        queue.popleft()
    with pytest.raises(MemoryError, match="empty"):
        queue.popleft()


def test_prepend_puts_blocks_at_the_front_in_the_given_order():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks[:3])
    queue.prepend([blocks[5], blocks[3]])
    assert queue.block_ids() == [5, 3, 0, 1, 2] and len(queue) == 5, \
        "the first block given is reused next, the second after it, then the blocks already free"
    queue.prepend([])
    assert queue.block_ids() == [5, 3, 0, 1, 2]
    assert queue.popleft() is blocks[5]
    queue.remove(blocks[3])
    queue.prepend([blocks[3]])
    assert queue.block_ids() == [3, 0, 1, 2] and blocks[3].prev_free_block is queue._head
    with pytest.raises(ValueError, match="block 0 is already in the free queue"):
        queue.prepend([blocks[0]])
    with pytest.raises(ValueError, match="block 4 is already in the free queue"):
        queue.prepend([blocks[4], blocks[4]])
    assert queue.block_ids() == [3, 0, 1, 2] and len(queue) == 4, "a rejected prepend changes nothing"
    empty = FreeKVCacheBlockQueue()
    empty.prepend([blocks[4]])
    assert empty.block_ids() == [4] and empty.popleft() is blocks[4]


def test_remove_touches_only_the_neighbours():
    # O(1): removing a block rewires its two neighbours and nothing else.
    blocks = [KVCacheBlock(i) for i in range(1000)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[500])
    assert blocks[499].next_free_block is blocks[501] and blocks[501].prev_free_block is blocks[499]
    assert len(queue) == 999


# --- the pool -------------------------------------------------------------------------------------

def test_new_blocks_come_from_the_front_and_freed_cached_ones_go_to_the_back():
    # Changed when free_blocks learnt vLLM's rule: a's blocks are now cached first, since only a
    # cached block goes to the back (uncached ones go to the front, see the next test).
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(2)
    assert [x.block_id for x in a + b] == [0, 1, 2, 3] and all(x.ref_cnt == 1 for x in a + b)
    pool.cache_full_blocks(a, [b"a0", b"a1"])
    pool.free_blocks(reversed(a))
    assert pool.free_block_queue.block_ids() == [4, 5, 1, 0]
    assert [x.block_id for x in pool.get_new_blocks(3)] == [4, 5, 1]
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 5


def test_freed_uncached_blocks_go_to_the_front_and_are_reused_before_any_cached_block():
    # vLLM's test_prefill / test_evict order: a request's partly filled last block (no hash) is put
    # ahead of the never-used blocks, its cached blocks behind them. With the old "everything to the
    # back" rule the queue was [6, 7, 2, 1, 0] and the next request got block 6 instead of 3.
    pool = BlockPool(8)
    request = pool.get_new_blocks(4)          # blocks 0, 1, 2 full and cached; 3 partly filled
    other = pool.get_new_blocks(2)            # blocks 4 and 5, held by another request
    pool.cache_full_blocks(request[:3], [b"h0", b"h1", b"h2"])
    pool.free_blocks(reversed(request))       # last block first, as a request frees its blocks
    assert pool.free_block_queue.block_ids() == [3, 6, 7, 2, 1, 0], \
        "the uncached block goes to the front, the cached ones to the back, tail first"
    pool.free_blocks(reversed(other))         # neither is cached: both go to the front, in the order given
    assert pool.free_block_queue.block_ids() == [5, 4, 3, 6, 7, 2, 1, 0], \
        "blocks one call sends to the front keep the order given, ahead of every block already free"
    assert [b.block_id for b in pool.get_new_blocks(5)] == [5, 4, 3, 6, 7] and pool.num_evictions == 0, \
        "a new request never evicts a cached block while an uncached free block exists"
    assert pool.get_cached_block(b"h2") is request[2]
    assert pool.get_new_blocks(1)[0] is request[2] and pool.num_evictions == 1, \
        "only when no uncached block is left is the least recently freed cached block evicted"


def test_one_free_call_splits_its_blocks_by_hash_keeping_their_order():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(6)
    pool.cache_full_blocks([blocks[1], blocks[4]], [b"x", b"y"])
    pool.free_blocks([blocks[i] for i in (5, 4, 3, 2, 1, 0)])
    assert pool.free_block_queue.block_ids() == [5, 3, 2, 0, 4, 1], \
        "uncached 5, 3, 2, 0 at the front in the order given; cached 4, 1 at the back in the order given"


def test_least_recently_freed_cached_block_is_evicted_first():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [b"h0", b"h1", b"h2"])
    pool.free_blocks([blocks[1], blocks[2], blocks[0]])  # 1 freed longest ago
    (reused,) = pool.get_new_blocks(1)
    assert reused is blocks[1] and reused.block_hash is None
    assert pool.get_cached_block(b"h1") is None and pool.num_evictions == 1
    assert pool.get_cached_block(b"h2") is blocks[2] and pool.get_cached_block(b"h0") is blocks[0]


def test_touch_revives_a_free_cached_block_out_of_the_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks[1:2], [b"x"])
    pool.free_blocks(blocks)
    # Was [3, 0, 1, 2] when every freed block went to the back: uncached 0 and 2 now go to the front.
    assert pool.free_block_queue.block_ids() == [0, 2, 3, 1]
    hit = pool.get_cached_block(b"x")
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.free_block_queue.block_ids() == [0, 2, 3]
    pool.touch([hit])
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 3
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 3, "still held by one request"


def test_a_hash_keeps_its_first_block():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_blocks([a], [b"same"]) == 1
    assert pool.cache_full_blocks([b], [b"same"]) == 0
    assert pool.get_cached_block(b"same") is a and b.block_hash is None


def test_pool_errors_leave_it_unchanged():
    pool = BlockPool(4)
    held = pool.get_new_blocks(2)
    pool.cache_full_blocks(held[:1], [b"h"])
    pool.free_blocks(held[:1])
    before = _pool_state(pool)
    with pytest.raises(MemoryError, match="asked for 4 blocks but only 3 are free"):
        pool.get_new_blocks(4)
    with pytest.raises(ValueError, match="double free: block 0"):
        pool.free_blocks(held[:1])
    with pytest.raises(ValueError, match="double free: block 1 has ref_cnt 1, freed 2 times"):
        pool.free_blocks([held[1], held[1]])
    with pytest.raises(ValueError, match="does not belong to this pool"):
        pool.free_blocks([held[1], KVCacheBlock(1)])
    with pytest.raises(ValueError, match="does not belong to this pool"):
        pool.free_blocks([BlockPool(9).blocks[7]])
    with pytest.raises(ValueError, match="block 3 is free and holds no cached contents"):
        pool.touch([pool.blocks[0], pool.blocks[3]])
    with pytest.raises(ValueError, match="block 0 is free"):
        pool.cache_full_blocks([pool.blocks[0]], [b"y"])
    assert _pool_state(pool) == before
    assert pool.can_allocate(3) and not pool.can_allocate(4) and _pool_state(pool) == before


def test_without_prefix_caching_nothing_is_cached():
    pool = BlockPool(2, enable_prefix_caching=False)
    blocks = pool.get_new_blocks(1)
    assert pool.cache_full_blocks(blocks, [b"h"]) == 0 and pool.get_cached_block(b"h") is None




# --- the rules the mutation audit found unpinned ----------------------------------------------------

def test_free_queue_hands_out_the_cached_block_freed_longest_ago_first():
    # The blocks are now cached first: the LRU order is a property of cached blocks, which join the
    # back; uncached blocks join the front (next test).
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(blocks, [b"h0", b"h1", b"h2", b"h3", b"h4"])
    for i in (3, 0, 4, 1, 2):  # freed one at a time, in this order
        pool.free_blocks([blocks[i]])
    assert pool.free_block_queue.block_ids() == [3, 0, 4, 1, 2], "freed cached blocks join the back of the free queue"
    reused = [pool.get_new_blocks(1)[0].block_id for _ in range(5)]
    assert reused == [3, 0, 4, 1, 2], "LRU: the block freed longest ago is reused first, the last one freed reused last"


def test_uncached_blocks_freed_one_at_a_time_are_reused_last_freed_first():
    # Before kvlab followed vLLM this was FIFO too ([3, 0, 4, 1, 2]); uncached blocks now join the front.
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    for i in (3, 0, 4, 1, 2):
        pool.free_blocks([blocks[i]])
    assert pool.free_block_queue.block_ids() == [2, 1, 4, 0, 3], "each freed uncached block goes to the front"
    assert [pool.get_new_blocks(1)[0].block_id for _ in range(5)] == [2, 1, 4, 0, 3]


def test_a_block_freed_twice_is_reused_after_one_freed_once_in_between():
    # a and b are now cached first: only cached blocks are reused in the order they were freed.
    pool = BlockPool(3)
    a, b, _ = pool.get_new_blocks(3)
    pool.cache_full_blocks([a, b], [b"a", b"b"])
    pool.free_blocks([a])
    pool.free_blocks([b])
    (again,) = pool.get_new_blocks(1)
    assert again is a, "the front of the queue is the block freed longest ago"
    pool.cache_full_blocks([again], [b"a2"])  # reusing a evicted its hash: it is filled and cached anew
    pool.free_blocks([again])  # a is freed again: now it is the most recently freed
    assert pool.free_block_queue.block_ids() == [1, 0], "a block freed again goes behind every block already free"


def test_a_freed_cached_block_stays_cached_until_it_is_reused():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"h0", b"h1"])
    pool.free_blocks(blocks)
    assert pool.get_cached_block(b"h0") is blocks[0] and pool.get_cached_block(b"h1") is blocks[1], \
        "freeing a full block keeps its K/V and its hash: a later request can still hit it"
    assert blocks[0].block_hash == b"h0" and pool.num_evictions == 0, "nothing is evicted when a block is freed"
    (fresh,) = pool.get_new_blocks(1)
    assert fresh.block_id == 2 and fresh.block_hash is None, "the never-used block 2 was freed longest ago"
    assert pool.get_cached_block(b"h0") is blocks[0] and pool.num_evictions == 0, \
        "reusing an uncached free block evicts no cached one"
    (reused,) = pool.get_new_blocks(1)
    assert reused is blocks[0] and reused.block_hash is None and pool.get_cached_block(b"h0") is None, \
        "a cached block is evicted (its hash forgotten) exactly when it is handed out for new tokens"
    assert pool.num_evictions == 1 and pool.get_cached_block(b"h1") is blocks[1], "only the reused block is evicted"


def test_a_hit_on_a_free_cached_block_takes_it_out_of_the_queue_without_evicting_it():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks[:1], [b"h0"])
    pool.free_blocks(blocks)  # queue: 1, 2 (uncached, to the front), 0 (cached, to the back)
    pool.touch([blocks[0]])   # a new request hits block 0
    assert blocks[0].ref_cnt == 1 and blocks[0].block_hash == b"h0" and pool.num_evictions == 0, \
        "a hit shares the cached K/V: its hash stays"
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 2], \
        "a hit block is no longer free: it is never handed out"
