"""Chapters 3 and 5: the paged K/V pools written by slot, gathered through block tables, and copied block by block."""


import pytest
import torch

from kvlab.cache.attention import causal_attention
from kvlab.cache.paged_cache import PagedKVCache, copy_blocks, gather_kv, paged_attention
from kvlab.cache.ragged_batch import BatchLayout
from kvlab.core.fork import CowBlockManager
from kvlab.core.paging import physical_slot


def test_slot_outside_the_pool_is_rejected_and_the_pool_untouched():
    cache = PagedKVCache(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=2)
    before = cache.k_pools[0].clone()
    with pytest.raises(ValueError, match="slot 8 is outside the pool of 8 slots"):
        cache.write(0, torch.ones(2, 1, 2), torch.ones(2, 1, 2), torch.tensor([3, 8]))
    with pytest.raises(ValueError, match="one slot per token"):
        cache.write(0, torch.ones(2, 1, 2), torch.ones(2, 1, 2), torch.tensor([3]))
    assert torch.equal(cache.k_pools[0], before)
    with pytest.raises(ValueError, match="outside the pool"):
        cache.set_batch(BatchLayout([1], [1], [[5]], torch.tensor([0])))


def test_gather_and_paged_attention_equal_contiguous_attention_on_shuffled_blocks():
    g = torch.Generator().manual_seed(0)
    block_size, seq_len, heads, kv_heads, dim = 4, 11, 4, 2, 8
    k = torch.randn(kv_heads, seq_len, dim, generator=g)
    v = torch.randn(kv_heads, seq_len, dim, generator=g)
    cache = PagedKVCache(1, num_blocks=9, block_size=block_size, num_kv_heads=kv_heads, head_dim=dim)
    table = [6, 0, 3]  # deliberately out of order
    slots = torch.tensor([physical_slot(table, p, block_size) for p in range(seq_len)])
    cache.write(0, k.transpose(0, 1), v.transpose(0, 1), slots)
    torch.testing.assert_close(gather_kv(cache.k_pools[0], table, seq_len), k)
    q = torch.randn(heads, 3, dim, generator=g)
    out = paged_attention(q, cache.k_pools[0], cache.v_pools[0], table, seq_len, 0.3)
    torch.testing.assert_close(out, causal_attention(q, k, v, 0.3))


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
    slots = m.allocate_slots("a", 6)
    k = torch.randn(6, 2, 3)
    for layer in range(2):
        cache.write(layer, k * (layer + 1), -k, torch.tensor(slots))
    m.fork("a", "b")
    (_,) = m.allocate_slots("b", 1)
    (copy,) = m.take_copy_orders()  # b's shared, partly filled last block must be copied before b writes
    copy_blocks(cache, [copy])
    src, dst = copy
    for layer in range(2):
        assert torch.equal(cache.k_pools[layer][dst, :2], cache.k_pools[layer][src, :2])
        assert torch.equal(cache.v_pools[layer][dst, :2], (-k)[4:6])
