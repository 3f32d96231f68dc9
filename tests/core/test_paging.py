"""Chapter 3: block tables, slot mapping, the paged K/V pools and multi-sequence decoding on them."""

import copy
import random

import pytest
import torch

from conftest import make_tiny_model
from kvlab.baselines.transformers_generate import reference_generate
from kvlab.cache.attention import causal_attention
from kvlab.cache.paged_cache import PagedKVCache, gather_kv, paged_attention
from kvlab.cache.ragged_batch import BatchLayout
from kvlab.core.paging import BlockManager, num_blocks_needed, physical_slot
from kvlab.decoding.paged_generate import PagedGenerator


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


def _shuffle_free_list(gen: PagedGenerator, seed: int):
    blocks = list(gen.block_manager.free_block_ids)
    random.Random(seed).shuffle(blocks)
    gen.block_manager.free_block_ids.clear()
    gen.block_manager.free_block_ids.extend(blocks)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_sequences_joining_at_different_steps_equal_generate_alone(family):
    model = make_tiny_model(family)
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 97) for _ in range(rng.randint(1, 12))] for _ in range(4)]
    lengths = [rng.randint(1, 20) for _ in prompts]
    gen = PagedGenerator(model, num_blocks=40, block_size=4)
    _shuffle_free_list(gen, 1)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        gen.add_request(p, n, arrival_step=2 * i)
    outputs = gen.run()
    for p, n, out in zip(prompts, lengths, outputs):
        assert out == reference_generate(model, p, n)
    assert gen.block_manager.num_free_blocks == 40, "finished sequences return every block"


def test_embedded_model_on_the_paged_cache_equals_generate(embedded):
    model, tokenizer = embedded
    texts = ["ROMEO:\n", "KING HENRY:\nOnce more unto", "First Citizen:\nWe are accounted poor citizens"]
    lengths = [50, 23, 37]
    gen = PagedGenerator(model, num_blocks=64, block_size=16)
    _shuffle_free_list(gen, 2)
    for i, (t, n) in enumerate(zip(texts, lengths)):
        gen.add_request(tokenizer(t)["input_ids"], n, arrival_step=5 * i)
    for t, n, out in zip(texts, lengths, gen.run()):
        assert out == reference_generate(model, tokenizer(t)["input_ids"], n), t


def test_a_step_that_cannot_get_its_blocks_raises_before_touching_the_pool():
    model = make_tiny_model("llama")
    gen = PagedGenerator(model, num_blocks=3, block_size=2)
    gen.add_request([1, 2, 3, 4, 5], 4)
    gen.add_request([6, 7], 2)
    before = _state(gen.block_manager)
    with pytest.raises(MemoryError, match="needs 4 new blocks"):
        gen.step()
    assert _state(gen.block_manager) == before
