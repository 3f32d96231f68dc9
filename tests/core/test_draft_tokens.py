"""Speculative decoding's slots: drafts get slots but no hash, rollback returns what lies past the sequence."""

import random

import pytest

from kvlab.core.draft_tokens import plan_rollback
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.paging import num_blocks_needed


def test_plan_rollback_examples():
    plan = plan_rollback(20, 4, 1, num_blocks_held=6, block_size=4)
    assert (plan.num_computed_tokens, plan.num_blocks_to_keep, plan.num_rejected_tokens) == (17, 5, 3)
    all_kept = plan_rollback(20, 4, 4, 5, 4)
    assert (all_kept.num_computed_tokens, all_kept.num_blocks_to_keep) == (20, 5), "nothing rejected, nothing freed"
    lookahead = plan_rollback(20, 4, 0, 7, 4, num_lookahead_tokens=6)
    assert (lookahead.num_computed_tokens, lookahead.num_blocks_to_keep) == (16, 6), \
        "16 tokens + 6 lookahead slots need 6 blocks of 4; the seventh goes back"
    assert plan_rollback(8, 0, 0, 3, 4).num_blocks_to_keep == 2, "no drafts: only blocks past the end go back"


@pytest.mark.parametrize("args, message", [
    ((5, 6, 0, 4, 4), "draft tokens among only"),
    ((10, 3, 4, 4, 4), "accepted tokens out of only"),
    ((10, 3, 1, 2, 4), "the request holds 2"),
    ((10, 3, -1, 4, 4), "num_accepted_tokens"),
    ((10, 3, 1, 4, 0), "block_size"),
])
def test_plan_rollback_rejects_inconsistent_input(args, message):
    with pytest.raises(ValueError, match=message):
        plan_rollback(*args)


def test_drafts_are_not_hashed_until_accepted():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6]
    kv.allocate_slots("r", 6, new_token_ids=prompt)
    # The last sampled token (7) plus drafts 8, 9, 10 fill block 1 only with drafts' help.
    kv.allocate_slots("r", 4, new_token_ids=[7, 8, 9, 10], num_draft_tokens=3)
    assert kv.num_draft_tokens("r") == 3
    third = kv.block_tables["r"][2]  # position 8 (draft 10) spilled into a third block
    assert kv.block_pool.blocks[kv.block_tables["r"][1]].block_hash is None, "a block of unverified drafts is cached"
    freed = kv.rollback_draft_tokens("r", num_accepted_tokens=1)  # 8 accepted, 9 and 10 rejected
    assert kv.num_tokens["r"] == 8 and freed == [third], "the block that held only a rejected draft goes back"
    assert kv.block_pool.blocks[kv.block_tables["r"][1]].block_hash is not None, \
        "block 1 now holds 5, 6, 7, 8, all verified: it is cached"
    # Another request with the same 8 tokens finds both blocks (its last token is still recomputed).
    hits, num_cached = kv.get_computed_blocks("s", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert num_cached == 8


def test_rejected_drafts_never_enter_the_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("r", 3, new_token_ids=[1, 2, 3])
    kv.allocate_slots("r", 5, new_token_ids=[4, 5, 6, 7, 8], num_draft_tokens=4)
    kv.rollback_draft_tokens("r", 0)  # all four rejected
    assert kv.num_tokens["r"] == 4
    hits, num_cached = kv.get_computed_blocks("s", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert num_cached == 4, "only [1, 2, 3, 4] was verified; the rejected block 2 [5, 6, 7, 8] must not be a hit"


def test_lookahead_slots_are_held_and_given_back():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    kv.allocate_slots("r", 5)
    assert kv.num_blocks_to_allocate("r", 4, num_lookahead_tokens=4) == 2, "5 + 4 + 4 = 13 tokens: 4 blocks"
    kv.allocate_slots("r", 4, num_draft_tokens=3, new_token_ids=[0, 1, 2, 3], num_lookahead_tokens=4)
    assert len(kv.block_tables["r"]) == 4
    freed = kv.rollback_draft_tokens("r", 0, num_lookahead_tokens=4)
    assert kv.num_tokens["r"] == 6 and len(freed) == 1, "6 tokens + 4 lookahead = 3 blocks kept, the fourth freed"
    assert kv.num_free_blocks == 7
    assert kv.num_blocks_to_allocate("r", 1, num_lookahead_tokens=4) == 0, "held lookahead blocks are not re-counted"


def test_draft_calls_check_before_changing_anything():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.allocate_slots("r", 4, new_token_ids=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="num_draft_tokens"):
        kv.allocate_slots("r", 2, new_token_ids=[5, 6], num_draft_tokens=3)
    with pytest.raises(MemoryError):
        kv.allocate_slots("r", 2, new_token_ids=[5, 6], num_draft_tokens=1, num_lookahead_tokens=20)
    assert kv.num_tokens["r"] == 4 and kv.num_draft_tokens("r") == 0 and kv.num_free_blocks == 2
    kv.allocate_slots("r", 2, new_token_ids=[5, 6], num_draft_tokens=1)
    with pytest.raises(ValueError, match="unverified draft"):
        kv.allocate_slots("r", 1, new_token_ids=[7])
    with pytest.raises(ValueError, match="accepted tokens out of only"):
        kv.rollback_draft_tokens("r", 2)
    assert kv.num_draft_tokens("r") == 1, "a refused rollback changes nothing"
    with pytest.raises(KeyError):
        kv.rollback_draft_tokens("nobody", 0)


@pytest.mark.parametrize("seed", range(20))
def test_fuzz_speculative_traces_leak_nothing(seed):
    """Random requests speculate with random acceptance on a tiny pool: blocks are never leaked or freed twice."""
    rng = random.Random(seed)
    size = rng.choice([1, 2, 4])
    kv = KVCacheManager(rng.randint(6, 14), size, enable_prefix_caching=rng.random() < 0.7)
    lookahead = rng.choice([0, 0, 2, 3])
    live: dict[str, list[int]] = {}
    vocab = 3  # a small vocabulary makes shared prefixes, so the prefix cache is exercised
    for step in range(300):
        if len(live) < 3 and rng.random() < 0.3:
            rid = f"r{step}"
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
            hits, cached = kv.get_computed_blocks(rid, prompt)
            n = len(prompt) - cached
            if kv.num_blocks_to_allocate(rid, n, hits, lookahead) <= kv.num_free_blocks:
                kv.allocate_slots(rid, n, hits, new_token_ids=prompt[cached:], num_lookahead_tokens=lookahead)
                live[rid] = prompt + [rng.randrange(vocab)]  # the first sampled token, not computed yet
        for rid in list(live):
            tokens = live[rid]
            drafts = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
            n = 1 + len(drafts)
            if kv.num_blocks_to_allocate(rid, n, num_lookahead_tokens=lookahead) > kv.num_free_blocks \
                    or rng.random() < 0.05:
                kv.free(rid)  # preempted or finished
                del live[rid]
                continue
            kv.allocate_slots(rid, n, new_token_ids=[tokens[-1]] + drafts, num_draft_tokens=len(drafts),
                              num_lookahead_tokens=lookahead)
            accepted = rng.randint(0, len(drafts))
            kv.rollback_draft_tokens(rid, accepted, lookahead)
            tokens += drafts[:accepted] + [rng.randrange(vocab)]
            assert kv.num_tokens[rid] == len(tokens) - 1, "computed = every token but the one just sampled"
            held = len(kv.block_tables[rid])
            assert num_blocks_needed(kv.num_tokens[rid], size) <= held <= \
                num_blocks_needed(kv.num_tokens[rid] + lookahead, size), "blocks past tokens + lookahead must go back"
        refs = {}
        for table in kv.block_tables.values():
            for b in table:
                refs[b] = refs.get(b, 0) + 1
        for block in kv.block_pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), f"block {block.block_id}: ref count != holders"
        assert kv.num_free_blocks == kv.num_blocks - len(refs)
    for rid in list(live):
        kv.free(rid)
    assert kv.num_free_blocks == kv.num_blocks
