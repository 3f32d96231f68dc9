"""Chapter 6's swap space: preempted requests' K/V blocks copied to a CPU pool and back, exactly and all-or-nothing.

The copies are the runner's (kvlab.cache.swap.SwapSpace, driven by the scheduler output's copy orders);
which CPU blocks are free is the scheduler's (tests/engine/test_scheduler.py).
"""

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
    swap.swap_out([(1, 2), (4, 0)])       # the scheduler chose CPU blocks 2 and 0 for device blocks 1 and 4
    clobber(cache, [1, 4])
    swap.swap_in([(2, 5), (0, 0)])        # and device blocks 5 and 0 to bring them back into
    for before, after in zip(swapped, snapshot(cache, [5, 0])):
        assert torch.equal(after, before), (
            "swapping in writes each CPU block into its device block, bit for bit, K and V of every layer")
    for before, after in zip(others, snapshot(cache, [2, 3])):
        assert torch.equal(after, before), "device blocks that were not swapped are untouched"
    assert swap.blocks_swapped_out == 2 and swap.blocks_swapped_in == 2, "the counters count blocks, each way"


@pytest.mark.parametrize("direction, pairs, message", [
    ("out", [(0, 0), (6, 1)], "device block ids \\[6\\] are outside the pool of 6 blocks"),
    ("out", [(0, 4)], "CPU block ids \\[4\\] are outside the swap space of 4 blocks"),
    ("in", [(0, 1), (1, 1)], "two copies write the same block"),
    ("in", [(-1, 1)], "CPU block ids \\[-1\\]"),
])
def test_a_bad_copy_order_is_refused_before_anything_is_copied(direction, pairs, message):
    cache = filled_cache()
    swap = SwapSpace(cache, num_cpu_blocks=4)
    device_before, host_before = snapshot(cache, list(range(NUM_BLOCKS))), [t.clone() for t in swap.blocks]
    with pytest.raises(ValueError, match=message):
        getattr(swap, f"swap_{direction}")(pairs)
    for before, after in zip(device_before, snapshot(cache, list(range(NUM_BLOCKS)))):
        assert torch.equal(after, before), "a refused order leaves the device cache as it was"
    assert all(torch.equal(a, b) for a, b in zip(host_before, swap.blocks)), "and the CPU pool too"
    assert swap.blocks_swapped_out == swap.blocks_swapped_in == 0


def test_swapping_nothing_is_a_no_op():
    swap = SwapSpace(filled_cache(), num_cpu_blocks=0)
    swap.swap_out([])
    swap.swap_in([])
    assert swap.blocks_swapped_out == swap.blocks_swapped_in == 0


def test_block_bytes_counts_k_and_v_of_every_layer():
    swap = SwapSpace(filled_cache(), num_cpu_blocks=1)
    assert swap.block_bytes == 2 * NUM_LAYERS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4, (
        "one block is K and V, in every layer, of block_size tokens x KV heads x head_dim float32 numbers")


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_num_cpu_blocks(bad):
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        SwapSpace(filled_cache(), num_cpu_blocks=bad)
