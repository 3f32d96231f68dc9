"""SocketConnector between two engines in one process, over real loopback sockets: a prefill engine (kv_producer)
keeps a finished request's blocks, a decode engine (kv_consumer) pulls them by block id and decodes from there."""

import socket
import time

import pytest
import torch
from offload_helpers import BLOCK_SIZE, greedy, prompts_fixture  # noqa: F401 (a fixture)

from kvlab import SamplingParams
from kvlab.baselines.transformers_generate import reference_generate
from kvlab.engine.llm_engine import LLMEngine
from kvlab.kv_transfer import KVTransferConfig, socket_connector
from kvlab.kv_transfer.socket_connector import SocketConnector, pull_blocks

KNOBS = dict(block_size=BLOCK_SIZE, num_blocks=24, max_model_len=96)


def producer_config(**extra) -> dict:
    return {"kv_connector": "SocketConnector", "kv_role": "kv_producer", "kv_connector_extra_config": extra}


def consumer_config(**extra) -> dict:
    return {"kv_connector": "SocketConnector", "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"kv_pull_timeout_s": 5, **extra}}


def with_params(n: int, params: dict) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, extra_args={"kv_transfer_params": params})


@pytest.fixture
def pair(embedded):
    """(prefill engine, decode engine), shut down after the test."""
    model, tokenizer = embedded
    prefill = LLMEngine(model, tokenizer, kv_transfer_config=producer_config(kv_send_timeout_s=30), **KNOBS)
    decode = LLMEngine(model, tokenizer, kv_transfer_config=consumer_config(), **KNOBS)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def prefill_once(engine, rid, prompt) -> dict:
    """Run the prompt with max_tokens=1 and do_remote_decode, as the proxy asks: the params for the decode side."""
    engine.add_request(rid, prompt, with_params(1, {"do_remote_decode": True}))
    params = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                params = out.kv_transfer_params
    return params


def run_both(decode, prefill=None, timeout_s=30.0) -> dict[str, list[int]]:
    """Step both engines until neither has work or a copy in flight; the decode side's outputs by request id."""
    outputs = {}
    engines = [e for e in (decode, prefill) if e is not None]
    deadline = time.monotonic() + timeout_s
    while any(e.has_unfinished_requests() or e.has_pending_kv_transfers() for e in engines):
        assert time.monotonic() < deadline, f"the engines did not finish in {timeout_s} s"
        if prefill is not None:
            prefill.step()
        for out in decode.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        if not decode.has_schedulable_requests():
            time.sleep(0.002)  # only copies in flight: let the threads run
    return outputs


def assert_all_free(*engines):
    for engine in engines:
        assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks, "every block is back in the pool"
        assert not engine.has_pending_kv_transfers()


def test_the_decode_engine_pulls_bit_identical_blocks_and_computes_only_the_last_prompt_token(
        pair, embedded, prompts, monkeypatch):
    model, _ = embedded
    prefill, decode = pair
    prompt = prompts["b"]
    pulled = []
    scatter = socket_connector.scatter_blocks

    def recording(cache, block_ids, data):
        pulled.append((list(block_ids), data.clone()))
        scatter(cache, block_ids, data)

    monkeypatch.setattr(socket_connector, "scatter_blocks", recording)
    params = prefill_once(prefill, "r", prompt)
    assert params["do_remote_prefill"] is True and params["remote_request_id"] == "r"
    assert params["remote_port"] == prefill.model_runner.kv_connector.kv_port > 0, "the bound port, not 0"
    remote_ids = params["remote_block_ids"]
    assert len(remote_ids) == -(-len(prompt) // BLOCK_SIZE), f"the prompt's blocks, got {remote_ids}"
    held = prefill.num_blocks - prefill.kv_cache_manager.num_free_blocks
    assert held == len(remote_ids), "the prefill engine holds the blocks until they are pulled"
    prefill.step()  # the worker hears of r at the next step (an idle one here), as a server's polling loop runs it
    producer_pools = prefill.model_runner.cache
    decode.add_request("r", prompt, with_params(8, params))
    computed_before = decode.num_tokens_computed
    outputs = {}
    deadline = time.monotonic() + 30
    while not pulled:  # the decode engine asks; the producer has not stepped since, so its blocks are untouched
        assert time.monotonic() < deadline, "the decode engine never pulled"
        for out in decode.step():
            outputs[out.request_id] = out
        time.sleep(0.002)
    local_ids, data = pulled[0]
    need = -(-(len(prompt) - 1) // BLOCK_SIZE)
    assert len(local_ids) == need, f"every block up to the prompt's last-but-one token, got {len(local_ids)}"
    for layer, (k, v) in enumerate(zip(producer_pools.k_pools, producer_pools.v_pools)):
        assert torch.equal(data[layer, 0].view(torch.uint8), k[remote_ids[:need]].view(torch.uint8)) and \
            torch.equal(data[layer, 1].view(torch.uint8), v[remote_ids[:need]].view(torch.uint8)), \
            f"layer {layer}: the pulled bytes differ from the producer's blocks"
    outputs = run_both(decode, prefill)
    assert outputs["r"] == reference_generate(model, prompt, 8), "decoding from pulled blocks gives generate's tokens"
    assert decode.num_tokens_computed - computed_before == 1 + 7, \
        "the decode engine computes the last prompt token and the 7 decodes, nothing of the pulled prefix"
    assert decode.kv_connector.num_pulled_blocks == need
    assert prefill.model_runner.kv_connector.bytes_sent == need * prefill.block_bytes, \
        "a block moves as its bytes in the pool, every layer's K and V"
    assert_all_free(prefill, decode)


def test_a_prefix_cached_on_the_decode_engine_is_not_pulled_again(pair, embedded, prompts):
    model, _ = embedded
    prefill, decode = pair
    params = prefill_once(prefill, "a", prompts["a"])
    decode.add_request("a", prompts["a"], with_params(4, params))
    run_both(decode, prefill)
    params = prefill_once(prefill, "b", prompts["b"])
    decode.add_request("b", prompts["b"], with_params(4, params))
    pulled_before = decode.kv_connector.num_pulled_blocks
    outputs = run_both(decode, prefill)
    assert outputs["b"] == reference_generate(model, prompts["b"], 4)
    expected = -(-(len(prompts["b"]) - 1) // BLOCK_SIZE) - 5
    assert expected >= 1 and decode.kv_connector.num_pulled_blocks - pulled_before == expected, \
        "b shares a's 5 cached blocks on the decode engine: only the blocks after them are pulled"
    assert_all_free(prefill, decode)
    # Cached up to its last token: nothing to pull, and the producer hears so instead of waiting for its timeout.
    short = prompts["a"][:5 * BLOCK_SIZE + 1]
    params = prefill_once(prefill, "c", short)
    prefill.step()
    decode.add_request("c", short, with_params(4, params))
    pulled_before = decode.kv_connector.num_pulled_blocks
    start = time.monotonic()
    outputs = run_both(decode, prefill)
    assert outputs["c"] == reference_generate(model, short, 4)
    assert decode.kv_connector.num_pulled_blocks == pulled_before and time.monotonic() - start < 10, \
        "released long before the producer's 30 s timeout"
    assert_all_free(prefill, decode)


def test_blocks_nobody_pulls_are_freed_after_the_send_timeout(embedded, prompts):
    model, tokenizer = embedded
    prefill = LLMEngine(model, tokenizer, kv_transfer_config=producer_config(kv_send_timeout_s=0.3), **KNOBS)
    try:
        prefill_once(prefill, "r", prompts["a"])
        prefill.step()
        assert prefill.has_pending_kv_transfers(), "held for the decode side"
        deadline = time.monotonic() + 10
        while prefill.has_pending_kv_transfers():
            assert time.monotonic() < deadline, "the blocks were never freed"
            prefill.step()
            time.sleep(0.01)
        assert_all_free(prefill)
        with pytest.raises(RuntimeError, match="unknown here"):  # expired: a late pull is refused at once
            pull_blocks("127.0.0.1", prefill.model_runner.kv_connector.kv_port, "r", [0],
                        prefill.model_runner.kv_connector.layout, 5)
    finally:
        prefill.shutdown()


def test_a_dead_producer_means_a_recompute_with_the_same_output(pair, embedded, prompts):
    model, _ = embedded
    prefill, decode = pair
    params = prefill_once(prefill, "r", prompts["b"])
    prefill.shutdown()  # gone after answering, before the decode side pulled
    decode.add_request("r", prompts["b"], with_params(6, params))
    computed_before = decode.num_tokens_computed
    outputs = run_both(decode)
    assert outputs["r"] == reference_generate(model, prompts["b"], 6)
    assert decode.scheduler.num_failed_loads == 1, "the pull failed and was reported"
    assert decode.num_tokens_computed - computed_before == len(prompts["b"]) + 5, "the whole prompt is computed"
    assert_all_free(decode)


def test_an_unknown_request_or_foreign_blocks_are_refused(pair, embedded, prompts, monkeypatch):
    model, _ = embedded
    prefill, decode = pair
    monkeypatch.setattr(socket_connector, "REGISTER_GRACE_S", 0.2)
    params = prefill_once(prefill, "r", prompts["a"])
    prefill.step()  # the worker now serves r's blocks
    worker = prefill.model_runner.kv_connector
    free = [b for b in range(prefill.num_blocks) if b not in params["remote_block_ids"]]
    with pytest.raises(RuntimeError, match="not blocks of request 'r'"):
        pull_blocks("127.0.0.1", worker.kv_port, "r", [free[0]], worker.layout, 5)
    prefill.step()
    assert prefill.has_pending_kv_transfers(), "a refused pull does not release r's blocks"
    wrong = dict(worker.layout, num_kv_heads=worker.layout["num_kv_heads"] + 1, dtype="float16")
    with pytest.raises(ValueError, match="layout mismatch: num_kv_heads .* dtype"):
        pull_blocks("127.0.0.1", worker.kv_port, "r", params["remote_block_ids"][:1], wrong, 5)
    run_both(prefill)  # the producer's thread releases r just after its last byte went out: step until it has
    assert_all_free(prefill)  # the mismatched reader got r's bytes (and threw them away): r is done with
    # A decode request naming a request the producer never had: refused, recomputed, the same tokens.
    decode.add_request("x", prompts["a"], with_params(4, dict(params, remote_request_id="nope")))
    outputs = run_both(decode)
    assert outputs["x"] == reference_generate(model, prompts["a"], 4)
    assert decode.scheduler.num_failed_loads == 1
    assert_all_free(decode)


def test_configs_are_checked_by_field():
    def make(config, role="scheduler"):
        from kvlab.kv_transfer import KVConnectorRole
        return SocketConnector(KVTransferConfig.from_value(config), KVConnectorRole(role), block_size=8)

    with pytest.raises(ValueError, match="kv_send_timeout_s is a producer's setting, but kv_role is 'kv_consumer'"):
        make(consumer_config(kv_send_timeout_s=3))
    with pytest.raises(ValueError, match="kv_pull_timeout_s is a consumer's setting"):
        make(producer_config(kv_pull_timeout_s=3))
    with pytest.raises(ValueError, match="kv_port must be an integer in 0..65535"):
        make(producer_config(kv_port=70000))
    with pytest.raises(ValueError, match="kv_send_timeout_s must be a positive number"):
        make(producer_config(kv_send_timeout_s=0))
    with pytest.raises(ValueError, match="unknown key 'kv_buffer_size'"):
        make(producer_config(kv_buffer_size=3))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        worker = make(producer_config(kv_port=port), "worker")

        class Cache:  # just what register_kv_caches reads
            k_pools = v_pools = [torch.zeros(2, 8, 1, 4)]
            kv_cache_dtype = "auto"

        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            worker.register_kv_caches(Cache())
