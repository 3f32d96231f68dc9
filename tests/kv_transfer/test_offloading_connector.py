"""The offloading connector: a CPU tier behind a GPU pool too small to keep a shared prefix, on the embedded model."""

import pytest
import torch
from offload_helpers import BLOCK_SIZE, greedy, offloading, prompts_fixture, run_one_by_one  # noqa: F401 (a fixture)

from kvlab.baselines.transformers_generate import reference_generate
from kvlab.core.prefix_cache import block_hashes
from kvlab.engine.llm_engine import LLMEngine


def watch_copies(engine) -> list[tuple[int, int]]:
    """Check every load against what was saved under the same block hash; the (cpu, gpu) loads.

    The snapshot is taken from the GPU pools when a block is saved, keyed by the hash the GPU prefix cache gave
    that block, so a load is compared with the stored K/V of the same tokens at the same positions (attention
    over a whole prefix would not notice two of its blocks swapped), not with the host pool the load reads.
    """
    worker = engine.model_runner.kv_connector
    gpu_blocks = engine.kv_cache_manager.block_pool.blocks
    saved: dict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    loads = []
    save, load = worker.wait_for_save, worker.start_load_kv

    def checked_save():
        cache = worker.cache
        for pairs in worker._get_connector_metadata().saves.values():
            for gpu, _ in pairs:
                saved[gpu_blocks[gpu].block_hash] = [(k[gpu].clone(), v[gpu].clone())
                                                     for k, v in zip(cache.k_pools, cache.v_pools)]
        save()

    def checked_load():
        load()
        cache = worker.cache
        for pairs in worker._get_connector_metadata().loads.values():
            for cpu, gpu in pairs:
                for layer, (k, v) in enumerate(saved[gpu_blocks[gpu].block_hash]):
                    assert torch.equal(cache.k_pools[layer][gpu].view(torch.uint8), k.view(torch.uint8)) and \
                        torch.equal(cache.v_pools[layer][gpu].view(torch.uint8), v.view(torch.uint8)), \
                        f"host block {cpu} loaded into GPU block {gpu} differs from what was saved (layer {layer})"
                loads.append((cpu, gpu))

    worker.wait_for_save, worker.start_load_kv = checked_save, checked_load
    return loads


def assert_released(engine):
    manager = engine.kv_cache_manager
    assert manager.num_free_blocks == engine.num_blocks, "every GPU block is back in the pool"
    tier = engine.kv_connector.manager
    assert all(status.ref_cnt == 0 and status.is_ready for _, status in tier.held_blocks()), \
        "no copy in the tier stays pinned by a load or half stored"
    assert not engine.kv_connector._requests, "the connector forgets finished requests"


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_cpu_tier_serves_a_prefix_the_gpu_pool_evicted(embedded, prompts, policy):
    model, tokenizer = embedded
    order = [("a", prompts["a"]), ("c", prompts["c"]), ("b", prompts["b"])]
    knobs = dict(block_size=BLOCK_SIZE, num_blocks=8, max_model_len=64)
    plain = LLMEngine(model, tokenizer, **knobs)
    expected = run_one_by_one(plain, order)
    engine = LLMEngine(model, tokenizer, kv_transfer_config=offloading(64 << 20, policy), **knobs)
    loads = watch_copies(engine)
    got = run_one_by_one(engine, order)
    assert got == expected, "the CPU tier changes no output"
    assert got["b"] == reference_generate(model, prompts["b"], 8), "and equals transformers' generate"
    # c's 50 tokens took every block, so without the tier b recomputes the whole prefix.
    assert plain.kv_cache_manager.hits == 0, "the GPU pool is too small to keep a's prefix for b"
    assert len(loads) == 5, f"b loads the 5 blocks of the shared prefix from the CPU tier, got {loads}"
    assert engine.num_tokens_computed == plain.num_tokens_computed - 5 * BLOCK_SIZE, \
        "the loaded tokens are not computed"
    assert_released(engine)


def test_recompute_preempted_request_resumes_from_the_cpu_tier(embedded, prompts):
    model, tokenizer = embedded
    # a grows to 12 blocks, the whole pool: b is preempted and a takes every block b left behind.
    knobs = dict(block_size=BLOCK_SIZE, num_blocks=12, max_model_len=96, max_num_batched_tokens=128)
    engine = LLMEngine(model, tokenizer, kv_transfer_config=offloading(64 << 20), **knobs)
    loads = watch_copies(engine)
    readmissions = []
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        for rid in out.admitted:
            if engine.requests[rid].num_preemptions:
                readmissions.append((rid, engine.requests[rid].num_computed_tokens,
                                     len(out.kv_connector_metadata.loads.get(rid, ()))))
        return out

    engine.scheduler.schedule = recorded
    first, second = prompts["c"][:40], prompts["b"][:40]
    engine.add_request("a", first, greedy(50))
    engine.add_request("b", second, greedy(20))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    assert engine.requests["b"].num_preemptions >= 1, "b was preempted"
    assert readmissions and readmissions[0][0] == "b" and readmissions[0][2] == 5, \
        f"b resumed with its 5 prompt blocks loaded from the CPU tier, got {readmissions}"
    assert readmissions[0][1] == 5 * BLOCK_SIZE, "its first 40 tokens were not recomputed"
    assert loads, "the loads were checked against what was saved"
    assert outputs["a"] == reference_generate(model, first, 50)
    assert outputs["b"] == reference_generate(model, second, 20)
    assert_released(engine)


def test_a_full_tier_evicts_instead_of_failing(embedded, prompts):
    model, tokenizer = embedded
    knobs = dict(block_size=BLOCK_SIZE, num_blocks=8, max_model_len=64)
    probe = LLMEngine(model, tokenizer, **knobs)
    engine = LLMEngine(model, tokenizer, kv_transfer_config=offloading(6 * probe.block_bytes), **knobs)
    tier = engine.kv_connector.manager
    assert engine.kv_connector.num_cpu_blocks == 6
    order = [("a", prompts["a"]), ("c", prompts["c"]), ("x", prompts["c"][25:] + prompts["a"][:20])]
    got = run_one_by_one(engine, order)
    for rid, prompt in order:
        assert got[rid] == reference_generate(model, prompt, 8), f"{rid}: every output is still right"
    assert engine.kv_connector.num_stored_blocks == 5 + 6 + 5, "each prompt's full blocks were stored"
    assert tier.backend.get_num_free_blocks() == 0, "the tier is full"
    assert tier.lookup(block_hashes(prompts["a"], BLOCK_SIZE)) == 0, "a's blocks, the oldest, were evicted"
    assert tier.lookup(block_hashes(order[2][1], BLOCK_SIZE)) == 5, "the newest prompt's blocks are held"
    assert_released(engine)


def test_a_tier_smaller_than_a_prompt_keeps_its_leading_blocks(embedded, prompts):
    model, tokenizer = embedded
    knobs = dict(block_size=BLOCK_SIZE, num_blocks=8, max_model_len=64)
    probe = LLMEngine(model, tokenizer, **knobs)
    engine = LLMEngine(model, tokenizer, kv_transfer_config=offloading(2 * probe.block_bytes + 1), **knobs)
    assert engine.kv_connector.num_cpu_blocks == 2, "a partial block buys nothing"
    got = run_one_by_one(engine, [("a", prompts["a"])])
    assert got["a"] == reference_generate(model, prompts["a"], 8)
    hashes = block_hashes(prompts["a"], BLOCK_SIZE)
    assert engine.kv_connector.num_stored_blocks == 2 and engine.kv_connector.manager.lookup(hashes) == 2, \
        "of a's 5 full prompt blocks, the 2 leading ones are stored: a later block is useless without them"


def test_an_aborted_request_releases_its_blocks(embedded, prompts):
    model, tokenizer = embedded
    knobs = dict(block_size=BLOCK_SIZE, num_blocks=8, max_model_len=64)
    engine = LLMEngine(model, tokenizer, kv_transfer_config=offloading(64 << 20), **knobs)
    loads = watch_copies(engine)
    run_one_by_one(engine, [("a", prompts["a"]), ("c", prompts["c"])])
    engine.add_request("b", prompts["b"], greedy(8))
    engine.step()  # b is admitted: its prefix is loaded from the tier
    assert len(loads) == 5 and engine.kv_cache_manager.num_free_blocks < engine.num_blocks
    engine.abort_request("b")
    assert_released(engine)
    # Its blocks and the tier serve the next request as before.
    got = run_one_by_one(engine, [("b2", prompts["b"])])
    assert got["b2"] == reference_generate(model, prompts["b"], 8)
    assert_released(engine)


@pytest.mark.parametrize("prompt_only, stored", [(True, 5), (False, 6)])
def test_offload_prompt_only_decides_whether_decode_blocks_are_stored(embedded, prompts, prompt_only, stored):
    model, tokenizer = embedded
    config = offloading(64 << 20)
    config["kv_connector_extra_config"]["offload_prompt_only"] = prompt_only
    engine = LLMEngine(model, tokenizer, block_size=BLOCK_SIZE, num_blocks=8, max_model_len=64,
                       kv_transfer_config=config)
    got = run_one_by_one(engine, [("a", prompts["a"])])
    # 47 prompt tokens hold 5 full blocks; with 8 outputs, 54 tokens are computed (the last one is only sampled).
    assert engine.kv_connector.num_stored_blocks == stored
    assert engine.kv_connector.manager.lookup(block_hashes(prompts["a"] + got["a"], BLOCK_SIZE)) == stored
