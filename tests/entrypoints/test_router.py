"""The cache-aware router with real processes on 127.0.0.1: three `kvlab serve` replicas publishing KV-cache events
over ZMQ and `kvlab router` in front (kvlab.entrypoints.replicas starts them), plus routers of every other policy
over the same replicas, an in-process router that misses batches, a crash and a replica with another hash seed."""

import asyncio
import json
import re
import threading
import time

import httpx
import msgpack
import pytest
import zmq

from kvlab.core.kv_events import from_wire
from kvlab.engine.input_processor import tokenize_text
from kvlab.engine.kv_events import END_SEQ
from kvlab.entrypoints.launch import CLI, ProcessGroup, free_port
from kvlab.entrypoints.replicas import ReplicaSet
from kvlab.entrypoints.router import REPLICA_HEADER, Router
from kvlab.model.loader import load_tokenizer
from kvlab.router.kv_index import KVBlockIndex

BLOCK_SIZE = 16
SERVE_ARGS = ["--block-size", str(BLOCK_SIZE), "--num-blocks", "64", "--max-num-seqs", "8"]
SEED = "0"
PROMPTS = ["KING LEAR.\nNothing will come of nothing. Speak again.", "HAMLET.\nTo be, or not to be, that is the"]
CHATS = [[{"role": "user", "content": "Speak again, Cordelia."}],
         [{"role": "system", "content": "A play."}, {"role": "user", "content": "Who is there?"}]]


def body(prompt_or_messages, n=8, **extra) -> dict:
    key = "prompt" if isinstance(prompt_or_messages, str) else "messages"
    return {"model": "default", key: prompt_or_messages, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            **extra}


def path_of(request: dict) -> str:
    return "/v1/chat/completions" if "messages" in request else "/v1/completions"


def answer(url: str, request: dict) -> tuple[str, str | None]:
    """(the text, the replica the router names) of one request, streamed or not."""
    chat = "messages" in request
    if not request.get("stream"):
        reply = httpx.post(url + path_of(request), json=request, timeout=60)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]), reply.headers.get(REPLICA_HEADER)
    pieces = []
    with httpx.stream("POST", url + path_of(request), json=request, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                for choice in event["choices"]:
                    pieces.append(choice["delta"].get("content", "") if chat else choice["text"])
        return "".join(pieces), reply.headers.get(REPLICA_HEADER)


def stats(url: str) -> dict:
    return httpx.get(url + "/router/stats", timeout=10).json()


def replica_stats(url: str, replica_url: str) -> dict:
    return next(r for r in stats(url)["replicas"] if r["url"] == replica_url)


def prefix_hits(replica_url: str) -> float:
    text = httpx.get(replica_url + "/metrics", timeout=10).text
    return float(re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M).group(1))


def wait_for(condition, within_s: float, what: str):
    deadline = time.monotonic() + within_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} not within {within_s} s"
        time.sleep(0.05)
    return value


@pytest.fixture(scope="module")
def replicas():
    with ReplicaSet("default", num_replicas=3, policy="precise-prefix", serve_args=SERVE_ARGS, hash_seed=SEED,
                    start_timeout_s=120) as started:
        yield started


def test_every_policy_answers_as_one_engine(replicas):
    others = ProcessGroup(prefix="kvlab-routers-", env={"PYTHONHASHSEED": SEED})
    urls = {"precise-prefix": replicas.router_url}
    try:
        for policy in ("round-robin", "least-loaded", "approx-prefix", "kv-cost"):
            port = free_port()
            argv = [*CLI, "router", "--policy", policy, "--port", str(port), "--block-size", str(BLOCK_SIZE),
                    "--load-poll-interval-s", "0.5"]
            for url, ports in zip(replicas.replica_urls, replicas.ports):
                argv += ["--replica", url, "--kv-events", f"tcp://127.0.0.1:{ports['events']}",
                         "--kv-events-replay", f"tcp://127.0.0.1:{ports['replay']}"]
            others.start(policy, argv)
            urls[policy] = f"http://127.0.0.1:{port}"
        others.wait_healthy({p: u for p, u in urls.items() if p != "precise-prefix"}, 60)
        requests = [body(p) for p in PROMPTS] + [body(m) for m in CHATS]
        # One engine alone: the first replica asked directly.
        alone = [answer(replicas.replica_urls[0], r)[0] for r in requests]
        assert all(alone), "greedy answers of a few tokens"
        for policy, url in urls.items():
            wait_for(lambda url=url: all(r["alive"] for r in stats(url)["replicas"]), 30, f"{policy}: all admitted")
            served_by = set()
            for request, expected in zip(requests, alone):
                for stream in (False, True):
                    text, replica = answer(url, dict(request, stream=stream))
                    assert text == expected, f"{policy}, {path_of(request)}, stream={stream}: differs from one engine"
                    assert replica in replicas.replica_urls
                    served_by.add(replica)
            assert stats(url)["policy"] == policy
            if policy == "round-robin":
                assert served_by == set(replicas.replica_urls), "round-robin uses every replica"
    finally:
        others.stop()


def test_precise_prefix_sends_a_shared_prefix_to_the_replica_that_holds_it(replicas):
    router, holder = replicas.router_url, replicas.replica_urls[2]
    prefix = "OTHELLO.\nKeep up your bright swords, for the dew will rust them. Good signior, you shall more command"
    assert len(prefix) > 6 * BLOCK_SIZE  # the embedded model's tokenizer has one token per character
    # The last replica computes the prefix, asked directly: only its events can tell the router.
    answer(holder, body(prefix + " with years", n=2))
    tokens = tokenize_text(load_tokenizer("default"), prefix + " with years")
    wait_for(lambda: replica_stats(router, holder)["blocks_indexed"] >= len(tokens) // BLOCK_SIZE, 10,
             "the holder's blocks indexed")
    before = {url: prefix_hits(url) for url in replicas.replica_urls}
    routed_before = replica_stats(router, holder)["routed"]
    text, replica = answer(router, body(prefix + " than with your weapons", n=4))
    assert replica == holder, "the router's choice is the replica whose cache holds the prefix"
    assert replica_stats(router, holder)["routed"] == routed_before + 1
    gained = {url: prefix_hits(url) - before[url] for url in replicas.replica_urls}
    assert gained[holder] >= 6 * BLOCK_SIZE, f"the holder served the shared blocks from its cache: {gained}"
    assert all(gained[url] == 0 for url in replicas.replica_urls if url != holder), gained


class RunningRouter:
    """A Router on its own event loop in a thread (its subscribers, pollers and replays running as in the server)."""

    def __init__(self, router: Router):
        self.router = router
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(router.start())

    def call(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def read(self, fn):
        async def on_loop():
            return fn(self.router)
        return self.call(on_loop())

    def stop(self):
        self.call(self.router.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class DroppingRouter(Router):
    """Loses the first live batch numbered drop_from or later, as a slow subscriber's PUB socket would."""

    drop_from = None

    async def receive(self, replica, seq, payload):
        if self.drop_from is not None and seq >= self.drop_from:
            self.drop_from = None
            return
        await super().receive(replica, seq, payload)


def replica_state(replay_endpoint: str, replica_url: str) -> set:
    """The blocks a replica's pool holds: every batch it ever published, replayed from 0 into a fresh index."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.connect(replay_endpoint)
    index = KVBlockIndex(BLOCK_SIZE, hash_seed=SEED)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            assert sock.poll(5000), "the replay socket answers"
            _, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return index.held.get(replica_url, set())
            index.apply(replica_url, from_wire(msgpack.unpackb(payload)), int.from_bytes(seq, "big"))
    finally:
        sock.close(linger=0)
        context.term()


def test_a_subscriber_that_missed_batches_resyncs_through_replay(replicas):
    url, ports = replicas.replica_urls[1], replicas.ports[1]
    replay = f"tcp://127.0.0.1:{ports['replay']}"
    # Subscribing late: this replica has published batches already, which the router gets by replay when admitted.
    answer(url, body("MACBETH.\nIs this a dagger which I see before me, the handle toward my hand?", n=3))
    router = DroppingRouter([url], "precise-prefix", kv_events=[f"tcp://127.0.0.1:{ports['events']}"],
                            kv_events_replay=[replay], block_size=BLOCK_SIZE, hash_seed=SEED)
    running = RunningRouter(router)
    try:
        wait_for(lambda: running.read(lambda r: r.replicas[0].alive), 10, "the replica admitted")
        assert running.read(lambda r: set(r.index.held.get(url, ()))) == replica_state(replay, url) != set(), \
            "a late subscriber's index equals the replica's pool"
        resyncs = running.read(lambda r: r.replicas[0].resyncs)
        router.drop_from = running.read(lambda r: r.index.last_seq[url]) + 1
        for prompt in ("JULIET.\nO Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name",
                       "PUCK.\nIf we shadows have offended, think but this, and all is mended"):
            answer(url, body(prompt, n=3))
        wait_for(lambda: router.drop_from is None, 10, "a batch dropped")
        wait_for(lambda: running.read(lambda r: r.replicas[0].resyncs) == resyncs + 1, 10, "the gap filled by replay")
        truth = replica_state(replay, url)
        wait_for(lambda: running.read(lambda r: set(r.index.held.get(url, ()))) == truth, 10,
                 "the index equal to the replica's pool after the resync")
        assert running.read(lambda r: (url in r.index.needs_resync, r.replicas[0].restarts_from_live)) == (False, 0)
    finally:
        running.stop()


def test_a_killed_replica_is_dropped_mid_stream_and_readmitted_empty_after_a_restart(replicas):
    router = replicas.router_url
    prompt = "PROSPERO.\nOur revels now are ended. These our actors, as I foretold you, were all spirits"
    request = body(prompt, n=256 - len(prompt) - 8, stream=True)
    events = []
    with httpx.stream("POST", router + "/v1/completions", json=request, timeout=60) as reply:
        assert reply.status_code == 200
        victim = reply.headers[REPLICA_HEADER]
        lines = reply.iter_lines()
        events.append(next(line for line in lines if line.startswith("data: ")))
        replicas.kill_replica(replicas.replica_urls.index(victim))
        events += [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]", "the stream is closed properly"
    error = json.loads(events[-2][6:])
    assert "error" in error and victim in error["error"]["message"], "an OpenAI-style error event names the replica"
    row = replica_stats(router, victim)
    assert not row["alive"] and row["blocks_indexed"] == 0 and row["in_flight"] == 0
    for p in PROMPTS:  # later requests succeed on the others
        _, replica = answer(router, body(p, n=4))
        assert replica != victim
    assert httpx.get(router + "/health", timeout=10).status_code == 200
    i = replicas.replica_urls.index(victim)
    replicas.restart_replica(i)
    row = replica_stats(router, victim)
    assert row["alive"] and not row["seed_mismatch"]
    assert row["blocks_indexed"] == 0, "re-admitted with an empty index: it restarted with an empty cache"


def test_a_replica_with_another_hash_seed_is_reported_and_gets_no_prefix_score(replicas):
    router, i = replicas.router_url, 2
    odd = replicas.replica_urls[i]
    replicas.restart_replica(i, hash_seed="7")
    prompt = "TITANIA.\nThese are the forgeries of jealousy: and never, since the middle summer's spring, met we"
    answer(odd, body(prompt, n=2))
    wait_for(lambda: replica_stats(router, odd)["seed_mismatch"], 10, "the mismatch reported")
    assert odd in replicas.log_tail("router") and "PYTHONHASHSEED" in replicas.log_tail("router")
    _, chosen = answer(router, body(prompt + " on hill", n=2))
    assert chosen != odd, "its blocks (named under seed 7) score nothing; the tie goes to an earlier replica"
    replicas.restart_replica(i)  # the shared seed again: the flag goes with the old process
    assert not replica_stats(router, odd)["seed_mismatch"]


def test_kvlab_replicas_starts_everything_and_stops_every_child_on_sigterm(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from kvlab.entrypoints.launch import healthy

    port = free_port()
    log = tmp_path / "replicas.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvlab.entrypoints.cli", "replicas", "--num-replicas", "1",
                                 "--policy", "least-loaded", "--port", str(port), "--serve-args", "--num-blocks 32",
                                 "--log-dir", str(tmp_path / "logs")], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        wait_for(lambda: "Ctrl-C stops all" in log.read_text() or proc.poll() is not None, 120, "the banner")
        banner = log.read_text()
        replica_url = re.search(r"replicas (http://\S+);", banner).group(1)
        router = f"http://127.0.0.1:{port}"
        assert stats(router)["policy"] == "least-loaded"
        assert answer(router, body(PROMPTS[0], n=4)) == (answer(replica_url, body(PROMPTS[0], n=4))[0], replica_url)
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, log.read_text()
    assert not healthy(router) and not healthy(replica_url), "every child stopped with the command"
    assert (tmp_path / "logs" / "replica0.log").exists() and (tmp_path / "logs" / "router.log").exists()
