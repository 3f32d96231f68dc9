"""Hybrid models' KV cache: specs, groups of one page size, and one manager per group over one block pool.

A sliding-window group gives back every block its future queries cannot see and keeps the null block in its place;
a prefix hit is the longest prefix every group serves; the pool's invariants hold under a random workload of
shared prefixes, chunked prefills, decodes, preemptions and finishes.
"""

import random

import pytest

from kvlab.core.kv_cache_coordinator import HybridKVCacheCoordinator
from kvlab.core.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
    group_layers,
    specs_from_layer_types,
    unify_page_sizes,
)
from kvlab.core.single_type_kv_cache_manager import SlidingWindowManager


def hybrid(window=8, block_size=4, num_blocks=64, pattern=("sliding_attention", "full_attention"), layers=4,
           **kwargs):
    types = [pattern[i % len(pattern)] for i in range(layers)]
    specs = specs_from_layer_types(types, layers, block_size, 2, 8, sliding_window=window, attention_chunk_size=8)
    return HybridKVCacheCoordinator(group_layers(specs), num_blocks, **kwargs)


def admit(coordinator, rid, tokens, chunk=None):
    hits, num_cached = coordinator.get_computed_blocks(rid, tokens)
    n = len(tokens) - num_cached if chunk is None else min(chunk, len(tokens) - num_cached)
    coordinator.allocate_slots(rid, n, hits, new_token_ids=tokens[num_cached:num_cached + n],
                               computed_token_ids=tokens[:num_cached])
    return num_cached


# --- specs and groups -----------------------------------------------------------------------------------------


def test_layers_are_grouped_by_spec_into_groups_of_equal_size():
    # Gemma 3's pattern: five local layers, then one global, twice.
    types = (["sliding_attention"] * 5 + ["full_attention"]) * 2
    groups = group_layers(specs_from_layer_types(types, 12, 16, 8, 128, sliding_window=1024))
    assert [g.layer_ids for g in groups] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10), (5, 11)], \
        "two full layers set the group size: the ten local layers make five groups of two, in layer order"
    assert {type(g.kv_cache_spec) for g in groups[:5]} == {SlidingWindowSpec}
    assert groups[5].kv_cache_spec == FullAttentionSpec(16, 8, 128)


def test_pages_are_unified_by_raising_the_smaller_pages_block_size():
    small, large = FullAttentionSpec(16, 2, 64), SlidingWindowSpec(16, 8, 64, sliding_window=128)
    assert large.page_size_bytes == 4 * small.page_size_bytes
    unified = unify_page_sizes([small, large])
    assert unified[0].block_size == 64 and unified[0].page_size_bytes == large.page_size_bytes, \
        "a page four times smaller gets blocks four times longer"
    with pytest.raises(ValueError, match="does not divide the largest page"):
        unify_page_sizes([FullAttentionSpec(16, 3, 64), FullAttentionSpec(16, 8, 64)])
    with pytest.raises(ValueError, match="Mamba state of 100 bytes is smaller than the largest page"):
        unify_page_sizes([MambaSpec(16, 100), FullAttentionSpec(16, 8, 64)])
    # A Mamba state larger than a page: the attention blocks grow until one page holds it (vLLM's hybrid rule).
    state = MambaSpec(16, 8 * FullAttentionSpec(16, 8, 64).page_size_bytes)
    assert unify_page_sizes([FullAttentionSpec(16, 8, 64), state])[0].block_size == 128


def test_bad_layer_patterns_and_windows_name_the_field():
    with pytest.raises(ValueError, match="layer_types has 3 entries but the model has 4 layers"):
        specs_from_layer_types(["full_attention"] * 3, 4, 16, 8, 128)
    with pytest.raises(ValueError, match="sliding_window"):
        specs_from_layer_types(["sliding_attention"], 1, 16, 8, 128, sliding_window=0)
    with pytest.raises(ValueError, match="sliding_window"):
        SlidingWindowSpec(16, 8, 128, sliding_window=2.5)
    with pytest.raises(ValueError, match="no sliding_window"):
        specs_from_layer_types(["sliding_attention"], 1, 16, 8, 128)
    with pytest.raises(ValueError, match=r"layer_types\[0\] is 'linear_attention'"):
        specs_from_layer_types(["linear_attention"], 1, 16, 8, 128)
    with pytest.raises(ValueError, match="page sizes differ"):
        from kvlab.core.kv_cache_interface import KVCacheGroupSpec
        HybridKVCacheCoordinator([KVCacheGroupSpec((0,), FullAttentionSpec(16, 8, 128)),
                                  KVCacheGroupSpec((1,), FullAttentionSpec(16, 4, 128))], 8)


# --- the sliding window gives blocks back ---------------------------------------------------------------------


def test_a_sliding_window_group_gives_back_what_no_query_will_read_during_prefill_and_decode():
    c = hybrid(window=8, block_size=4)
    sw, full = c.managers
    prompt = list(range(30))
    admit(c, "a", prompt, chunk=12)                 # tokens 0-11: the chunk's queries reach back to nothing older
    assert c.get_block_ids("a")[0] == [1, 2, 3]
    c.allocate_slots("a", 12, new_token_ids=prompt[12:24])    # queries 12..23 read keys from 5 on: block 0 is dead
    table = c.get_block_ids("a")[0]
    assert table[0] == 0 and 0 not in table[1:], "the dead block's entry is the null block (id 0)"
    c.allocate_slots("a", 6, new_token_ids=prompt[24:])       # queries 24..29 read keys from 17 on
    assert c.get_block_ids("a")[0][:4] == [0, 0, 0, 0], "blocks 0-3 (tokens 0-15) are dead"
    for step in range(20):                                      # decoding: at most ceil(7 / 4) + 1 live blocks
        c.allocate_slots("a", 1, new_token_ids=[100 + step])
        c.remove_skipped_blocks("a", c.num_tokens["a"])
        live = [b for b in c.get_block_ids("a")[0] if b != 0]
        assert len(live) <= 3, f"step {step}: {len(live)} blocks held for a window of 8 tokens in blocks of 4"
    assert len(c.get_block_ids("a")[1]) == 13, "the full-attention group keeps all 50 tokens"
    freed_before = c.num_free_blocks
    c.free("a")
    assert c.num_free_blocks == freed_before + 3 + 13 and c.num_free_blocks == c.num_blocks


def test_chunked_local_attention_frees_every_block_before_the_current_chunk():
    c = hybrid(block_size=4, pattern=("chunked_attention", "full_attention"))
    admit(c, "a", list(range(20)))
    c.allocate_slots("a", 1, new_token_ids=[7])     # the next query (position 20) sits in chunk 16..23
    assert c.get_block_ids("a")[0] == [0, 0, 0, 0, c.get_block_ids("a")[0][4], c.get_block_ids("a")[0][5]]


# --- prefix hits ----------------------------------------------------------------------------------------------


def test_hits_are_the_longest_prefix_every_group_serves():
    c = hybrid(window=8, block_size=4)
    prompt = list(range(40))
    admit(c, "a", prompt)
    c.free("a")
    hits, n = c.get_computed_blocks("b", prompt + [1, 2])
    assert n == 40, "every block of the first request is still cached in both groups"
    assert [b.block_id for b in hits[0][:8]] == [0] * 8, "the window group needs only the last two blocks"
    assert all(b.block_id != 0 for b in hits[1]), "full attention needs every block"
    # Evict the window group's last-but-one block: the window group can now serve only a shorter prefix, and
    # the full-attention group is cut to the same length.
    sw_block = c.managers[0].block_pool.get_cached_block(c.managers[0].cache_key(
        c._hashes(prompt, 4)[8]))
    c.block_pool.touch([sw_block])
    c.block_pool._evict(sw_block)
    hits, n = c.get_computed_blocks("b", prompt + [1, 2])
    assert n < 40 and all(len(h) * 4 == n for h in hits), f"hit {n}: every group covers the same prefix"
    assert n == 32, "the window's two consecutive blocks end at block 8 (tokens 24-31)"


def test_a_groups_cached_blocks_never_answer_for_another_group():
    c = hybrid(window=8, block_size=4)
    prompt = list(range(16))
    admit(c, "a", prompt + [99])
    sw, full = c.managers
    key = c._hashes(prompt, 4)[0]
    assert c.block_pool.get_cached_block(sw.cache_key(key)) is not c.block_pool.get_cached_block(full.cache_key(key))


def test_sliding_window_hit_needs_a_windows_worth_of_consecutive_blocks_from_the_right():
    c = hybrid(window=9, block_size=4, layers=1, pattern=("sliding_attention",))
    manager = c.managers[0]
    assert isinstance(manager, SlidingWindowManager)
    prompt = list(range(24))
    admit(c, "a", prompt + [0])
    hashes = c._hashes(prompt, 4)
    # Evict block 3 (tokens 12-15): blocks 4 and 5 remain a run of two = ceil((9 - 1) / 4).
    block = c.block_pool.get_cached_block(manager.cache_key(hashes[3]))
    c.free("a")
    c.block_pool.touch([block])
    c.block_pool._evict(block)
    c.block_pool.free_blocks([block])
    found = manager.find_longest_cache_hit(hashes, 24)
    assert len(found) == 6 and [b.block_id for b in found[:4]] == [0] * 4
    found = manager.find_longest_cache_hit(hashes, 20)
    assert len(found) == 3 and found[0].block_id == 0 and 0 not in [b.block_id for b in found[1:]], \
        "up to block 4 a single block follows the gap, too few: the run of blocks 1-2 ends the hit at 12 tokens"


# --- invariants under a random workload -------------------------------------------------------------------------


def check_invariants(c: HybridKVCacheCoordinator, running: dict) -> None:
    pool = c.block_pool
    refs = {}
    for manager in c.managers:
        for rid, blocks in manager.req_to_blocks.items():
            for block in blocks:
                if block is not c.null_block:
                    refs[block.block_id] = refs.get(block.block_id, 0) + 1
            if isinstance(manager.kv_cache_spec, SlidingWindowSpec):
                dead = manager.kv_cache_spec.num_skipped_tokens(c.num_tokens[rid]) // manager.block_size
                assert all(b is c.null_block for b in blocks[:dead]), \
                    f"request {rid}: a window group holds a block wholly outside its window after the step"
    for block in pool.blocks[1:]:
        assert block.ref_cnt == refs.get(block.block_id, 0), f"block {block.block_id}: ref_cnt vs table references"
    free = set(pool.free_block_queue.block_ids())
    assert free == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}, "the free queue is the unheld blocks"
    assert 0 not in free and c.null_block.ref_cnt == 1, "the null block is never handed out"
    for key, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == key, "the hash map and the blocks agree"
    assert set(running) == set(c.num_tokens)


@pytest.mark.parametrize("seed", range(6))
def test_pool_invariants_hold_under_a_random_workload(seed):
    rng = random.Random(seed)
    c = hybrid(window=rng.choice([4, 7, 12]), block_size=rng.choice([2, 4]), num_blocks=48,
               pattern=rng.choice([("sliding_attention", "full_attention"), ("sliding_attention",) * 3 +
                                   ("full_attention",), ("chunked_attention", "full_attention")]), layers=4)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    running: dict[str, list[int]] = {}     # request -> all its tokens (prompt, then generated)
    targets: dict[str, int] = {}
    hits_seen = 0
    for step in range(150):
        action = rng.random()
        if action < 0.3 and len(running) < 5:
            rid = f"r{step}"
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            hits, n = c.get_computed_blocks(rid, tokens)
            chunk = min(len(tokens) - n, rng.randrange(1, 9))
            if c.num_blocks_to_allocate(rid, chunk, hits) <= c.num_free_blocks:
                c.allocate_slots(rid, chunk, hits, new_token_ids=tokens[n:n + chunk], computed_token_ids=tokens[:n])
                c.remove_skipped_blocks(rid, c.num_tokens[rid])   # the step ran: its tokens are computed
                running[rid], targets[rid] = tokens, len(tokens) + rng.randrange(1, 10)
                hits_seen += n
        elif running:
            rid = rng.choice(sorted(running))
            done = c.num_tokens[rid]
            if action < 0.4:                                  # preempt: free everything, forget it
                c.free(rid)
                del running[rid]
            elif done >= targets[rid]:
                c.free(rid)
                del running[rid]
            else:
                tokens = running[rid]
                n = min(rng.randrange(1, 6), len(tokens) - done) if done < len(tokens) else 1
                if done >= len(tokens):
                    tokens.append(rng.randrange(50))
                if c.num_blocks_to_allocate(rid, n) <= c.num_free_blocks:
                    c.allocate_slots(rid, n, new_token_ids=tokens[done:done + n])
                    c.remove_skipped_blocks(rid, c.num_tokens[rid])
        check_invariants(c, running)
    for rid in list(running):
        c.free(rid)
    check_invariants(c, {})
    assert c.num_free_blocks == c.num_blocks, "every block back at the end"
    assert hits_seen > 0, "set-up: the shared prefixes must produce prefix hits"


def test_bad_calls_raise_and_change_nothing():
    c = hybrid(num_blocks=6)
    prompt = list(range(12))
    with pytest.raises(ValueError, match="computed_blocks has 1 lists for 2 groups"):
        c.allocate_slots("a", 4, [[]], new_token_ids=prompt[:4])
    with pytest.raises(ValueError, match="computed_token_ids must be the hit's 0 tokens"):
        c.allocate_slots("a", 4, None, new_token_ids=prompt[:4], computed_token_ids=[1])
    with pytest.raises(MemoryError, match="needs 6 more blocks but only 5 are free"):
        c.allocate_slots("a", 12, None, new_token_ids=prompt)
    assert c.num_free_blocks == 5 and not c.num_tokens, "a refused call leaves the pool as it was"
    with pytest.raises(KeyError, match="holds no blocks"):
        c.free("a")
    with pytest.raises(ValueError, match="null block"):
        HybridKVCacheCoordinator(group_layers([FullAttentionSpec(4, 1, 8)]), 1)
    with pytest.raises(ValueError, match="no KV-cache manager for MambaSpec"):
        from kvlab.core.kv_cache_interface import KVCacheGroupSpec
        HybridKVCacheCoordinator([KVCacheGroupSpec((0,), MambaSpec(4, 64))], 8)
    assert ChunkedLocalAttentionSpec(4, 1, 8, 2, 8).num_skipped_tokens(17) == 16


def test_a_chunked_admission_counts_the_whole_prompt_and_a_readmission_apart():
    c = hybrid()
    prompt = list(range(40))
    admit(c, "a", prompt)
    c.free("a")
    hits, num_cached = c.get_computed_blocks("b", prompt)
    c.allocate_slots("b", 4, hits, new_token_ids=prompt[num_cached:num_cached + 4],
                     computed_token_ids=prompt[:num_cached], num_query_tokens=len(prompt))
    assert (c.queries, c.hits) == (80, num_cached), "both prompts counted whole, however b's is chunked"
    c.free("b")
    hits, num_cached = c.get_computed_blocks("b", prompt)
    c.allocate_slots("b", len(prompt) - num_cached, hits, new_token_ids=prompt[num_cached:],
                     computed_token_ids=prompt[:num_cached], preempted=True)
    assert (c.queries, c.preempted_queries, c.preempted_hits) == (80, 40, num_cached)
    with pytest.raises(ValueError, match="num_query_tokens"):
        hits, num_cached = c.get_computed_blocks("c", prompt)
        c.allocate_slots("c", 4, hits, new_token_ids=prompt[num_cached:num_cached + 4],
                         computed_token_ids=prompt[:num_cached], num_query_tokens=num_cached + 3)
    assert "c" not in c.num_tokens, "a refused call allocates nothing"


@pytest.mark.parametrize("spec", [FullAttentionSpec(4, 2, 8), SlidingWindowSpec(4, 2, 8, sliding_window=10),
                                  ChunkedLocalAttentionSpec(4, 2, 8, attention_chunk_size=12)])
@pytest.mark.parametrize("budget", [1, 5, 16])
def test_the_most_blocks_a_request_holds_is_max_blocks_per_request(spec, budget):
    """Run requests of every length through the group in chunks of the budget; the peak equals the bound."""
    max_len = 60
    peak = 0
    for offset in range(budget):  # chunk boundaries at every offset, so the worst alignment is met
        c = HybridKVCacheCoordinator(group_layers([spec]), 64)
        tokens = list(range(max_len))
        done = 0
        first = True
        while done < max_len:
            n = min(budget if not first or not offset else offset, max_len - done)
            kwargs = dict(computed_token_ids=[]) if first else {}
            c.allocate_slots("r", n, None, new_token_ids=tokens[done:done + n], **kwargs)
            done += n
            first = False
            peak = max(peak, c.block_pool.num_used_blocks - 1)
            c.remove_skipped_blocks("r", done)
    bound = spec.max_blocks_per_request(max_len, budget)
    assert peak <= bound, f"{type(spec).__name__}: a request held {peak} blocks, above the bound {bound}"
    assert peak >= bound - 1, f"{type(spec).__name__}: the bound {bound} is loose (the peak was {peak})"
