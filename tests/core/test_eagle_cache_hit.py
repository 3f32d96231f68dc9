"""Chapter 8: with use_eagle, a prefix-cache hit loses its last block, whose tokens are recomputed.

EAGLE-style proposers draft from the target's hidden states, which the cache does not keep, so vLLM V1
drops the last matched block of every hit (FullAttentionManager.find_longest_cache_hit) on top of its cap
of len(prompt) - 1 tokens (KVCacheManager.get_computed_blocks). kvlab's KVCacheManager applies both.
"""

import pytest
from test_block_pool import _pool_state

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.prefix_cache import block_hashes


def _cache_prompt(manager, rid, tokens):
    """Run a request's prompt through the manager and free it: its full blocks stay cached in the free queue."""
    blocks, num_cached = manager.get_computed_blocks(rid, tokens)
    manager.allocate_slots(rid, len(tokens) - num_cached, blocks, new_token_ids=tokens[num_cached:])
    manager.free(rid)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("cached_blocks", [1, 3])
def test_use_eagle_hits_one_block_less(block_size, cached_blocks):
    prompt = list(range(100, 100 + cached_blocks * block_size)) + [7, 8]   # the cached blocks, then 2 new tokens
    hits = {}
    for use_eagle in (False, True):
        manager = KVCacheManager(num_blocks=3 * cached_blocks + 4, block_size=block_size, use_eagle=use_eagle)
        _cache_prompt(manager, "a", prompt[:cached_blocks * block_size] + [1])
        blocks, num_cached = manager.get_computed_blocks("b", prompt)
        assert num_cached == len(blocks) * block_size
        hits[use_eagle] = len(blocks)
    assert hits == {False: cached_blocks, True: cached_blocks - 1}, (
        f"{cached_blocks} cached blocks of {block_size}: without EAGLE the hit is all of them, with it one block less "
        f"(the last matched block is recomputed for its hidden states); got {hits}")


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("prompt_blocks, without, with_eagle", [(1, 0, 0), (2, 1, 0), (3, 2, 1)])
def test_a_hit_covering_the_whole_prompt_loses_a_block_to_each_rule(block_size, prompt_blocks, without, with_eagle):
    """The len - 1 cap already recomputes the last block; EAGLE drops the one before it too, as vLLM does."""
    prompt = list(range(200, 200 + prompt_blocks * block_size))
    for use_eagle, expected in ((False, without), (True, with_eagle)):
        manager = KVCacheManager(num_blocks=8, block_size=block_size, use_eagle=use_eagle)
        _cache_prompt(manager, "a", prompt + [1])
        blocks, num_cached = manager.get_computed_blocks("b", prompt)
        rules = "the cap of len - 1 tokens drops the last block" + (", then EAGLE the one before" if use_eagle else "")
        assert len(blocks) == expected and num_cached == expected * block_size, (
            f"use_eagle={use_eagle}: a prompt of {prompt_blocks} cached blocks of {block_size} hits {expected} "
            f"blocks ({rules}), got {len(blocks)}")


def test_the_dropped_block_is_recomputed_into_a_new_block_and_nothing_leaks():
    block_size = 4
    prompt = list(range(300, 312)) + [5, 6]        # 3 full blocks, then 2 tokens
    manager = KVCacheManager(num_blocks=10, block_size=block_size, use_eagle=True)
    blocks, num_cached = manager.get_computed_blocks("a", prompt)
    manager.allocate_slots("a", len(prompt) - num_cached, blocks, new_token_ids=prompt[num_cached:])
    a_blocks = manager.req_to_blocks["a"][:]
    free_before = manager.num_free_blocks

    blocks, num_cached = manager.get_computed_blocks("b", prompt)
    needed = manager.num_blocks_to_allocate("b", len(prompt) - num_cached, blocks)
    slots = manager.allocate_slots("b", len(prompt) - num_cached, blocks, new_token_ids=prompt[num_cached:])
    assert num_cached == 2 * block_size and manager.num_cached_tokens["b"] == num_cached, (
        "a is still running with 3 full blocks cached: with EAGLE b reuses 2 of them")
    assert len(slots) == len(prompt) - num_cached == block_size + 2, (
        "b computes the dropped block's 4 tokens again, then its last 2: one slot each")
    b_blocks = manager.req_to_blocks["b"]
    assert b_blocks[:2] == a_blocks[:2] and all(b.ref_cnt == 2 for b in b_blocks[:2]), "the 2 hits are shared"
    assert b_blocks[2] is not a_blocks[2] and a_blocks[2].ref_cnt == 1, (
        "the dropped block stays a's alone; b writes the recomputed tokens into a block of its own")
    assert free_before - manager.num_free_blocks == needed == 2, "b takes 2 new blocks, as num_blocks_to_allocate said"

    manager.free("a")
    manager.free("b")
    assert manager.num_free_blocks == manager.num_blocks and all(b.ref_cnt == 0 for b in manager.block_pool.blocks)
    queue = manager.block_pool.free_block_queue.block_ids()
    assert sorted(queue) == list(range(manager.num_blocks)), "every block is free exactly once: no leak, no double free"
    # a's three full blocks stay cached: a third request hits them again (less its last block).
    blocks, num_cached = manager.get_computed_blocks("c", prompt)
    assert [b.block_id for b in blocks] == [b.block_id for b in a_blocks[:2]] and num_cached == 2 * block_size


def test_a_hit_on_free_cached_blocks_touches_only_the_blocks_it_keeps():
    manager = KVCacheManager(num_blocks=8, block_size=4, use_eagle=True)
    prompt = list(range(400, 412)) + [9]
    _cache_prompt(manager, "a", prompt)
    blocks, num_cached = manager.get_computed_blocks("b", prompt)
    dropped = manager.block_pool.get_cached_block(block_hashes(prompt, 4)[2])   # a's third full block
    kept_ids = [b.block_id for b in blocks]
    before = _pool_state(manager.block_pool)
    needed = manager.num_blocks_to_allocate("b", len(prompt) - num_cached, blocks)
    assert _pool_state(manager.block_pool) == before, "counting changes nothing"
    manager.allocate_slots("b", len(prompt) - num_cached, blocks, new_token_ids=prompt[num_cached:])
    queue = manager.block_pool.free_block_queue.block_ids()
    assert not set(kept_ids) & set(queue), "the kept hits left the free queue"
    assert len(queue) == 8 - needed == 8 - len(manager.req_to_blocks["b"]), (
        "num_blocks_to_allocate counted every block b took: its 2 free hits and 2 new blocks")
    assert dropped.ref_cnt == 0 and dropped.block_id in queue and dropped.block_id not in manager.block_tables["b"], (
        "the dropped block is neither touched nor evicted: it stays free and cached")
    assert manager.hits == num_cached == 8 and manager.queries == 2 * len(prompt), "the hit rate counts the shorter hit"


def test_use_eagle_must_be_a_bool():
    with pytest.raises(ValueError, match="use_eagle is True"):
        KVCacheManager(num_blocks=4, block_size=4, use_eagle="yes")


def test_the_engine_recomputes_the_dropped_block_and_generates_the_same_tokens():
    """Through the scheduler: the second run of a prompt computes block_size more tokens, and the same output."""
    from conftest import make_tiny_model
    from kvlab import SamplingParams
    from kvlab.engine.llm_engine import LLMEngine

    model = make_tiny_model("llama")
    prompt = [5, 9, 13, 2, 7, 11, 3, 8, 1, 4]       # two full blocks of 4, then 2 tokens
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    computed, outputs = {}, {}
    for use_eagle in (False, True):
        engine = LLMEngine(model, None, block_size=4, num_blocks=16, attention_backend="torch")
        engine.kv_cache_manager.use_eagle = use_eagle   # kvlab has no EAGLE proposer: only the cache rule
        for rid in ("first", "again"):
            engine.add_request(rid, prompt, params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    outputs[use_eagle, rid] = out.outputs[0].token_ids
        computed[use_eagle] = engine.num_tokens_computed
    assert computed[True] - computed[False] == 4, (
        f"with EAGLE the second run recomputes the last matched block (4 tokens): computed {computed}")
    assert outputs[True, "again"] == outputs[False, "again"] == outputs[False, "first"], "recomputing changed tokens"
