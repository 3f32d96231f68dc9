"""KV-cache events published over ZeroMQ on loopback, in vLLM's frames: sequence numbers, payloads, replay."""

import json
import os
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from kvlab import SamplingParams
from kvlab.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, from_wire
from kvlab.core.prefix_cache import block_hashes
from kvlab.engine.config import EngineConfig
from kvlab.engine.kv_events import END_SEQ, KVEventsConfig
from kvlab.engine.llm_engine import LLMEngine

BLOCK_SIZE = 8
EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
          "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"}


def run(engine, prompts, max_tokens=4):
    for prompt in prompts:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"r{len(engine.scheduler.requests)}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


def receive(sub, timeout_s=10.0) -> list[tuple[int, list]]:
    """Every (sequence number, events) the subscriber gets until it has been quiet for a moment."""
    got, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline and sub.poll(300):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv", "the topic frame leads"
        got.append((int.from_bytes(seq, "big"), from_wire(msgpack.unpackb(payload)).events))
    return got


@pytest.fixture
def engine_and_subscriber(embedded):
    model, tokenizer = embedded
    engine = LLMEngine(model, tokenizer, block_size=BLOCK_SIZE, num_blocks=12, max_model_len=96,
                       kv_events_config=EVENTS)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(engine.kv_event_publisher.endpoint)
    time.sleep(0.3)  # a PUB socket drops what it sends before the subscription has arrived
    try:
        yield engine, sub, context
    finally:
        sub.close(linger=0)
        engine.shutdown()
        context.term()


def test_the_engine_publishes_what_its_pool_caches_and_evicts(embedded, engine_and_subscriber):
    engine, sub, _ = engine_and_subscriber
    _, tokenizer = embedded
    first = tokenizer("KING LEAR. Nothing will come of nothing. Speak again, mend your speech a little.")["input_ids"]
    second = tokenizer("HAMLET. To be, or not to be, that is the question: whether tis nobler in the mind")["input_ids"]
    run(engine, [first[:40]])
    run(engine, [second[:60]])  # needs most of the 12 blocks: some of first's cached blocks are reused
    got = receive(sub)
    seqs = [seq for seq, _ in got]
    assert seqs == list(range(len(got))), f"batches are numbered 0, 1, 2, ... without gaps, got {seqs}"
    events = [event for _, batch in got for event in batch]
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert set(block_hashes(first[:40], BLOCK_SIZE)) <= set(stored), "every full block of the first prompt is stored"
    assert set(block_hashes(second[:60], BLOCK_SIZE)) <= set(stored)
    assert removed and set(removed) <= set(block_hashes(first[:40], BLOCK_SIZE)), \
        "the first prompt's evicted blocks are reported by the hashes they were stored under"
    for event in events:
        if isinstance(event, BlockStored):
            assert event.block_size == BLOCK_SIZE and len(event.token_ids) == BLOCK_SIZE * len(event.block_hashes)
    engine.reset_prefix_cache()
    assert any(isinstance(e, AllBlocksCleared) for _, batch in receive(sub) for e in batch)


def test_a_subscriber_that_missed_batches_gets_them_from_the_replay_socket(embedded, engine_and_subscriber):
    engine, sub, context = engine_and_subscriber
    _, tokenizer = embedded
    run(engine, [tokenizer("ROMEO. But soft, what light through yonder window breaks?")["input_ids"][:40]])
    live = receive(sub)
    assert live, "the live subscriber got the batches"
    replay = context.socket(zmq.DEALER)
    replay.connect(engine.kv_event_publisher.replay_endpoint)
    try:
        replay.send_multipart([b"", (1).to_bytes(8, "big")])  # as if batch 0 was the last one it saw
        replayed = []
        while True:
            assert replay.poll(5000), "the replay socket answers"
            _, seq, payload = replay.recv_multipart()
            if seq == END_SEQ:
                assert payload == b"", "the end marker carries no payload"
                break
            replayed.append((int.from_bytes(seq, "big"), from_wire(msgpack.unpackb(payload)).events))
    finally:
        replay.close(linger=0)
    assert replayed == live[1:], "replay resends every held batch from the asked number on, unchanged"


def test_two_processes_hash_the_same_tokens_alike():
    tokens = list(range(100, 140))
    code = ("import json, sys; from kvlab.core.prefix_cache import block_hashes; "
            "print(json.dumps([h.hex() for h in block_hashes(json.loads(sys.argv[1]), 8)]))")
    out = []
    for seed in ("1", "2"):  # Python's own hash() differs between these; the block hashes must not
        env = dict(os.environ, PYTHONHASHSEED=seed)
        done = subprocess.run([sys.executable, "-c", code, json.dumps(tokens)], capture_output=True, text=True,
                              env=env, timeout=60, check=True)
        out.append(json.loads(done.stdout))
    assert out[0] == out[1] == [h.hex() for h in block_hashes(tokens, 8)], \
        "a router can compare replicas' events only if every replica names the same tokens' blocks alike"


@pytest.mark.parametrize("value, named", [
    ({"publisher": "kafka"}, "publisher"), ({"endpoint": "5557"}, "endpoint"), ({"buffer_steps": 0}, "buffer_steps"),
    ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events"), ({"bogus": 1}, "bogus"), ("{", "not JSON"),
])
def test_bad_kv_events_config_is_refused_naming_the_field(value, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig.from_kwargs(kv_events_config=value)


def test_the_command_line_takes_the_same_json():
    import argparse

    parser = EngineConfig.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--kv-events-config", json.dumps(EVENTS)])
    assert EngineConfig.from_cli_args(args).kv_events_config == KVEventsConfig(**EVENTS)


def test_a_taken_endpoint_is_a_clear_error(embedded):
    model, tokenizer = embedded
    context = zmq.Context()
    taken = context.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ValueError, match="cannot bind"):
            LLMEngine(model, tokenizer, block_size=BLOCK_SIZE, num_blocks=12,
                      kv_events_config=dict(EVENTS, endpoint=f"tcp://127.0.0.1:{port}"))
    finally:
        taken.close(linger=0)
        context.term()
