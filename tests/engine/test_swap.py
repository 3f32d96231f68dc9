"""Chapter 6's swap space: preempted requests' K/V blocks copied to a CPU pool and back, exactly and all-or-nothing."""

import pytest
import torch

from kvlab.cache.paged_cache import PagedKVCache
from kvlab.cache.swap import SwapSpace

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 2, 6, 4, 2, 3


def filled_cache(seed=0):
    """A device cache whose every block, layer, K and V holds different random numbers."""
    cache = PagedKVCache(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    gen = torch.Generator().manual_seed(seed)
    for pool in cache.k_pools + cache.v_pools:
        pool.copy_(torch.randn(pool.shape, generator=gen))
    return cache


def snapshot(cache, block_ids):
    """The K and V of these device blocks in every layer, copied."""
    return [pool[block_ids].clone() for pool in cache.k_pools + cache.v_pools]


def clobber(cache, block_ids):
    """Another request reuses these device blocks: their K/V are overwritten."""
    for pool in cache.k_pools + cache.v_pools:
        pool[block_ids] = 0.0


def test_swap_out_then_in_restores_k_and_v_of_every_layer():
    cache = filled_cache()
    swap = SwapSpace(cache, num_cpu_blocks=4)
    swapped, others = snapshot(cache, [1, 4]), snapshot(cache, [2, 3])
    cpu_ids = swap.swap_out([1, 4])
    assert len(cpu_ids) == len(set(cpu_ids)) == 2 and swap.num_free_blocks == 2, "two device blocks take two CPU blocks"
    clobber(cache, [1, 4])
    swap.swap_in(cpu_ids, [5, 0])
    for before, after in zip(swapped, snapshot(cache, [5, 0])):
        assert torch.equal(after, before), (
            "swapping in writes each CPU block into its new device block, in order, bit for bit, "
            "K and V of every layer")
    for before, after in zip(others, snapshot(cache, [2, 3])):
        assert torch.equal(after, before), "device blocks that were not swapped are untouched"
    assert swap.blocks_swapped_out == 2 and swap.blocks_swapped_in == 2, "the counters count blocks, each way"
    swap.free(cpu_ids)
    assert swap.num_free_blocks == 4, "freeing the CPU blocks makes them available again"


def test_a_swap_out_that_does_not_fit_returns_none_and_changes_nothing():
    cache = filled_cache()
    swap = SwapSpace(cache, num_cpu_blocks=2)
    device_before = snapshot(cache, list(range(NUM_BLOCKS)))
    assert swap.swap_out([0, 1, 2]) is None, (
        "three blocks do not fit in a CPU pool of two: None, so the caller recomputes instead")
    assert swap.num_free_blocks == 2 and swap.blocks_swapped_out == 0, "a refused swap-out takes no CPU block"
    for before, after in zip(device_before, snapshot(cache, list(range(NUM_BLOCKS)))):
        assert torch.equal(after, before), "a refused swap-out leaves the device cache as it was"
    first = swap.swap_out([0, 1])
    assert first is not None and swap.num_free_blocks == 0, "an exact fit is accepted"
    assert swap.swap_out([2]) is None and swap.blocks_swapped_out == 2, "a full CPU pool refuses even one block"
    clobber(cache, [0, 1])
    swap.swap_in(first, [0, 1])
    for before, after in zip(device_before, snapshot(cache, list(range(NUM_BLOCKS)))):
        assert torch.equal(after, before), "the refused swap-outs did not overwrite the blocks already swapped out"


def test_cpu_blocks_are_reused_after_they_are_freed():
    swap = SwapSpace(filled_cache(), num_cpu_blocks=2)
    ids = swap.swap_out([3, 2])
    swap.free(ids)
    again = swap.swap_out([5, 4])
    assert sorted(again) == sorted(ids), "a freed CPU block can hold another request's K/V"


def test_swap_in_needs_one_device_block_per_cpu_block():
    swap = SwapSpace(filled_cache(), num_cpu_blocks=2)
    ids = swap.swap_out([0, 1])
    with pytest.raises(ValueError, match="2 CPU blocks for 1 device blocks"):
        swap.swap_in(ids, [3])


def test_swapping_nothing_is_a_no_op():
    swap = SwapSpace(filled_cache(), num_cpu_blocks=0)
    assert swap.swap_out([]) == [], "a request without blocks swaps out into no CPU block, even in an empty pool"
    swap.swap_in([], [])
    assert swap.blocks_swapped_out == swap.blocks_swapped_in == 0


def test_block_bytes_counts_k_and_v_of_every_layer():
    swap = SwapSpace(filled_cache(), num_cpu_blocks=1)
    assert swap.block_bytes == 2 * NUM_LAYERS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4, (
        "one block is K and V, in every layer, of block_size tokens x KV heads x head_dim float32 numbers")


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_num_cpu_blocks(bad):
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        SwapSpace(filled_cache(), num_cpu_blocks=bad)


def test_freeing_a_cpu_block_twice_or_an_unknown_one_is_an_error_that_frees_nothing():
    """The swap space's free list is a BlockPool: it catches the double free the old deque silently accepted."""
    swap = SwapSpace(filled_cache(), num_cpu_blocks=4)
    ids = swap.swap_out([0, 1])
    swap.free(ids[:1])
    before = swap.num_free_blocks
    with pytest.raises(ValueError, match="double free"):
        swap.free(ids)                       # ids[0] is already free: neither block is freed
    assert swap.num_free_blocks == before
    with pytest.raises(ValueError, match="outside the swap space of 4 blocks"):
        swap.free([7])
    swap.free(ids[1:])
    assert swap.num_free_blocks == 4
