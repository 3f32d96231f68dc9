"""The router's parts that need no replica process: flags, load parsing, prompt hashing, the index's health, choices."""

import asyncio
import logging

import httpx
import msgpack
import pytest

from kvlab.core.kv_events import BlockStored, KVEventBatch, as_wire
from kvlab.core.prefix_cache import block_hashes
from kvlab.engine.input_processor import tokenize_text
from kvlab.entrypoints.cli import main
from kvlab.entrypoints.launch import free_port
from kvlab.entrypoints.openai.chat_template import render_chat
from kvlab.entrypoints.replicas import ReplicaSet, _replica_block_size
from kvlab.entrypoints.router import REPLICA_HEADER, Router, parse_load
from kvlab.model.loader import load_tokenizer

A, B = "http://127.0.0.1:8101", "http://127.0.0.1:8102"
EVENTS = ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5559"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def payload(events) -> bytes:
    return msgpack.packb(as_wire(KVEventBatch(0.0, events)), use_bin_type=True)


def stored(tokens, seed, block_size=4) -> BlockStored:
    return BlockStored(block_hashes(tokens, block_size, hash_seed=seed), None, list(tokens), block_size)


@pytest.mark.parametrize("kwargs, named", [
    ({"policy": "fastest"}, "--policy must be one of round-robin"),
    ({"policy": "precise-prefix"}, "--kv-events ENDPOINT per --replica"),
    ({"policy": "kv-cost"}, "--kv-events ENDPOINT per --replica"),
    ({"policy": "round-robin", "kv_events": EVENTS[:1]}, "one --kv-events per --replica.*2 replicas but 1"),
    ({"policy": "round-robin", "kv_events": EVENTS, "kv_events_replay": EVENTS[:1]}, "one --kv-events-replay"),
    ({"policy": "round-robin", "kv_events": ["tcp://*:5557", EVENTS[1]]}, "--kv-events must be a ZMQ endpoint"),
    ({"policy": "round-robin", "load_poll_interval_s": 0}, "--load-poll-interval-s"),
])
def test_bad_router_settings_are_clear_errors(kwargs, named):
    with pytest.raises(ValueError, match=named):
        Router([A, B], **kwargs)


def test_bad_replica_urls_are_refused():
    with pytest.raises(ValueError, match="--replica must be a server's base URL"):
        Router(["127.0.0.1:8101"], "round-robin")
    with pytest.raises(ValueError, match="names a replica twice"):
        Router([A, A + "/"], "round-robin")
    with pytest.raises(ValueError, match="at least one --replica"):
        Router([], "round-robin")


@pytest.mark.parametrize("argv, named", [
    (["--replica", A, "--policy", "fastest"], "--policy must be one of"),
    (["--replica", A, "--replica", B, "--kv-events", EVENTS[0]], "one --kv-events per --replica"),
    (["--replica", A, "--policy", "precise-prefix"], "precise-prefix reads the replicas' caches"),
])
def test_kvlab_router_exits_2_naming_the_bad_flag(argv, named, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["router", *argv])
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_replica_set_refuses_bad_settings_before_starting_anything():
    with pytest.raises(ValueError, match="num_replicas must be a positive integer"):
        ReplicaSet(num_replicas=0)
    with pytest.raises(ValueError, match="policy must be one of"):
        ReplicaSet(policy="fastest")
    assert _replica_block_size("default", ["--block-size", "8", "--num-blocks", "64"]) == 8
    assert _replica_block_size("default", []) == 16, "the engine's default block size when serve_args give none"


def test_load_is_read_from_vllm_metric_names():
    text = ('# HELP vllm:num_requests_waiting x\nvllm:num_requests_waiting{model_name="default"} 3.0\n'
            'vllm:num_requests_running{model_name="default"} 2.0\n'
            'vllm:kv_cache_usage_perc{model_name="default"} 0.25\nvllm:num_preemptions_total{model_name="d"} 9.0\n')
    assert parse_load(text) == {"vllm:num_requests_waiting": 3.0, "vllm:num_requests_running": 2.0,
                                "vllm:kv_cache_usage_perc": 0.25}


def test_prompts_are_tokenized_and_hashed_as_the_replica_does(tokenizer):
    router = Router([A], "round-robin", tokenizer=tokenizer, block_size=16, hash_seed="0")
    text = "KING LEAR.\nNothing will come of nothing. Speak again."
    ids = tokenize_text(tokenizer, text)
    assert router.prompt_token_ids({"prompt": text}, chat=False) == ids
    assert router.prompt_token_ids({"prompt": [text, "other"]}, chat=False) == ids, "the first prompt places a list"
    assert router.prompt_token_ids({"prompt": ids}, chat=False) == ids
    messages = [{"role": "system", "content": "Speak as a king."},
                {"role": "user", "content": [{"type": "text", "text": "Nothing"}, {"type": "text", "text": "again"}]}]
    rendered = render_chat([{"role": "system", "content": "Speak as a king."},
                            {"role": "user", "content": "Nothing\nagain"}], tokenizer)
    assert router.prompt_token_ids({"messages": messages}, chat=True) == tokenize_text(tokenizer, rendered), \
        "chat: the serving code's template, text parts joined as the server joins them"
    assert router.prompt_token_ids({"messages": []}, chat=True) is None, "a body the replica refuses is not hashed"
    assert router.prompt_token_ids({"prompt": 7}, chat=False) is None
    assert router.hashes(ids) == block_hashes(ids, 16, hash_seed="0") != block_hashes(ids, 16), \
        "the replicas' seed names the blocks"


def test_a_replica_with_another_seed_is_flagged_once_and_scores_no_hits(caplog):
    router = Router([A, B], "kv-cost", kv_events=EVENTS, block_size=4, hash_seed="0")
    for replica in router.replicas:
        replica.alive = True
    tokens = list(range(10, 22))
    a, b = router.replicas
    with caplog.at_level(logging.WARNING, logger="kvlab.entrypoints.router"):
        router.apply(a, 0, payload([stored(tokens, "0")]))
        router.apply(b, 0, payload([stored(tokens, "7")]))
        router.apply(b, 1, payload([stored(list(range(50, 54)), "7")]))
    warnings = [r.getMessage() for r in caplog.records if "another seed" in r.getMessage()]
    assert len(warnings) == 1 and B in warnings[0] and "PYTHONHASHSEED" in warnings[0], warnings
    stats = {r["url"]: r for r in router.stats()["replicas"]}
    assert stats[B]["seed_mismatch"] and not stats[A]["seed_mismatch"]
    assert router.index.longest_hits(router.hashes(tokens)) == {A: 3}, "the mismatched replica is left out"
    assert router.choose(router.hashes(tokens)).url == A


def test_a_gap_without_replay_starts_the_index_over_from_the_live_stream():
    router = Router([A], "precise-prefix", kv_events=EVENTS[:1], block_size=4)
    (a,) = router.replicas
    a.alive = True
    router.apply(a, 0, payload([stored(range(4), None)]))
    router.apply(a, 5, payload([stored(range(100, 104), None)]))  # batches 1-4 lost
    assert a.restarts_from_live == 1 and not router.index.needs_resync, "the flag is cleared: indexing goes on"
    assert router.index.held[A] == set(block_hashes(list(range(100, 104)), 4)), \
        "entries from before the gap are dropped (they may be evicted); later ones are indexed"
    router.apply(a, 6, payload([stored(range(200, 204), None)]))
    assert len(router.index.held[A]) == 2


def test_a_dead_replica_leaves_the_index_and_the_choices():
    router = Router([A, B], "precise-prefix", kv_events=EVENTS, block_size=4)
    for replica in router.replicas:
        replica.alive = True
    a, b = router.replicas
    router.apply(a, 0, payload([stored(range(8), None)]))
    assert router.choose(router.hashes(list(range(8)))) is a
    router.mark_dead(a, "test")
    row = router.stats()["replicas"][0]
    assert not row["alive"] and row["blocks_indexed"] == 0
    assert router.choose(router.hashes(list(range(8)))) is b
    router.mark_dead(b, "test")
    assert router.choose([]) is None


def test_a_request_is_retried_once_when_the_first_replica_refuses_and_503_when_none_is_alive():
    async def scenario():
        dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
        router = Router(dead, "round-robin")
        router.client = httpx.AsyncClient(timeout=5)
        try:
            none_alive = await router.forward("/v1/completions", {"prompt": [1, 2, 3]}, chat=False)
            for replica in router.replicas:
                replica.alive = True
            both_refused = await router.forward("/v1/completions", {"prompt": [1, 2, 3]}, chat=False)
            return none_alive, both_refused, [r.alive for r in router.replicas]
        finally:
            await router.client.aclose()

    none_alive, both_refused, alive = asyncio.run(scenario())
    assert none_alive.status_code == 503 and b"no replica is alive" in none_alive.body
    assert both_refused.status_code == 502 and b"and then" in both_refused.body, "tried twice, then gave up"
    assert REPLICA_HEADER not in both_refused.headers
    assert alive == [False, False], "a refused connection marks the replica dead"
