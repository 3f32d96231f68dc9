"""Copies that outlast a step: WAITING_FOR_REMOTE_KVS, loads that fail, aborts during a load, delayed frees.

The offloading connector with async_loads copies on its own thread, as vLLM's copies on their own CUDA stream;
a gate on that thread lets a test hold a load open for as many steps as it likes.
"""

import threading
import time

import pytest
import torch
from offload_helpers import BLOCK_SIZE, greedy, prompts_fixture, run_one_by_one  # noqa: F401 (a fixture)

from kvlab import SamplingParams
from kvlab.baselines.transformers_generate import reference_generate
from kvlab.engine.llm_engine import LLMEngine
from kvlab.engine.request import RequestStatus
from kvlab.kv_transfer import offloading_connector

KNOBS = dict(block_size=BLOCK_SIZE, num_blocks=8, max_model_len=64)


def async_offloading(size: int = 64 << 20) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"kv_offloading_size": size, "async_loads": True}}


@pytest.fixture
def gate(monkeypatch):
    """The copy thread waits at this gate before each load (open at first)."""
    opened = threading.Event()
    opened.set()
    copy = offloading_connector.swap_in

    def gated(*args):
        assert opened.wait(30), "the test never opened the gate"
        return copy(*args)

    monkeypatch.setattr(offloading_connector, "swap_in", gated)
    return opened


def evicted_prefix_engine(embedded, prompts, **extra):
    """An engine whose GPU pool lost a's prefix (c filled it) while the CPU tier kept it."""
    model, tokenizer = embedded
    engine = LLMEngine(model, tokenizer, kv_transfer_config=async_offloading(), **KNOBS, **extra)
    run_one_by_one(engine, [("a", prompts["a"]), ("c", prompts["c"])])
    return engine


def step_until_done(engine, timeout_s=60.0) -> dict[str, list[int]]:
    """Step until every request finished and no copy is in flight; the outputs by request id."""
    outputs = {}
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests() or engine.has_pending_kv_transfers():
        assert time.monotonic() < deadline, f"the engine did not finish in {timeout_s} s"
        if not engine.has_schedulable_requests():
            time.sleep(0.001)  # only a copy in flight: let the copy thread run, as the server's loop does
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return outputs


def assert_released(engine):
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks, "every GPU block is back in the pool"
    assert all(status.ref_cnt == 0 for _, status in engine.kv_connector.manager.held_blocks()), \
        "no tier copy stays pinned by a load"
    assert not engine.has_pending_kv_transfers()


def test_an_async_load_waits_holding_uncached_blocks_while_others_run(embedded, prompts, gate):
    model, _ = embedded
    engine = evicted_prefix_engine(embedded, prompts)
    gate.clear()
    engine.add_request("b", prompts["b"], greedy(8))
    engine.add_request("d", prompts["c"][:20], greedy(4))
    for _ in range(3):
        engine.step()
    b = engine.requests["b"]
    assert b.status is RequestStatus.WAITING_FOR_REMOTE_KVS, f"b waits for its load, got {b.status}"
    held = engine.kv_cache_manager.req_to_blocks["b"]
    assert len(held) == 5, f"b holds the 5 blocks its load writes, got {len(held)}"
    assert all(block.block_hash is None for block in held), \
        "blocks a load is still filling are not in the prefix cache: no other request may hit them yet"
    assert engine.requests["d"].output_token_ids, "another request runs while b's load is in flight"
    assert b.num_computed_tokens == 0 and not b.output_token_ids, "b computes nothing until its load ends"
    gate.set()
    outputs = step_until_done(engine)
    assert outputs["b"] == reference_generate(model, prompts["b"], 8), "the loaded prefix gives generate's tokens"
    assert engine.kv_connector.num_loaded_blocks == 5
    assert_released(engine)


def test_async_loads_are_bit_identical_and_save_the_computation(embedded, prompts):
    model, tokenizer = embedded
    plain = LLMEngine(model, tokenizer, **KNOBS)
    expected = run_one_by_one(plain, [("a", prompts["a"]), ("c", prompts["c"]), ("b", prompts["b"])])
    engine = evicted_prefix_engine(embedded, prompts)
    worker = engine.model_runner.kv_connector
    host = worker.host_pool
    pending, checked = {}, []
    start, finished = worker.start_load_kv, worker.get_finished

    def recording_start():
        pending.update(worker._get_connector_metadata().loads)
        start()

    def checking_finished(ids):
        sending, recving = finished(ids)
        for rid in recving or ():
            for cpu, gpu in pending.pop(rid):
                for layer, (k, v) in enumerate(zip(worker.cache.k_pools, worker.cache.v_pools)):
                    assert torch.equal(k[gpu].view(torch.uint8), host[cpu, layer, 0].view(torch.uint8)) and \
                        torch.equal(v[gpu].view(torch.uint8), host[cpu, layer, 1].view(torch.uint8)), \
                        f"GPU block {gpu} differs from host block {cpu} it was loaded from (layer {layer})"
                checked.append(gpu)
        return sending, recving

    worker.start_load_kv, worker.get_finished = recording_start, checking_finished
    engine.add_request("b", prompts["b"], greedy(8))
    computed_before = engine.num_tokens_computed
    got = step_until_done(engine)
    assert got["b"] == expected["b"]
    assert len(checked) == 5, f"the 5 loaded blocks were compared byte for byte, got {checked}"
    assert engine.num_tokens_computed - computed_before == len(prompts["b"]) - 5 * BLOCK_SIZE + 7, \
        "the loaded 40 tokens are not computed (the rest of the prompt and 7 decodes are)"
    assert_released(engine)


def test_a_request_aborted_during_its_load_frees_its_blocks_once_the_load_ends(embedded, prompts, gate):
    engine = evicted_prefix_engine(embedded, prompts)
    gate.clear()
    engine.add_request("b", prompts["b"], greedy(8))
    engine.step()
    assert engine.requests["b"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.abort_request("b")
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks - 5, \
        "the copy thread still writes into b's blocks, so they are not handed to anyone else yet"
    assert engine.has_pending_kv_transfers() and not engine.has_unfinished_requests()
    gate.set()
    step_until_done(engine)
    assert_released(engine)


def test_a_failed_load_is_recomputed(embedded, prompts):
    model, _ = embedded
    engine = evicted_prefix_engine(embedded, prompts)
    worker = engine.model_runner.kv_connector
    failed = []

    def first_block_fails():  # as a transport that lost a block would report it
        if failed or not engine.scheduler.waiting_for_remote_kvs:
            return set()
        failed.append(engine.kv_cache_manager.get_block_ids("b")[0])
        return {failed[0]}

    worker.get_block_ids_with_load_errors = first_block_fails
    engine.add_request("b", prompts["b"], greedy(8))
    computed_before = engine.num_tokens_computed
    outputs = step_until_done(engine)
    assert failed and engine.scheduler.num_failed_loads == 1, "one load failed"
    assert outputs["b"] == reference_generate(model, prompts["b"], 8), "the recompute gives generate's tokens"
    assert engine.num_tokens_computed - computed_before == len(prompts["b"]) + 7, \
        "the failed load's tokens are computed instead, from its first block on"
    assert_released(engine)


PULLED: set[str] = set()  # requests the (simulated) peer has read, reported once by the worker


def held_for_peer(engine):
    """Make the engine's connector keep every finished request's blocks until a peer has read them, as a prefill
    server's connector does; the peer's read is the test adding the request id to PULLED."""
    scheduler_half, worker = engine.kv_connector, engine.model_runner.kv_connector
    finished, get_finished = scheduler_half.request_finished, worker.get_finished

    def request_finished(request, block_ids):
        finished(request, block_ids)
        return True, {"remote_block_ids": list(block_ids)}

    def reporting(ids):
        _, recving = get_finished(ids)
        sending = set(PULLED)
        PULLED.clear()
        return sending or None, recving

    scheduler_half.request_finished, worker.get_finished = request_finished, reporting


def test_delayed_free_keeps_blocks_until_the_save_is_reported(embedded, prompts):
    model, tokenizer = embedded
    engine = LLMEngine(model, tokenizer, kv_transfer_config=async_offloading(), **KNOBS)
    held_for_peer(engine)
    engine.add_request("a", prompts["a"], greedy(1))
    params = None
    for out in engine.step():
        params = out.kv_transfer_params
    assert engine.requests["a"].status.finished
    table = params["remote_block_ids"]
    assert len(table) == len(prompts["a"]) // BLOCK_SIZE + 1, f"the params name a's blocks, got {params}"
    for _ in range(3):
        engine.step()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks - len(table), \
        "a's blocks stay held while the peer has not read them"
    PULLED.add("a")
    engine.step()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks, "and go back once it has"
    assert not engine.has_pending_kv_transfers()


def test_a_request_ended_by_a_stop_string_still_hands_its_params_on(embedded, prompts):
    model, tokenizer = embedded
    engine = LLMEngine(model, tokenizer, kv_transfer_config=async_offloading(), **KNOBS)
    run_one_by_one(engine, [("probe", prompts["a"])])
    text = engine.output("probe").outputs[0].text
    held_for_peer(engine)
    stop = text[2:5]
    assert stop.strip(), f"the probe's text {text!r} has a stop string to cut at"
    engine.add_request("a", prompts["a"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop]))
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
    assert last.finished and last.outputs[0].finish_reason == "stop", "the stop string ended the request"
    assert last.kv_transfer_params and last.kv_transfer_params["remote_block_ids"], \
        "its connector's params reach the last output, as with a request that ran to its length"
    assert engine.output("a").kv_transfer_params == last.kv_transfer_params
    PULLED.add("a")
    engine.step()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
