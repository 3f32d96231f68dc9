"""The CPU tier: how many host blocks a byte budget buys, and block copies that come back bit for bit."""

import pytest
import torch

from kvlab.kv_offload import CPUBackend, LRUOffloadingManager, kv_bytes_per_block, num_blocks_for_budget
from kvlab.kv_offload.worker import copy_blocks, make_host_pool, swap_in, swap_out

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 2, 4, 2, 8


def test_bytes_per_block_counts_k_and_v_of_every_layer():
    """2 layers x (K, V) x 4 tokens x 2 heads x 8 dims x 2 bytes (bfloat16) = 512 bytes."""
    assert kv_bytes_per_block(NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, 2) == 512
    # Llama-3-8B: 32 layers, 8 KV heads of 128, block of 16 tokens in bfloat16 is 2 MiB a block.
    assert kv_bytes_per_block(32, 16, 8, 128, 2) == 2 * 1024 * 1024


def test_the_budget_buys_whole_blocks_only():
    assert num_blocks_for_budget(4 * 2**30, 2 * 2**20) == 2048, "4 GiB of 2 MiB blocks"
    assert num_blocks_for_budget(1023, 512) == 1, "a partial block buys nothing"
    backend = CPUBackend.from_budget(1536, BLOCK_SIZE, 512)
    assert (backend.medium, backend.num_blocks, backend.block_size) == ("CPU", 3, BLOCK_SIZE)


@pytest.mark.parametrize("budget,per_block,message", [
    (0, 512, "kv_offloading_size"), (-5, 512, "kv_offloading_size"), (100, 0, "bytes_per_block"),
    (100, 512, "less than one block"),
])
def test_bad_budgets_are_refused_by_name(budget, per_block, message):
    with pytest.raises(ValueError, match=message):
        num_blocks_for_budget(budget, per_block)


def test_bad_block_dimensions_are_refused_by_name():
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_bytes_per_block(NUM_LAYERS, BLOCK_SIZE, 0, HEAD_DIM, 2)


def random_pools(num_blocks: int, dtype: torch.dtype, seed: int):
    """kvlab's device layout: per layer a K and a V pool [num_blocks, block_size, num_kv_heads, head_dim]."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)

    def one():
        if dtype == torch.int8:
            return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
        return torch.randn(shape, generator=g).to(dtype)

    return [one() for _ in range(NUM_LAYERS)], [one() for _ in range(NUM_LAYERS)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_swap_out_then_in_is_bit_identical(dtype):
    """Device blocks 5, 1, 6 go to host slots 2, 0, 3 and come back into other device blocks unchanged."""
    k_pools, v_pools = random_pools(8, dtype, seed=0)
    host = make_host_pool(4, NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype)
    swap_out(k_pools, v_pools, [5, 1, 6], host, [2, 0, 3])
    assert torch.equal(host[2, 1, 0], k_pools[1][5]) and torch.equal(host[0, 0, 1], v_pools[0][1]), \
        "host block i is [num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]"
    assert not host[1].any(), "host slot 1 was not written"
    k_new, v_new = random_pools(8, dtype, seed=1)
    swap_in(host, [2, 0, 3], k_new, v_new, [0, 7, 4])
    for layer in range(NUM_LAYERS):
        for src, dst in ((5, 0), (1, 7), (6, 4)):
            assert torch.equal(k_new[layer][dst].view(torch.uint8), k_pools[layer][src].view(torch.uint8))
            assert torch.equal(v_new[layer][dst].view(torch.uint8), v_pools[layer][src].view(torch.uint8))
    untouched = random_pools(8, dtype, seed=1)
    assert torch.equal(k_new[0][1], untouched[0][0][1]), "a device block not named must not change"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_copy_blocks_between_block_major_pools(dtype):
    src = make_host_pool(3, NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype)
    src.copy_(torch.arange(src.numel()).reshape(src.shape).to(dtype))
    dst = make_host_pool(5, NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype)
    copy_blocks(src, dst, [2, 0], [4, 1])
    assert torch.equal(dst[4], src[2]) and torch.equal(dst[1], src[0]) and not dst[0].any()


def test_mover_refuses_conversion_and_bad_ids():
    """A copy that would cast, overflow the pool or write two blocks to one slot is refused before it starts."""
    k_pools, v_pools = random_pools(4, torch.float32, seed=0)
    host16 = make_host_pool(4, NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16)
    with pytest.raises(ValueError, match="must not convert"):
        swap_out(k_pools, v_pools, [0], host16, [0])
    host = make_host_pool(4, NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    with pytest.raises(ValueError, match="host_block_ids has id 4"):
        swap_out(k_pools, v_pools, [0], host, [4])
    with pytest.raises(ValueError, match="repeats an id"):
        swap_out(k_pools, v_pools, [0, 1], host, [2, 2])
    with pytest.raises(ValueError, match="one destination per block"):
        swap_in(host, [0, 1], k_pools, v_pools, [0])
    with pytest.raises(ValueError, match="2 layers but k_pools has 1"):
        swap_out(k_pools[:1], v_pools[:1], [0], host, [0])
    assert not host.any(), "no refused call may have written anything"


def test_manager_and_host_pool_together_round_trip_through_eviction():
    """The scheduler's spec drives the worker's copy: stored blocks load back intact after another was evicted."""
    dtype = torch.bfloat16
    manager = LRUOffloadingManager(CPUBackend(BLOCK_SIZE, 2))
    host = make_host_pool(2, NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype)
    k_pools, v_pools = random_pools(6, dtype, seed=3)
    device_block_of = {"a": 0, "b": 1, "c": 2}
    for h in ("a", "b", "c"):
        out = manager.prepare_store([h])
        swap_out(k_pools, v_pools, [device_block_of[h]], host, list(out.store_spec.block_ids))
        manager.complete_store([h])
    assert manager.lookup(["a"]) == 0 and manager.lookup(["b", "c"]) == 2, "a, the oldest, made room for c"
    spec = manager.prepare_load(["b", "c"])
    swap_in(host, list(spec.block_ids), k_pools, v_pools, [4, 5])
    manager.complete_load(["b", "c"])
    for layer in range(NUM_LAYERS):
        assert torch.equal(k_pools[layer][4], k_pools[layer][1]) and torch.equal(v_pools[layer][5], v_pools[layer][2])
