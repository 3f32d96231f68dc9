"""The router's index over replicas' prefix caches, fed by real engines' KV-cache events."""

import pytest

from kvlab import SamplingParams
from kvlab.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvlab.core.prefix_cache import block_hashes, hash_block_tokens
from kvlab.engine.llm_engine import LLMEngine
from kvlab.router import KVBlockIndex, choose_by_cost, kv_cost

B = 4


def stored(tokens, parent=None, hashes=None):
    return BlockStored(hashes or block_hashes(tokens, B), parent, list(tokens), B)


def test_the_longest_consecutive_hit_counts_only_from_the_first_block():
    prompt = list(range(16))
    hashes = block_hashes(prompt, B)
    index = KVBlockIndex(B)
    index.apply("r0", KVEventBatch(0.0, [stored(prompt)]))
    index.apply("r1", KVEventBatch(0.0, [stored(prompt[:8]), BlockStored([hashes[3]], hashes[2], prompt[12:], B)]))
    assert index.prompt_hits(prompt + [99]) == {"r0": 4, "r1": 2}, \
        "r1 holds blocks 0, 1 and 3: without block 2, block 3 is useless"
    index.apply("r0", KVEventBatch(1.0, [BlockRemoved([hashes[1]])]))
    assert index.prompt_hits(prompt) == {"r0": 1, "r1": 2}, "an evicted block cuts the run where it was"
    index.apply("r1", KVEventBatch(2.0, [AllBlocksCleared()]))
    assert index.prompt_hits(prompt)["r1"] == 0


def test_a_gap_in_sequence_numbers_drops_the_replica_until_it_is_resynced():
    prompt = list(range(8))
    index = KVBlockIndex(B)
    index.apply("r0", KVEventBatch(0.0, [stored(prompt)]), seq=0)
    index.apply("r0", KVEventBatch(0.0, [stored(prompt)]), seq=0)  # a replayed batch is applied once
    index.apply("r0", KVEventBatch(1.0, []), seq=2)
    assert "r0" in index.needs_resync and index.prompt_hits(prompt) == {}, \
        "batch 1 was missed: r0's entries may name evicted blocks, so they are not trusted"


def test_a_replica_with_another_hash_seed_is_detected_not_mis_routed():
    prompt = list(range(8))
    index = KVBlockIndex(B)
    seeded = [hash_block_tokens(b"another seed", prompt[:4])]
    seeded.append(hash_block_tokens(seeded[0], prompt[4:]))
    index.apply("odd", KVEventBatch(0.0, [stored(prompt, hashes=seeded)]))
    index.apply("ok", KVEventBatch(0.0, [stored(prompt)]))
    assert index.seed_mismatch == {"odd"}
    assert index.prompt_hits(prompt) == {"ok": 2}


def test_cost_trades_prefix_affinity_against_load():
    hits, active = {"hot": 10, "idle": 0}, {"hot": 30, "idle": 2}
    assert kv_cost(12, 10, 30) == 32 and kv_cost(12, 0, 2) == 14
    assert choose_by_cost(12, hits, active) == "idle", "a hot replica's queue can outweigh its hit"
    assert choose_by_cost(12, hits, active, overlap_score_weight=5.0) == "hot", "a heavier weight favours the hit"
    with pytest.raises(ValueError, match="hit_blocks"):
        kv_cost(4, 5, 0)


def test_two_engines_events_give_the_index_their_caches(embedded):
    model, tokenizer = embedded
    index = KVBlockIndex(8)
    system = tokenizer("SYSTEM. You are a careful reader of Shakespeare; answer in verse.")["input_ids"][:32]
    engines = {}
    for name, prompt in (("r0", system + [5, 6, 7]), ("r1", list(reversed(system)) + [5])):
        engine = LLMEngine(model, tokenizer, block_size=8, num_blocks=16,
                           kv_events_config={"enable_kv_cache_events": True, "publisher": "null"})
        batches = []
        engine.kv_event_publisher.publish = batches.append  # what a ZMQ subscriber would receive, in order
        engine.add_request("q", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        assert batches, f"{name} published its cached blocks"
        for seq, batch in enumerate(batches):
            index.apply(name, batch, seq=seq)
        engines[name] = engine
    hits = index.prompt_hits(system + [9, 9])
    assert hits == {"r0": 4, "r1": 0}, f"only r0 cached the system prompt's 4 blocks, got {hits}"
    assert not index.seed_mismatch, "both engines hash as the router does"
