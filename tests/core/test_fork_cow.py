"""Chapter 5: fork shares blocks, copy-on-write copies only a shared, partly filled last block."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvlab.cache.paged_cache import copy_blocks
from kvlab.core.fork import CowBlockManager
from kvlab.cache.paged_cache import PagedKVCache


def state(m):
    return ({s: (list(m.block_table(s)), m.num_tokens(s)) for s in m.seqs},
            [b.ref_cnt for b in m.block_pool.blocks], m.block_pool.free_block_queue.block_ids(), set(m.freed))


def test_fork_shares_all_blocks_and_counts():
    m = CowBlockManager(10, block_size=4)
    m.allocate("a", 10)  # 3 blocks, last one 2/4 full
    m.fork("a", "b")
    assert m.block_table("b") == m.block_table("a") and m.num_tokens("b") == 10
    assert all(m.block_pool.blocks[b].ref_cnt == 2 for b in m.block_table("a"))
    assert m.num_used_blocks == 3


def test_cow_copies_only_the_partly_filled_shared_block():
    m = CowBlockManager(10, block_size=4)
    m.allocate("a", 10)
    m.fork("a", "b")
    shared_last = m.block_table("a")[-1]
    slot, copy = m.append_slot("b")
    new_last = m.block_table("b")[-1]
    assert copy == (shared_last, new_last) and new_last != shared_last
    assert slot == new_last * 4 + 2
    assert m.block_table("b")[:2] == m.block_table("a")[:2]  # full blocks stay shared
    assert [m.block_pool.blocks[b].ref_cnt for b in m.block_table("a")] == [2, 2, 1]
    # a is now the only owner of its last block: it writes in place
    slot, copy = m.append_slot("a")
    assert copy is None and slot == shared_last * 4 + 2


def test_full_shared_last_block_stays_shared_and_new_block_only_when_full():
    m = CowBlockManager(10, block_size=4)
    m.allocate("a", 8)
    m.fork("a", "b")
    slot, copy = m.append_slot("b")
    assert copy is None and m.block_table("b")[:2] == m.block_table("a")
    assert len(m.block_table("b")) == 3 and slot == m.block_table("b")[2] * 4
    used = m.num_used_blocks
    for _ in range(3):  # the new block fills up without taking another
        assert m.append_slot("b")[1] is None
    assert m.num_used_blocks == used
    m.append_slot("b")
    assert m.num_used_blocks == used + 1


def test_copy_blocks_copies_k_and_v_in_every_layer():
    cache = PagedKVCache(num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=5)
    for pool in cache.k_pools + cache.v_pools:
        pool.copy_(torch.randn_like(pool))
    before = [p.clone() for p in cache.k_pools + cache.v_pools]
    copy_blocks(cache, [(1, 4), (2, 5)])
    for old, new in zip(before, cache.k_pools + cache.v_pools):
        assert torch.equal(new[4], old[1]) and torch.equal(new[5], old[2])
        assert torch.equal(new[:4], old[:4])
    with pytest.raises(ValueError):
        copy_blocks(cache, [(1, 6)])


def test_cow_in_model_cache_copies_the_source_kv():
    cache = PagedKVCache(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=3)
    m = CowBlockManager(8, block_size=4)
    slots = m.allocate("a", 6)
    k = torch.randn(6, 2, 3)
    for layer in range(2):
        cache.write(layer, k * (layer + 1), -k, torch.tensor(slots))
    m.fork("a", "b")
    _, copy = m.append_slot("b")
    copy_blocks(cache, [copy])
    src, dst = copy
    for layer in range(2):
        assert torch.equal(cache.k_pools[layer][dst, :2], cache.k_pools[layer][src, :2])
        assert torch.equal(cache.v_pools[layer][dst, :2], (-k)[4:6])


def test_free_returns_only_unreferenced_blocks():
    m = CowBlockManager(10, block_size=4)
    m.allocate("a", 10)
    m.fork("a", "b")
    m.append_slot("b")  # b owns a private copy of the last block
    assert m.num_used_blocks == 4
    m.free("a")
    assert m.num_used_blocks == 3  # a's private last block is free, the shared ones stay
    assert all(m.block_pool.blocks[b].ref_cnt == 1 for b in m.block_table("b"))
    m.free("b")
    assert m.num_free_blocks == 10


def test_errors_leave_state_unchanged():
    m = CowBlockManager(3, block_size=4)
    m.allocate("a", 6)
    m.fork("a", "b")
    m.allocate("c", 1)  # pool now full
    m.free("c")
    m.allocate("c", 4)
    before = state(m)
    for bad in (lambda: m.fork("zz", "d"), lambda: m.fork("a", "b"), lambda: m.fork("c", "a"),
                lambda: m.free("zz"), lambda: m.allocate("a", 1)):
        with pytest.raises(ValueError):
            bad()
        assert state(m) == before
    with pytest.raises(MemoryError):
        m.append_slot("b")  # needs a copy of the shared block: none free
    assert state(m) == before
    with pytest.raises(MemoryError):
        m.append_slot("c")  # full last block: needs a new one
    assert state(m) == before
    with pytest.raises(MemoryError):
        m.allocate("d", 1)
    assert state(m) == before
    m.free("c")
    before = state(m)
    with pytest.raises(ValueError, match="double free"):
        m.free("c")
    with pytest.raises(ValueError, match="finished"):
        m.fork("c", "e")
    assert state(m) == before


ops = st.lists(st.tuples(st.sampled_from(["alloc", "fork", "append", "free"]), st.integers(0, 7), st.integers(0, 9)),
               max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_fork_append_free_keeps_invariants(program):
    m = CowBlockManager(12, block_size=3)
    for op, a, b in program:
        try:
            if op == "alloc":
                m.allocate(a, b)
            elif op == "fork":
                m.fork(a, b % 8)
            elif op == "append":
                m.append_slot(a)
            else:
                m.free(a)
        except (ValueError, MemoryError):
            pass
        pool = m.block_pool
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        owners = [0] * pool.num_blocks
        for sid in m.seqs:
            table = m.block_table(sid)
            assert len(table) == -(-m.num_tokens(sid) // 3)
            for blk in table:
                owners[blk] += 1
        assert [blk.ref_cnt for blk in pool.blocks] == owners
        assert sorted(pool.free_block_queue.block_ids()) == [i for i, c in enumerate(owners) if c == 0]
