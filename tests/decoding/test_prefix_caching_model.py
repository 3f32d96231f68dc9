"""Chapter 4 on a real model: prefix caching changes how much prefill runs, never what is generated."""

import pytest

from conftest import make_tiny_model
from kvlab.analysis.chat_prompts import build_shared_prefix_trace, load_shared_prefix_trace
from kvlab.baselines.transformers_generate import reference_generate
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.decoding.paged_generate import PagedGenerator
from kvlab.decoding.prefix_generate import PrefixCachingGenerator


def _run(model, prompts, lengths, arrivals, enable_prefix_caching, num_blocks=64, block_size=4):
    gen = PrefixCachingGenerator(model, num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    for p, n, a in zip(prompts, lengths, arrivals):
        gen.add_request(p, n, arrival_step=a)
    return gen, gen.run()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_shared_prefix_outputs_equal_uncached_and_reference(family):
    model = make_tiny_model(family)
    system = [5, 17, 23, 42, 8, 61, 3, 77, 12, 30]  # 10 tokens: 2 full blocks of 4, then 2 more
    prompts = [system + [40, 41, 42], system + [50, 51], system + [60], system[:8], system + [40, 41, 42]]
    lengths = [6, 9, 4, 7, 5]
    arrivals = [0, 0, 3, 5, 9]  # the first two join together: the second hits blocks allocated in that same step
    plain, plain_out = _run(model, prompts, lengths, arrivals, False)
    cached, cached_out = _run(model, prompts, lengths, arrivals, True)
    assert cached_out == plain_out
    for p, n, out in zip(prompts, lengths, cached_out):
        assert out == reference_generate(model, p, n)
    # Hits, in blocks of 4: 2 (10 shared tokens), 2, 1 (system[:8] is 2 full blocks: the last one is
    # recomputed so its last token has logits), then the repeat of prompt 0 (13 tokens) hits
    # (13 - 1) // 4 = 3 blocks: 8 + 8 + 4 + 12 = 32.
    assert cached.kv_cache_manager.prefill_tokens_saved == 32
    assert plain.prefill_tokens_fed - cached.prefill_tokens_fed == 32
    assert plain.prefill_tokens_fed == sum(map(len, prompts))
    assert cached.kv_cache_manager.num_free_blocks == 64 and plain.kv_cache_manager.num_free_blocks == 64


def test_a_tight_pool_evicts_least_recently_used_blocks_and_still_generates_the_same():
    model = make_tiny_model("llama")
    system = list(range(1, 13))
    prompts = [system + [20], [90] * 13, system + [21]]
    arrivals = [0, 10, 20]
    # 5 blocks of 4; each request ends holding 4 (13 prompt tokens + 2 fed back). The first one frees
    # [3, 2, 1, 0] behind the never-used block 4; the second takes 4, 3, 2, 1, evicting the cached
    # blocks 2 and 1, so the third finds only the first system block: 4 tokens saved. Its 3 new blocks
    # then evict 2 more (the second request's cached blocks 3 and 2).
    _, plain_out = _run(model, prompts, [3] * 3, arrivals, False, num_blocks=5)
    cached, cached_out = _run(model, prompts, [3] * 3, arrivals, True, num_blocks=5)
    assert cached_out == plain_out
    assert cached.kv_cache_manager.block_pool.num_evictions == 4
    assert cached.kv_cache_manager.hits == 4


def test_a_step_that_cannot_get_its_blocks_raises_before_touching_the_pool():
    gen = PrefixCachingGenerator(make_tiny_model("llama"), num_blocks=3, block_size=2, enable_prefix_caching=True)
    gen.add_request([1, 2, 3, 4, 5], 4)
    gen.add_request([6, 7], 2)
    with pytest.raises(MemoryError, match="needs up to 4 new blocks but only 3 are free"):
        gen.step()
    assert gen.kv_cache_manager.num_free_blocks == 3 and gen.kv_cache_manager.block_tables == {}


def test_prefix_caching_is_the_chapter_3_loop_on_another_block_manager():
    assert PrefixCachingGenerator.step is PagedGenerator.step, "one decoding loop, whichever manager holds the blocks"
    model = make_tiny_model("llama")
    system = [5, 17, 23, 42, 8, 61, 3, 77, 12, 30]
    prompts, lengths, arrivals = [system + [40], system + [50, 51], [9, 9, 9]], [5, 4, 6], [0, 2, 2]
    paged = PagedGenerator(model, num_blocks=32, block_size=4)
    plugged = PagedGenerator(model, num_blocks=32, block_size=4, block_manager=KVCacheManager(32, 4))
    for gen in (paged, plugged):
        for p, n, a in zip(prompts, lengths, arrivals):
            gen.add_request(p, n, arrival_step=a)
    assert paged.run() == plugged.run() == [reference_generate(model, p, n) for p, n in zip(prompts, lengths)]
    assert paged.prefill_tokens_fed == sum(map(len, prompts)) and paged.num_cached_tokens == {0: 0, 1: 0, 2: 0}, \
        "Chapter 3's BlockManager finds no computed blocks: every prompt token is prefilled"
    assert plugged.num_cached_tokens == {0: 0, 1: 8, 2: 0} \
        and plugged.prefill_tokens_fed == paged.prefill_tokens_fed - 8
    with pytest.raises(ValueError, match="the block manager has 16 blocks of 4"):
        PagedGenerator(model, num_blocks=32, block_size=4, block_manager=KVCacheManager(16, 4))


def test_shipped_trace_is_reproducible():
    assert build_shared_prefix_trace() == load_shared_prefix_trace()


def test_embedded_model_shares_system_prompts_of_the_trace(embedded):
    model, tokenizer = embedded
    trace = load_shared_prefix_trace()
    system = trace["system_prompts"][1]  # 48 characters = 48 tokens = exactly 3 blocks of 16
    requests = [r for r in trace["requests"] if r["system_prompt_id"] == 1][:3]
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in requests]
    assert len(tokenizer(system)["input_ids"]) == 48 and all(p[:48] == prompts[0][:48] for p in prompts)
    lengths, arrivals = [12, 8, 10], [0, 2, 2]
    plain, plain_out = _run(model, prompts, lengths, arrivals, False, num_blocks=48, block_size=16)
    cached, cached_out = _run(model, prompts, lengths, arrivals, True, num_blocks=48, block_size=16)
    assert cached_out == plain_out
    for p, n, out in zip(prompts, lengths, cached_out):
        assert out == reference_generate(model, p, n)
    # The user lines differ within the first 15 characters after "\n", so only the 3 system blocks hit.
    assert cached.kv_cache_manager.prefill_tokens_saved == 2 * 48
    assert plain.prefill_tokens_fed - cached.prefill_tokens_fed == 2 * 48
