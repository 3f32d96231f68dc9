"""`kvlab router`: one OpenAI endpoint in front of several `kvlab serve` replicas, placing each request by their caches.

    kvlab serve default --port 8101 --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}'      # and 8102, 8103 ...
    kvlab router --replica http://127.0.0.1:8101 --kv-events tcp://127.0.0.1:5557 \\
        --kv-events-replay tcp://127.0.0.1:5558 ... --policy kv-cost --port 8000
    kvlab replicas --num-replicas 3 --policy kv-cost          # all of it at once (kvlab.entrypoints.replicas)

Production routers do the same job at scale: llm-d's KV-cache manager (its kv-cache indexer) feeding the
inference scheduler's prefix scorer, NVIDIA Dynamo's KV router, SGLang's cache-aware router. Like them, this
router tokenizes each prompt as the replicas will (the chat template included, imported from the serving code),
hashes its full blocks as they do (kvlab.core.prefix_cache.block_hashes under the replicas' hash seed), and lets a
policy (kvlab.router.policies) choose among the live replicas from those hashes and each replica's load:

* the index: one KVBlockIndex (kvlab.router.kv_index) fed by a ZMQ subscriber per replica, each batch applied
  with its sequence number. The router checks the number before applying: after a gap it asks the replica's
  replay socket for every batch it missed and applies them in order. A gap replay cannot fill (no replay
  endpoint, or the publisher's ring no longer holds the batches) reaches the index, which drops the replica's
  entries and marks needs_resync; the router then clears the flag and starts over from the live stream, so that
  replica's index holds only what it stores from then on (hits under-counted, never invented). A replica first
  admitted, or re-admitted after a restart, is synced by replaying from batch 0. A replica whose blocks hash
  under another seed (KVBlockIndex.seed_mismatch) is logged with a warning naming it and PYTHONHASHSEED, shown in
  /router/stats, and left out of prefix scores; it still gets requests on load.
* loads: each replica's /metrics polled every --load-poll-interval-s (vllm:num_requests_waiting,
  vllm:num_requests_running, vllm:kv_cache_usage_perc), plus the router's own count of requests in flight and
  the blocks they hold (prompt tokens plus the streamed output so far, in blocks).
* faults: a replica whose connection fails (refused, reset, closed mid-answer) is marked dead, dropped from the
  index and from the choices. A request that failed before any byte reached the client is retried once on
  another replica; one that failed mid-stream ends with an OpenAI-style error event,
  `data: {"error": {"message", "type", "param", "code"}}`, then `data: [DONE]` (the client already holds part
  of an answer, which another replica cannot continue). A dead replica is probed on /health every
  --probe-interval-s and re-admitted with its index entries cleared (it restarted with an empty cache). With no
  replica alive, a request gets a 503 saying so.

Where kvlab's router is simpler: one process and one event loop (llm-d and Dynamo run the index as a service
shared by many router replicas); the index keeps exact hashes per replica with no memory bound (llm-d keeps an
LRU, SGLang an approximate radix tree); a request goes to one replica whole (no disaggregated prefill/decode
pairs); loads come from polling /metrics rather than from the engines' own load events; and the hashes are
kvlab's block hashes with no LoRA or multimodal extra keys.

Every answer carries the replica that served it in the header x-kvlab-replica. GET /router/stats returns the
policy and, per replica: url, alive, routed, in_flight, needs_resync, seed_mismatch, blocks_indexed (plus
resyncs, restarts_from_live and the polled load).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import re
import sys
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvlab.core.kv_events import from_wire
from kvlab.core.prefix_cache import block_hashes
from kvlab.engine.kv_events import END_SEQ
from kvlab.entrypoints.disagg_proxy import check_url, error
from kvlab.router.kv_index import KVBlockIndex
from kvlab.router.policies import POLICIES, ReplicaLoad, make_policy

logger = logging.getLogger("kvlab.entrypoints.router")

# Policies that read the index, hence need every replica's KV-cache events.
EVENT_POLICIES = ("precise-prefix", "kv-cost")
# Errors that mean the replica's process is gone or its connection broke (not a slow answer).
CONNECTION_ERRORS = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
REPLICA_HEADER = "x-kvlab-replica"
_GAUGE = re.compile(r"^(vllm:num_requests_waiting|vllm:num_requests_running|vllm:kv_cache_usage_perc)\{[^}]*\} (\S+)$",
                    re.M)


def parse_load(metrics_text: str) -> dict[str, float]:
    """The three load gauges of a replica's Prometheus text, by name (those absent are left out)."""
    return {name: float(value) for name, value in _GAUGE.findall(metrics_text)}


def check_endpoint(name: str, endpoint: str) -> str:
    """A ZMQ endpoint to connect to (tcp://host:port); ValueError naming the flag otherwise."""
    if not isinstance(endpoint, str) or not re.fullmatch(r"(tcp|ipc|inproc)://\S+", endpoint) or "*" in endpoint:
        raise ValueError(f"{name} must be a ZMQ endpoint to connect to, such as tcp://127.0.0.1:5557, got {endpoint!r}")
    return endpoint


@dataclass
class Replica:
    """What the router knows of one replica: where it is, whether it answers, and what it is doing."""

    url: str
    kv_events: str | None = None
    kv_events_replay: str | None = None
    alive: bool = False                          # until the first probe answers
    routed: int = 0                              # requests answered (or streaming) from here
    active_tokens: dict = field(default_factory=dict)   # request -> prompt tokens + streamed output so far
    load: dict = field(default_factory=dict)     # the gauges of its last /metrics
    resyncs: int = 0                             # gaps filled from the replay socket
    restarts_from_live: int = 0                  # gaps replay could not fill
    seed_warned: bool = False
    event_error: str | None = None               # a batch the index refused (another block size)

    @property
    def in_flight(self) -> int:
        return len(self.active_tokens)

    def active_blocks(self, block_size: int) -> int:
        return sum(math.ceil(n / block_size) for n in self.active_tokens.values())


class _Retry(Exception):
    """The replica failed before the client got a byte: another replica may take the request."""


class Router:
    """Live replicas, the block index their events feed, the policy, and the forwarding of one request."""

    def __init__(self, replicas: list[str], policy: str = "kv-cost", *, kv_events: list[str] | tuple = (),
                 kv_events_replay: list[str] | tuple = (), tokenizer=None, block_size: int = 16,
                 hash_seed: str | None = None, overlap_score_weight: float = 1.0,
                 approx_capacity_blocks: int | None = None, load_poll_interval_s: float = 0.1,
                 load_poll_timeout_s: float = 0.5, probe_interval_s: float = 0.5, replay_timeout_s: float = 2.0,
                 request_timeout_s: float = 600.0):
        if not replicas:
            raise ValueError("give at least one --replica URL")
        urls = [check_url("--replica", url) for url in replicas]
        if len(set(urls)) != len(urls):
            raise ValueError(f"--replica names a replica twice: {urls}")
        if policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        kv_events, kv_events_replay = list(kv_events), list(kv_events_replay)
        if kv_events and len(kv_events) != len(urls):
            raise ValueError(f"give one --kv-events per --replica, in the same order: {len(urls)} replicas but "
                             f"{len(kv_events)} --kv-events")
        if kv_events_replay and len(kv_events_replay) != len(kv_events):
            raise ValueError(f"give one --kv-events-replay per --kv-events, in the same order: {len(kv_events)} "
                             f"--kv-events but {len(kv_events_replay)} --kv-events-replay")
        if policy in EVENT_POLICIES and not kv_events:
            raise ValueError(f"--policy {policy} reads the replicas' caches from their KV-cache events: give one "
                             f"--kv-events ENDPOINT per --replica (or choose round-robin, least-loaded or "
                             f"approx-prefix)")
        for name, value in (("--load-poll-interval-s", load_poll_interval_s),
                            ("--load-poll-timeout-s", load_poll_timeout_s), ("--probe-interval-s", probe_interval_s),
                            ("replay_timeout_s", replay_timeout_s), ("request_timeout_s", request_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if hash_seed is not None and not isinstance(hash_seed, str):
            raise ValueError(f"--hash-seed must be a string (PYTHONHASHSEED's value), got {hash_seed!r}")
        self.replicas = [Replica(url, check_endpoint("--kv-events", kv_events[i]) if kv_events else None,
                                 check_endpoint("--kv-events-replay", kv_events_replay[i]) if kv_events_replay
                                 else None) for i, url in enumerate(urls)]
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.index = KVBlockIndex(block_size, hash_seed=hash_seed)
        self.policy_name = policy
        self.policy = make_policy(policy, block_size, index=self.index, overlap_score_weight=overlap_score_weight,
                                  approx_capacity_blocks=approx_capacity_blocks)
        self.load_poll_interval_s, self.load_poll_timeout_s = load_poll_interval_s, load_poll_timeout_s
        self.probe_interval_s, self.replay_timeout_s = probe_interval_s, replay_timeout_s
        self.request_timeout_s = request_timeout_s
        self.client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task] = []
        self._locks = {r.url: asyncio.Lock() for r in self.replicas}
        self._zmq = None

    # ----- prompts and choices -----

    def prompt_token_ids(self, body: dict, chat: bool) -> list[int] | None:
        """The token ids the replica will see for body's (first) prompt; None when the body is not one the replica
        would accept (it answers the 400 itself)."""
        from pydantic import ValidationError

        from kvlab.engine.input_processor import tokenize_text
        from kvlab.entrypoints.openai.chat_template import render_chat
        from kvlab.entrypoints.openai.protocol import ChatCompletionRequest

        if chat:
            if self.tokenizer is None:
                return None
            try:
                request = ChatCompletionRequest.model_validate(body)
            except ValidationError:
                return None
            prompt = render_chat([{"role": m.role, "content": m.text} for m in request.messages], self.tokenizer)
        else:
            prompt = body.get("prompt")
            # Several prompts in one body run on one replica: the first one places them.
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
        if isinstance(prompt, str):
            return tokenize_text(self.tokenizer, prompt) if self.tokenizer is not None else None
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        return None

    def hashes(self, token_ids: list[int] | None) -> list:
        """The prompt's full-block hashes under the replicas' seed (none for a prompt the router could not read)."""
        return block_hashes(token_ids, self.block_size, hash_seed=self.hash_seed) if token_ids else []

    def loads(self, exclude=()) -> dict[str, ReplicaLoad]:
        """ReplicaLoad of every live replica not in exclude, in --replica order."""
        return {r.url: ReplicaLoad(num_waiting=int(r.load.get("vllm:num_requests_waiting", 0)),
                                   num_running=int(r.load.get("vllm:num_requests_running", 0)),
                                   kv_cache_usage=r.load.get("vllm:kv_cache_usage_perc", 0.0),
                                   in_flight=r.in_flight, active_blocks=r.active_blocks(self.block_size))
                for r in self.replicas if r.alive and r.url not in exclude}

    def choose(self, hashes: list, exclude=()) -> Replica | None:
        """The live replica the policy picks for these block hashes (None when none is alive)."""
        loads = self.loads(exclude)
        if not loads:
            return None
        url = self.policy.choose(hashes, loads)
        return next(r for r in self.replicas if r.url == url)

    def stats(self) -> dict:
        return {"policy": self.policy_name, "block_size": self.block_size, "hash_seed": self.hash_seed,
                "replicas": [{"url": r.url, "alive": r.alive, "routed": r.routed, "in_flight": r.in_flight,
                              "active_blocks": r.active_blocks(self.block_size),
                              "needs_resync": r.url in self.index.needs_resync,
                              "seed_mismatch": r.url in self.index.seed_mismatch,
                              "blocks_indexed": len(self.index.held.get(r.url, ())),
                              "resyncs": r.resyncs, "restarts_from_live": r.restarts_from_live,
                              "event_error": r.event_error,
                              "num_requests_waiting": int(r.load.get("vllm:num_requests_waiting", 0)),
                              "num_requests_running": int(r.load.get("vllm:num_requests_running", 0)),
                              "kv_cache_usage_perc": r.load.get("vllm:kv_cache_usage_perc", 0.0)}
                             for r in self.replicas]}

    # ----- life and death -----

    def mark_dead(self, replica: Replica, why: str) -> None:
        """Take a replica out: no requests, no index entries, no policy history."""
        if not replica.alive:
            return
        logger.warning("replica %s is unreachable (%s): marked dead until /health answers again", replica.url, why)
        replica.alive = False
        replica.load = {}
        self.index.remove_replica(replica.url)
        self.policy.remove_replica(replica.url)

    async def admit(self, replica: Replica) -> None:
        """A replica that answered /health: its index starts empty and is synced from its first batch."""
        async with self._locks[replica.url]:
            self.index.remove_replica(replica.url)
            self.policy.remove_replica(replica.url)
            replica.seed_warned, replica.event_error = False, None
            replica.alive = True
            if replica.kv_events_replay is not None:
                batches = await self.replay(replica, 0)
                for seq, payload in batches or ():
                    self.apply(replica, seq, payload)
        logger.info("replica %s is alive", replica.url)

    async def _watch(self, replica: Replica) -> None:
        """Poll a live replica's /metrics for its load; probe a dead one's /health until it answers."""
        while True:
            if replica.alive:
                try:
                    reply = await self.client.get(replica.url + "/metrics", timeout=self.load_poll_timeout_s)
                    if reply.status_code == 200:
                        replica.load = parse_load(reply.text)
                except CONNECTION_ERRORS as err:
                    self.mark_dead(replica, f"{type(err).__name__} on /metrics")
                except httpx.TimeoutException:
                    pass  # busy, not gone: the last load stands
                await asyncio.sleep(self.load_poll_interval_s)
            else:
                try:
                    reply = await self.client.get(replica.url + "/health", timeout=self.load_poll_timeout_s)
                    if reply.status_code == 200:
                        await self.admit(replica)
                        continue
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(self.probe_interval_s)

    # ----- KV-cache events -----

    def apply(self, replica: Replica, seq: int, payload: bytes) -> None:
        """Apply one batch to the index; a gap the index detects means starting over from the live stream."""
        import msgpack

        try:
            batch = from_wire(msgpack.unpackb(payload))
            self.index.apply(replica.url, batch, seq)
        except ValueError as err:  # another block size, or a payload that is not a batch
            if replica.event_error is None:
                logger.error("replica %s: KV-cache event refused (%s); is --block-size %d the replicas'?",
                             replica.url, err, self.block_size)
            replica.event_error = str(err)
            return
        if replica.url in self.index.needs_resync:
            # The index has dropped this replica's entries; what it stores from here on is indexed again.
            self.index.needs_resync.discard(replica.url)
            replica.restarts_from_live += 1
            logger.warning("replica %s: KV-cache events missed and not replayable; its index starts over from "
                           "batch %d", replica.url, seq)
        if replica.url in self.index.seed_mismatch and not replica.seed_warned:
            replica.seed_warned = True
            logger.warning("replica %s hashes blocks under another seed than this router's (%r): start the replicas "
                           "and the router with the same PYTHONHASHSEED (or --hash-seed); until then it gets no "
                           "prefix-score routing", replica.url, self.hash_seed)

    async def replay(self, replica: Replica, start: int) -> list[tuple[int, bytes]] | None:
        """Every batch from number start on that the replica's replay socket still holds; None if it does not answer."""
        import zmq

        sock = self._zmq.socket(zmq.DEALER)
        sock.connect(replica.kv_events_replay)
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            batches = []
            while True:
                if not await sock.poll(self.replay_timeout_s * 1000):
                    logger.warning("replica %s: no answer from the replay socket %s within %g s", replica.url,
                                   replica.kv_events_replay, self.replay_timeout_s)
                    return None
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    return None
                if frames[1] == END_SEQ:
                    return batches
                batches.append((int.from_bytes(frames[1], "big"), frames[2]))
        finally:
            sock.close(linger=0)

    async def on_batch(self, replica: Replica, seq: int, payload: bytes) -> None:
        """A live batch: fill a gap before it from the replay socket when possible, then apply it."""
        async with self._locks[replica.url]:
            if not replica.alive:
                return  # a dead replica's index stays empty; admit() syncs it
            last = self.index.last_seq.get(replica.url)
            start = 0 if last is None else last + 1
            if seq > start and replica.kv_events_replay is not None:
                batches = await self.replay(replica, start)
                if batches and batches[0][0] == start:
                    for number, older in batches:
                        if number < seq:
                            self.apply(replica, number, older)
                    replica.resyncs += 1
                elif last is None:  # nothing indexed yet to drop: the live stream is the start
                    replica.restarts_from_live += 1
                    logger.warning("replica %s: KV-cache events before batch %d are not replayable; its index "
                                   "starts there", replica.url, seq)
            self.apply(replica, seq, payload)

    async def receive(self, replica: Replica, seq: int, payload: bytes) -> None:
        """What the subscriber does with each live batch (a test may drop one here to make a gap)."""
        await self.on_batch(replica, seq, payload)

    async def _subscribe(self, replica: Replica) -> None:
        """SUB to one replica's publisher for as long as the router runs (ZMQ reconnects to a restarted one)."""
        import zmq

        sock = self._zmq.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(replica.kv_events)
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    logger.warning("replica %s: a message of %d frames on %s is not a KV event batch", replica.url,
                                   len(frames), replica.kv_events)
                    continue
                await self.receive(replica, int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sock.close(linger=0)

    # ----- running -----

    async def start(self) -> None:
        """Open the HTTP client, the subscribers and the pollers (on the running event loop)."""
        import zmq.asyncio

        self.client = httpx.AsyncClient(timeout=self.request_timeout_s)
        self._zmq = zmq.asyncio.Context()
        for replica in self.replicas:
            if replica.kv_events is not None:
                self._tasks.append(asyncio.create_task(self._subscribe(replica)))
            self._tasks.append(asyncio.create_task(self._watch(replica)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self.client is not None:
            await self.client.aclose()
        if self._zmq is not None:
            self._zmq.term()

    # ----- forwarding -----

    async def forward(self, path: str, body: dict, chat: bool):
        """The client's answer: from the replica the policy picks, or from a second one if the first failed early."""
        token_ids = self.prompt_token_ids(body, chat)
        hashes = self.hashes(token_ids)
        num_tokens = len(token_ids) if token_ids else 0
        tried: list[str] = []
        while len(tried) < 2:
            replica = self.choose(hashes, exclude=tried)
            if replica is None:
                break
            tried.append(replica.url)
            try:
                return await self._send(replica, path, body, hashes, num_tokens)
            except _Retry:
                continue
        if tried:
            return error(502, f"{path} failed on {' and then '.join(tried)} (connection lost before any answer)")
        return error(503, f"no replica is alive ({len(self.replicas)} known: "
                          f"{', '.join(r.url for r in self.replicas)}); see GET /router/stats")

    async def _send(self, replica: Replica, path: str, body: dict, hashes: list, num_tokens: int):
        key = object()
        replica.active_tokens[key] = num_tokens
        reply = None
        try:
            reply = await self.client.send(self.client.build_request("POST", replica.url + path, json=body),
                                           stream=True)
            if body.get("stream") and reply.status_code == 200:
                chunks = reply.aiter_raw()
                first = await anext(chunks, b"")  # a failure before this byte reached the client can still be retried
            else:
                content = await reply.aread()
        except CONNECTION_ERRORS as err:
            replica.active_tokens.pop(key, None)
            if reply is not None:
                await reply.aclose()
            self.mark_dead(replica, f"{type(err).__name__} on {path}")
            raise _Retry from None
        except httpx.TimeoutException:
            replica.active_tokens.pop(key, None)
            if reply is not None:
                await reply.aclose()
            return error(504, f"the replica {replica.url} did not answer {path} within {self.request_timeout_s:g} s")
        except BaseException:
            replica.active_tokens.pop(key, None)
            if reply is not None:
                await reply.aclose()
            raise
        replica.routed += 1
        self.policy.on_routed(replica.url, hashes)
        headers = {REPLICA_HEADER: replica.url}
        if body.get("stream") and reply.status_code == 200:
            return StreamingResponse(self._relay(replica, key, reply, first, chunks), status_code=200, headers=headers,
                                     media_type=reply.headers.get("content-type", "text/event-stream"))
        replica.active_tokens.pop(key, None)
        return Response(content, status_code=reply.status_code, headers=headers,
                        media_type=reply.headers.get("content-type", "application/json"))

    async def _relay(self, replica: Replica, key, reply: httpx.Response, first: bytes, chunks):
        """The replica's stream as it comes; a replica lost mid-stream ends it with an error event and [DONE]."""
        try:
            chunk = first
            while True:
                if chunk:
                    # Each event is one step's new text: about a token, a block every block_size events.
                    replica.active_tokens[key] = replica.active_tokens.get(key, 0) + chunk.count(b"data: {")
                    yield chunk
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    return
                except CONNECTION_ERRORS as err:
                    self.mark_dead(replica, f"{type(err).__name__} mid-stream")
                    message = (f"the replica {replica.url} was lost mid-stream ({type(err).__name__}); the answer "
                               f"is incomplete: send the request again")
                    body = {"error": {"message": message, "type": "BadGatewayError", "param": None, "code": 502}}
                    yield f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
                    return
        finally:
            replica.active_tokens.pop(key, None)
            await reply.aclose()


def build_router_app(router: Router) -> FastAPI:
    """The router's FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health and /router/stats."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="kvlab cache-aware router", lifespan=lifespan)
    app.state.router = router

    async def forward(path: str, request: Request, chat: bool):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        return await router.forward(path, body, chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward("/v1/completions", request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await forward("/v1/chat/completions", request, chat=True)

    @app.get("/v1/models")
    async def models():
        for replica in router.replicas:
            if not replica.alive:
                continue
            try:
                reply = await router.client.get(replica.url + "/v1/models", timeout=10.0)
            except CONNECTION_ERRORS as err:
                router.mark_dead(replica, f"{type(err).__name__} on /v1/models")
                continue
            except httpx.TimeoutException:
                continue
            return Response(reply.content, status_code=reply.status_code,
                            media_type=reply.headers.get("content-type", "application/json"))
        return error(503, "no replica is alive to list its models; see GET /router/stats")

    @app.get("/health")
    async def health():
        alive = [r.url for r in router.replicas if r.alive]
        return JSONResponse(status_code=200 if alive else 503,
                            content={"alive": alive, "dead": [r.url for r in router.replicas if not r.alive]})

    @app.get("/router/stats")
    async def stats():
        return router.stats()

    return app


def router_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `kvlab router`."""
    parser.add_argument("--replica", action="append", required=True, metavar="URL",
                        help="a `kvlab serve` replica's base URL (repeat for each)")
    parser.add_argument("--kv-events", action="append", default=[], metavar="ENDPOINT",
                        help="each replica's KV-cache event publisher (its kv_events_config endpoint, e.g. "
                             "tcp://127.0.0.1:5557), in --replica order; needed by precise-prefix and kv-cost")
    parser.add_argument("--kv-events-replay", action="append", default=[], metavar="ENDPOINT",
                        help="each replica's replay endpoint, in --replica order: missed batches are fetched there")
    parser.add_argument("--policy", default="kv-cost", help=f"one of {', '.join(POLICIES)} (default kv-cost)")
    parser.add_argument("--overlap-score-weight", type=float, default=1.0,
                        help="kv-cost: weight of the blocks to prefill against the blocks being decoded")
    parser.add_argument("--approx-capacity-blocks", type=int, default=None,
                        help="approx-prefix: blocks remembered per replica (default: no bound)")
    parser.add_argument("--model", default=None,
                        help="the replicas' model (name, folder or hub id): its tokenizer and chat template "
                             "(default: the embedded model)")
    parser.add_argument("--hash-seed", default=os.environ.get("PYTHONHASHSEED"),
                        help="the replicas' block-hash seed (default: $PYTHONHASHSEED, as for kvlab serve)")
    parser.add_argument("--block-size", type=int, default=16, help="the replicas' --block-size (must be equal)")
    parser.add_argument("--load-poll-interval-s", type=float, default=0.1)
    parser.add_argument("--load-poll-timeout-s", type=float, default=0.5)
    parser.add_argument("--probe-interval-s", type=float, default=0.5)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    return parser


def router_from_args(args: argparse.Namespace) -> Router:
    """A Router for parsed `kvlab router` flags (the tokenizer loaded); ValueError naming a bad flag."""
    from kvlab.model.loader import load_tokenizer

    if args.policy not in POLICIES:  # before the tokenizer loads
        raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {args.policy!r}")
    return Router(args.replica, args.policy, kv_events=args.kv_events, kv_events_replay=args.kv_events_replay,
                  tokenizer=load_tokenizer(args.model), block_size=args.block_size, hash_seed=args.hash_seed,
                  overlap_score_weight=args.overlap_score_weight, approx_capacity_blocks=args.approx_capacity_blocks,
                  load_poll_interval_s=args.load_poll_interval_s, load_poll_timeout_s=args.load_poll_timeout_s,
                  probe_interval_s=args.probe_interval_s)


def run_router(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """`kvlab router`: build from the flags (a bad one exits 2 with its message) and serve until stopped."""
    import uvicorn

    try:
        router = router_from_args(args)
    except (ValueError, FileNotFoundError) as err:
        parser.exit(2, f"kvlab router: {err}\n")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    print(f"kvlab router: {len(router.replicas)} replicas, policy {router.policy_name}, on "
          f"http://{args.host}:{args.port}", file=sys.stderr)
    uvicorn.run(build_router_app(router), host=args.host, port=args.port, log_level=args.log_level)
