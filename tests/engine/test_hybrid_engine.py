"""kvlab's engine (LLM, the scheduler, the runner) on models with sliding-window layers: the hybrid KV cache manager.

A tiny random Mistral (every layer windowed) and Qwen2 (layers 2-3 windowed) must write what transformers'
generate writes, token for token, for prompts and generations longer than the window, with chunked prefill,
prefix caching and preemption on. After every step no windowed group may hold a block wholly outside its
window, and the pool's reference counts, free queue and hashes must agree with the tables. The same bytes must
hold more blocks than with disable_hybrid_kv_cache_manager, and the knobs the hybrid manager does not serve are
refused by name before anything is built.
"""

import random

import pytest
import torch

from conftest import make_tiny_hybrid_model
from kvlab import LLM, SamplingParams
from kvlab.cache.hybrid_cache import HybridPagedCache
from kvlab.core.hybrid_kv_cache_manager import HybridKVCacheManager
from kvlab.core.kv_cache_interface import SlidingWindowSpec
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.engine.input_processor import RequestRejected

WINDOW, BLOCK = 12, 4
NEW_TOKENS = 40  # past the window: the windowed layers must forget the prompt's start


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def model(request):
    return make_tiny_hybrid_model(request.param, WINDOW)


def prompts(seed: int = 0) -> list[list[int]]:
    """Six prompts of 17-60 tokens, the first four sharing a 24-token prefix (six blocks)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 97) for _ in range(24)]
    out = [shared + [rng.randrange(3, 97) for _ in range(rng.randrange(1, 36))] for _ in range(4)]
    return out + [[rng.randrange(3, 97) for _ in range(rng.randrange(17, 40))] for _ in range(2)]


def reference(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def tight_pool(model) -> int:
    # Windowed groups hold a few blocks per request; Qwen2's full layers hold every token's.
    return 16 if model.config.model_type == "mistral" else 40


def poison_null_block(cache: HybridPagedCache) -> None:
    """A large value in block 0 of every pool: a query that attends to the null block (where a window gave a block
    back) has its output spoiled. Finite, because the torch backend pads its batched decodes with slot 0 and masks
    them, as vLLM pads with the null block; the Triton kernel never loads it at all (tests/kernels)."""
    for pool in (*cache.k_pools, *cache.v_pools):
        pool[0] = 1e3


def check_pool(manager: HybridKVCacheManager, computed: dict) -> None:
    """Reference counts, free queue, hashes and windows, after a step."""
    c = manager.coordinator
    refs: dict[int, int] = {}
    for m in c.managers:
        for rid, table in m.req_to_blocks.items():
            for block in table:
                if block is not c.null_block:
                    refs[block.block_id] = refs.get(block.block_id, 0) + 1
            if isinstance(m.kv_cache_spec, SlidingWindowSpec):
                dead = m.kv_cache_spec.num_skipped_tokens(computed[rid]) // m.block_size
                assert all(b is c.null_block for b in table[:dead]), \
                    f"request {rid}: group {m.group_id} still holds a block wholly outside its window of " \
                    f"{m.kv_cache_spec.sliding_window} after {computed[rid]} tokens were computed"
    pool = c.block_pool
    for block in pool.blocks[1:]:
        assert block.ref_cnt == refs.get(block.block_id, 0), \
            f"block {block.block_id}: ref_cnt {block.ref_cnt} but {refs.get(block.block_id, 0)} table references"
    free = set(pool.free_block_queue.block_ids())
    assert free == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}, "the free queue is the unheld blocks"
    assert 0 not in free and c.null_block.ref_cnt == 1, "the null block is never lent"
    for key, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == key, "the hash map and the blocks agree"
        assert key[1] < len(c.managers), "a cache key names its group"


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_greedy_outputs_equal_transformers_generate_with_chunks_hits_and_preemption(model, backend):
    llm = LLM(model, block_size=BLOCK, num_blocks=tight_pool(model), max_num_batched_tokens=20, max_num_seqs=4,
              attention_backend=backend)
    engine = llm.llm_engine
    assert isinstance(engine.kv_cache_manager, HybridKVCacheManager), "a windowed model gets the hybrid manager"
    assert isinstance(engine.cache, HybridPagedCache)
    poison_null_block(engine.cache)
    outs = llm.generate(prompts(), greedy())
    for i, (prompt, out) in enumerate(zip(prompts(), outs)):
        assert list(out.outputs[0].token_ids) == reference(model, prompt, NEW_TOKENS), \
            f"prompt {i} ({len(prompt)} tokens, window {WINDOW}): kvlab's engine differs from transformers"
    kv = engine.kv_cache_manager
    assert kv.hits > 0, "set-up: the shared prefix must hit the prefix cache in every group"
    assert engine.scheduler.num_preemptions > 0, "set-up: the tight pool must force preemptions"
    assert kv.num_free_blocks == kv.num_blocks, "every block back in the pool at the end"


def test_after_every_step_windows_hold_only_what_they_reach_and_the_pool_is_consistent(model):
    llm = LLM(model, block_size=BLOCK, num_blocks=tight_pool(model), max_num_batched_tokens=16, max_num_seqs=4)
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts(1)):
        engine.add_request(f"r{i}", prompt, greedy(30))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        computed = {rid: r.num_computed_tokens for rid, r in engine.requests.items()}
        check_pool(engine.kv_cache_manager, computed)
    assert engine.scheduler.num_preemptions > 0 and steps > 20


def test_the_runner_sends_one_table_per_group(model):
    llm = LLM(model, block_size=BLOCK, num_blocks=64)
    engine = llm.llm_engine
    engine.add_request("a", prompts()[0], greedy(20))
    for _ in range(6):
        engine.step()
    tables = engine.kv_cache_manager.get_block_ids("a")
    groups = engine.kv_cache_groups
    assert isinstance(tables, tuple) and len(tables) == len(groups)
    runner_tables = engine.model_runner.requests["a"].block_ids
    for g, (mine, theirs) in enumerate(zip(tables, runner_tables)):
        assert len(mine) == len(theirs), f"group {g}: the runner's table has as many entries as the manager's"
        # The runner may still name a block its window gave back; the attention never reads it (the window).
        live = [i for i, b in enumerate(mine) if b != 0]
        assert [theirs[i] for i in live] == [mine[i] for i in live], f"group {g}: the live entries agree"
    windowed = [g for g, group in enumerate(groups) if isinstance(group.kv_cache_spec, SlidingWindowSpec)]
    assert any(0 in tables[g] for g in windowed), "a windowed group gave blocks back (null entries)"


def test_disabling_the_hybrid_manager_writes_the_same_tokens_and_the_same_bytes_hold_fewer_blocks(model):
    budget = 256 * 1024
    hybrid = LLM(model, block_size=BLOCK, kv_cache_memory=budget)
    full = LLM(model, block_size=BLOCK, kv_cache_memory=budget, disable_hybrid_kv_cache_manager=True)
    assert isinstance(full.llm_engine.kv_cache_manager, KVCacheManager)
    groups = hybrid.llm_engine.kv_cache_groups
    layers = sum(len(g.layer_ids) for g in groups)
    largest = max(len(g.layer_ids) for g in groups)
    # A block id spans one layer per group position: the same bytes hold layers / largest group as many.
    assert hybrid.llm_engine.num_blocks == full.llm_engine.num_blocks * layers // largest
    assert hybrid.llm_engine.cache.nbytes <= budget and full.llm_engine.cache.nbytes <= budget
    params = greedy(24)
    a = [list(o.outputs[0].token_ids) for o in hybrid.generate(prompts()[:3], params)]
    b = [list(o.outputs[0].token_ids) for o in full.generate(prompts()[:3], params)]
    assert a == b, "where the blocks live changes no token"


def test_a_request_that_can_never_fit_its_groups_is_refused_before_anything_is_allocated(model):
    llm = LLM(model, block_size=BLOCK, num_blocks=12, max_num_batched_tokens=16)
    engine = llm.llm_engine
    long = [3 + i % 90 for i in range(200)]
    if model.config.model_type == "mistral":
        # Every layer windowed: a request holds at most the window plus one step's tokens, however long it is.
        engine.add_request("long", long, greedy(8))
        while engine.has_unfinished_requests():
            engine.step()
        assert len(engine.requests["long"].output_token_ids) == 8
    else:
        with pytest.raises(RequestRejected, match="KV-cache groups"):
            engine.add_request("long", long, greedy(8))
        assert not engine.has_unfinished_requests()
        assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


@pytest.mark.parametrize("knobs, named", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative_config"),
    ({"preemption_mode": "swap"}, "preemption_mode"),
    ({"reservation_policy": "max"}, "reservation_policy"),
])
def test_knobs_the_hybrid_manager_does_not_serve_are_refused_by_name(model, knobs, named):
    with pytest.raises(ValueError, match=named):
        LLM(model, block_size=BLOCK, num_blocks=32, **knobs)
    # With the hybrid manager disabled every layer keeps its blocks, and the knob works (the window is masked).
    LLM(model, block_size=BLOCK, num_blocks=32, disable_hybrid_kv_cache_manager=True, **knobs)


def test_the_embedded_model_keeps_chapter_4s_manager(embedded):
    model, tokenizer = embedded
    llm = LLM(model, tokenizer, num_blocks=16)
    assert isinstance(llm.llm_engine.kv_cache_manager, KVCacheManager) and llm.llm_engine.kv_cache_groups is None


def test_the_block_map_snapshot_shows_groups_and_the_null_block(model):
    llm = LLM(model, block_size=BLOCK, num_blocks=48)
    engine = llm.llm_engine
    engine.add_request("a", prompts()[0], greedy(20))
    for _ in range(8):
        engine.step()
    snap = engine.snapshot()
    assert snap["blocks"][0].get("null"), "block 0 is the null block"
    held = [b for b in snap["blocks"] if b["owner"] == "a"]
    assert held and all("group" in b for b in held), "every held block says which group holds it"
    seq = next(s for s in snap["sequences"] if s["id"] == "a")
    assert len(seq["group_tables"]) == len(engine.kv_cache_groups)
