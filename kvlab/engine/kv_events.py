"""Publishing the block pool's KV-cache events over ZeroMQ, as vLLM's engines do (vllm/distributed/kv_events.py).

    kv_events_config = {"enable_kv_cache_events": True, "publisher": "zmq",
                        "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}

After every step that changed its prefix cache the engine hands one KVEventBatch (kvlab.core.kv_events) to a
publisher. The ZMQ publisher sends it on a PUB socket as three frames,

    [topic, sequence number (8 bytes, big-endian), msgpack of the batch's wire form]

numbering batches 0, 1, 2, ... A subscriber that sees a gap in the numbers (a PUB socket drops messages for
a slow or late subscriber) asks the replay socket (a ROUTER) for everything from a number on: it sends that
number (8 bytes) and gets back, from the publisher's ring of the last buffer_steps batches, one message
[sequence number, payload] per batch still held, then [-1 as 8 signed bytes, b""] to end. Older batches are
gone: such a subscriber must rebuild its index another way (llm-d's indexer drops the replica's entries).
These are vLLM's frames and defaults, so a subscriber written for vLLM reads kvlab's events.

The sockets live on one thread of their own (ZMQ sockets are not thread-safe), fed by a queue, so a step
only enqueues; a full queue drops the batch and counts it, since a serving engine must not block on a slow
network. An endpoint's port may be "*" (a free port); the bound address is then `endpoint` /
`replay_endpoint` on the publisher.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass, fields

from kvlab.core.kv_events import KVEventBatch, as_wire
from kvlab.validation import config_mapping

END_SEQ = (-1).to_bytes(8, "big", signed=True)
PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig: whether the pool records events, which publisher sends them, and where."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self):
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config.enable_kv_cache_events must be True or False, "
                             f"got {self.enable_kv_cache_events!r}")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}, "
                             f"got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or "://" not in value:
                raise ValueError(f"kv_events_config.{name} must be a ZMQ endpoint such as 'tcp://127.0.0.1:5557', "
                                 f"got {value!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config.topic must be a string, got {self.topic!r}")

    @classmethod
    def from_value(cls, value) -> KVEventsConfig:
        """A config from a KVEventsConfig, a dict with vLLM's keys, or that dict as a JSON string."""
        if isinstance(value, cls):
            return value
        return cls(**config_mapping("kv_events_config", value, [f.name for f in fields(cls)]))


class NullEventPublisher:
    """Drops every batch: events recorded (for a test or a widget) but sent nowhere."""

    endpoint = replay_endpoint = None

    def publish(self, batch: KVEventBatch) -> None:
        """Send one batch (here: nowhere)."""

    def shutdown(self) -> None:
        """Nothing to stop."""


class ZmqEventPublisher:
    """Sends batches on a PUB socket with sequence numbers, and replays the last buffer_steps on request."""

    def __init__(self, config: KVEventsConfig):
        import zmq

        self.config = config
        self.num_published = 0
        self.num_dropped = 0  # batches a full queue could not take
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            self._pub.bind(config.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = None
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as err:
            self._close()
            raise ValueError(f"kv_events_config: cannot bind {config.endpoint!r} / {config.replay_endpoint!r} "
                             f"({err})") from None
        self._thread = threading.Thread(target=self._run, name="kvlab-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        """Queue one batch for sending; dropped (and counted) if the queue is full."""
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)

    def _run(self) -> None:
        import msgpack
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        topic, seq = self.config.topic.encode(), 0
        try:
            while True:
                if self._replay is not None and poller.poll(0):
                    self._serve_replay()
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if batch is None:
                    return
                payload = msgpack.packb(as_wire(batch), use_bin_type=True)
                self._pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
                self._buffer.append((seq, payload))
                seq += 1
                self.num_published += 1
        finally:
            self._close()

    def _serve_replay(self) -> None:
        """One replay request: every held batch from the asked number on, then the end marker."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:  # [client id, b"", start (8 bytes)]
            return  # not a request this socket understands; a REQ/DEALER client times out
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", END_SEQ, b""])

    def _close(self) -> None:
        for sock, linger_ms in ((self._pub, 200), (self._replay, 0)):  # a moment for the last batches to leave
            if sock is not None:
                sock.close(linger=linger_ms)
        self._context.term()


def make_publisher(config: KVEventsConfig):
    """The publisher config.publisher names (vLLM's EventPublisherFactory)."""
    return ZmqEventPublisher(config) if config.publisher == "zmq" else NullEventPublisher()
