"""SocketConnector: disaggregated prefill/decode over TCP, in the shape of vLLM's NixlConnector (nixl_connector.py).

A prefill instance (kv_role "kv_producer") computes a prompt and keeps its blocks; a decode instance
(kv_role "kv_consumer") pulls them by block id, as NIXL's one-sided reads do, instead of computing them:

    prefill: kv_transfer_config = {"kv_connector": "SocketConnector", "kv_role": "kv_producer",
                                   "kv_connector_extra_config": {"kv_host": "127.0.0.1", "kv_port": 0,
                                                                 "kv_send_timeout_s": 120}}
    decode:  kv_transfer_config = {"kv_connector": "SocketConnector", "kv_role": "kv_consumer",
                                   "kv_connector_extra_config": {"kv_pull_timeout_s": 30}}

The flow of one request (the proxy, kvlab.entrypoints.disagg_proxy, drives it):

1. the prefill server gets it with max_tokens=1 and kv_transfer_params {"do_remote_decode": true}. When it
   finishes (length-capped, its one token sampled) request_finished answers delay_free, so its blocks stay
   held, and returns the params the decode side needs: {"do_remote_prefill": true, "remote_block_ids",
   "remote_engine_id", "remote_host", "remote_port", "remote_request_id"}. The worker's side-channel server
   (a thread listening on kv_host:kv_port; port 0 picks a free one, reported through get_handshake_metadata)
   now serves those blocks, and only those, to whoever asks for that request;
2. the decode server gets the request with those params. At admission, after its own prefix-cache hit,
   get_num_new_matched_tokens offers the rest of the prompt but its last token (whose logits the decode
   side needs) as an asynchronous load: len(prompt) - 1 - num_computed_tokens tokens. The request waits in
   WAITING_FOR_REMOTE_KVS holding the blocks they land in, while a worker thread pulls the matching remote
   block ids and writes them into those blocks, then get_finished reports it in finished_recving;
3. once the pull is answered, the producer's get_finished reports the request in finished_sending and its
   blocks go back to the pool. A decode side that needs none of them (its own prefix cache holds the prompt
   up to its last token) says so with a release instead, as NIXL's decode side notifies its producer; if
   nobody pulls or releases within kv_send_timeout_s (the decode server died, the client went away) they go
   back then.

A pull that fails (connection refused, timeout, short read, an error reply such as an unknown request or a
block the request does not hold, or a layout that differs: block size, layers, KV heads, head dim, dtype)
is logged with its reason and its blocks are reported by get_block_ids_with_load_errors: the scheduler
recomputes the prompt from the first failed block, so the output is the same, only slower.

Wire format (one pull per TCP connection; every integer big-endian):

    frame    := u32 length, then length bytes of UTF-8 JSON
    request  := frame {"op": "read", "request_id": str, "block_ids": [int, ...]}
              | frame {"op": "release", "request_id": str}       (answered by frame {"ok": true} or an error)
    reply    := frame {"ok": false, "error": str}
              | frame {"ok": true, "block_size", "num_layers", "num_kv_heads", "head_dim", "dtype": str,
                       "num_blocks", "nbytes"} followed by nbytes raw bytes: the tensor
                       [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim] in dtype, C order

so one pulled block is num_layers * 2 * block_size * num_kv_heads * head_dim * dtype bytes, Chapter 1's
per-token KV size (kvlab.analysis.kv_size) times block_size.
"""

import json
import logging
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvlab.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from kvlab.kv_transfer.config import KVTransferConfig
from kvlab.validation import check_block_size

logger = logging.getLogger("kvlab.kv_transfer.socket_connector")

PRODUCER_KEYS = ("kv_host", "kv_port", "kv_send_timeout_s")
CONSUMER_KEYS = ("kv_pull_timeout_s",)
PARAM_KEYS = ("remote_block_ids", "remote_engine_id", "remote_host", "remote_port", "remote_request_id")
MAX_FRAME = 1 << 20          # a JSON header longer than this is not one of ours
REGISTER_GRACE_S = 5.0       # how long a pull waits for the producer's worker to hear of a request that just finished
FORGOTTEN_KEPT = 4096        # served or expired request ids remembered (refused at once), newest first


# ----- the wire -----

def send_frame(sock: socket.socket, obj: dict) -> None:
    """One length-prefixed JSON frame."""
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly n bytes, or ConnectionError naming how many came (a short read)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"short read: the peer closed after {got} of {n} bytes")
        got += k
    return buf


def recv_frame(sock: socket.socket) -> dict:
    """One length-prefixed JSON frame; ValueError if it is not one."""
    (length,) = struct.unpack(">I", recv_exact(sock, 4))
    if length > MAX_FRAME:
        raise ValueError(f"a frame header announces {length} bytes, more than {MAX_FRAME}: not a kvlab peer")
    obj = json.loads(recv_exact(sock, length).decode())
    if not isinstance(obj, dict):
        raise ValueError(f"a frame must hold a JSON object, got {type(obj).__name__}")
    return obj


def cache_layout(cache) -> dict:
    """What a pulled block's bytes mean: the fields both sides must agree on."""
    k_pool = cache.k_pools[0]
    _, block_size, num_kv_heads, head_dim = k_pool.shape
    return {"block_size": int(block_size), "num_layers": len(cache.k_pools), "num_kv_heads": int(num_kv_heads),
            "head_dim": int(head_dim), "dtype": str(k_pool.dtype).removeprefix("torch.")}


def gather_blocks(cache, block_ids: list[int]) -> torch.Tensor:
    """The blocks' K and V of every layer, on the CPU: [num_layers, 2, len(block_ids), block_size, heads, head_dim]."""
    index = torch.tensor(block_ids, dtype=torch.long, device=cache.k_pools[0].device)
    out = torch.stack([torch.stack([k.index_select(0, index), v.index_select(0, index)])
                       for k, v in zip(cache.k_pools, cache.v_pools)])
    return out.cpu().contiguous()


def scatter_blocks(cache, block_ids: list[int], data: torch.Tensor) -> None:
    """Write pulled blocks (gather_blocks' shape) into the pools at block_ids."""
    index = torch.tensor(block_ids, dtype=torch.long, device=cache.k_pools[0].device)
    for layer, (k, v) in enumerate(zip(cache.k_pools, cache.v_pools)):
        k.index_copy_(0, index, data[layer, 0].to(k.device))
        v.index_copy_(0, index, data[layer, 1].to(v.device))


def pull_blocks(host: str, port: int, request_id: str, block_ids: list[int], layout: dict,
                timeout_s: float) -> torch.Tensor:
    """Read a request's blocks from a producer: gather_blocks' tensor, or an exception that says what failed."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        send_frame(sock, {"op": "read", "request_id": request_id, "block_ids": list(block_ids)})
        head = recv_frame(sock)
        if not head.get("ok"):
            raise RuntimeError(f"the producer refused: {head.get('error', 'no reason given')}")
        theirs = {key: head.get(key) for key in layout}
        if theirs != layout:
            diff = ", ".join(f"{key} {theirs[key]!r} there, {layout[key]!r} here" for key in layout
                             if theirs[key] != layout[key])
            raise ValueError(f"layout mismatch: {diff}")
        if head.get("num_blocks") != len(block_ids):
            raise ValueError(f"asked for {len(block_ids)} blocks, the reply holds {head.get('num_blocks')}")
        dtype = getattr(torch, layout["dtype"])
        shape = (layout["num_layers"], 2, len(block_ids), layout["block_size"], layout["num_kv_heads"],
                 layout["head_dim"])
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if head.get("nbytes") != nbytes:
            raise ValueError(f"the reply announces {head.get('nbytes')} bytes, the layout needs {nbytes}")
        raw = recv_exact(sock, nbytes)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)


# ----- the config -----

def _check_extra(config: KVTransferConfig) -> dict:
    """The settings of this role, checked, each error naming its field."""
    extra = config.kv_connector_extra_config
    allowed = ()
    if config.is_kv_producer:
        allowed += PRODUCER_KEYS
    if config.is_kv_consumer:
        allowed += CONSUMER_KEYS
    for key in extra:
        if key in allowed:
            continue
        if key in PRODUCER_KEYS + CONSUMER_KEYS:
            side = "a producer's" if key in PRODUCER_KEYS else "a consumer's"
            raise ValueError(f"kv_connector_extra_config.{key} is {side} setting, but kv_role is {config.kv_role!r}")
        raise ValueError(f"kv_connector_extra_config has unknown key {key!r}; SocketConnector knows "
                         f"{', '.join(PRODUCER_KEYS + CONSUMER_KEYS)}")
    host = extra.get("kv_host", "127.0.0.1")
    if not isinstance(host, str) or not host:
        raise ValueError(f"kv_connector_extra_config.kv_host must be a non-empty host name or address, got {host!r}")
    port = extra.get("kv_port", 0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"kv_connector_extra_config.kv_port must be an integer in 0..65535 (0: a free port), "
                         f"got {port!r}")
    out = {"kv_host": host, "kv_port": port}
    for key, default in (("kv_send_timeout_s", 120.0), ("kv_pull_timeout_s", 30.0)):
        value = extra.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"kv_connector_extra_config.{key} must be a positive number of seconds, got {value!r}")
        out[key] = float(value)
    return out


@dataclass
class SocketConnectorMetadata(KVConnectorMetadata):
    """One step's orders: requests whose blocks the producer now serves (id -> block ids), pulls to start
    (id -> (local block ids, host, port, remote request id, remote block ids)), and producers to tell that a
    request needs none of its blocks."""

    reqs_to_send: dict[str, list[int]] = field(default_factory=dict)
    reqs_to_recv: dict[str, tuple[list[int], str, int, str, list[int]]] = field(default_factory=dict)
    reqs_to_release: dict[str, tuple[str, int, str]] = field(default_factory=dict)  # id -> (host, port, remote id)


def _remote_params(params: dict, rid: str) -> tuple[str, int, str, list[int]] | None:
    """(host, port, remote request id, remote block ids) from do_remote_prefill params, or None (logged)."""
    missing = [key for key in PARAM_KEYS if key not in params]
    problem = f"missing {', '.join(missing)}" if missing else None
    if problem is None:
        ids, port = params["remote_block_ids"], params["remote_port"]
        if not isinstance(ids, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in ids):
            problem = f"remote_block_ids must be a list of integers, got {ids!r}"
        elif isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= 65535:
            problem = f"remote_port must be a port number, got {port!r}"
        elif not isinstance(params["remote_host"], str) or not isinstance(params["remote_request_id"], str):
            problem = "remote_host and remote_request_id must be strings"
    if problem:
        logger.warning("request %s: kv_transfer_params asks for a remote prefill but %s; computing the prompt here",
                       rid, problem)
        return None
    return params["remote_host"], params["remote_port"], params["remote_request_id"], params["remote_block_ids"]


class SocketConnector(KVConnectorBase_V1):
    """A prefill instance serves a finished request's blocks over TCP; a decode instance pulls them by block id."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int, bytes_per_block: int = 0,
                 hash_seed: str | None = None):
        # hash_seed is unused: the producer's blocks are pulled by block id, not looked up by hash.
        # bytes_per_block (what the engine passes every connector) is not needed: the pools' own layout is sent.
        super().__init__(config, role)
        settings = _check_extra(config)
        self.kv_host, self.kv_port = settings["kv_host"], settings["kv_port"]
        self.kv_send_timeout_s, self.kv_pull_timeout_s = settings["kv_send_timeout_s"], settings["kv_pull_timeout_s"]
        self.block_size = check_block_size(block_size)
        self.engine_id = uuid.uuid4().hex
        # Scheduler side.
        self._handshake: dict | None = None
        self._reqs_to_send: dict[str, list[int]] = {}
        self._reqs_to_recv: dict = {}
        self._reqs_to_release: dict[str, tuple[str, int, str]] = {}
        self._pending_recv: dict[str, tuple[int, tuple]] = {}  # offered pulls: id -> (first block, remote)
        self._asked: set[str] = set()                   # requests already offered once (a re-admission is not)
        self.num_pulled_blocks = 0
        # Worker side.
        self.cache = None
        self.layout: dict | None = None
        self._lock = threading.Condition()
        self._serving: dict[str, tuple[set[int], float]] = {}   # producer: id -> (its block ids, deadline)
        self._done_sending: set[str] = set()
        self._forgotten: dict[str, None] = {}                    # served or expired: a later pull is refused
        self._server: socket.socket | None = None
        self._server_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._executor: ThreadPoolExecutor | None = None
        self._pulls: dict[str, object] = {}                      # consumer: id -> its pull's future
        self._load_errors: set[int] = set()
        self.bytes_sent = 0
        self.bytes_received = 0

    # ----- scheduler side -----
    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        """The producer worker's address, put into every request's params."""
        self._handshake = dict(metadata)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        self._check_role(KVConnectorRole.SCHEDULER, "get_num_new_matched_tokens")
        params, rid = request.kv_transfer_params, request.request_id
        if not self.config.is_kv_consumer or not params or not params.get("do_remote_prefill") or rid in self._asked:
            return 0, False
        self._asked.add(rid)
        remote = _remote_params(params, rid)
        if num_computed_tokens % self.block_size:
            raise ValueError(f"num_computed_tokens must be a whole number of blocks ({self.block_size} tokens), "
                             f"got {num_computed_tokens}")
        count = len(request.prompt_token_ids) - 1 - num_computed_tokens  # the last prompt token is computed here
        if remote is None:
            return 0, False
        first, last = num_computed_tokens // self.block_size, -(-(num_computed_tokens + count) // self.block_size)
        if count <= 0 or len(remote[3]) < last:
            if count > 0:
                logger.warning("request %s: the producer sent %d block ids, the prompt needs %d; computing it here",
                               rid, len(remote[3]), last)
            self._reqs_to_release[rid] = remote[:3]  # the producer need not wait for its timeout
            return 0, False
        self._pending_recv[rid] = (first, remote)
        return count, True

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        self._check_role(KVConnectorRole.SCHEDULER, "update_state_after_alloc")
        entry = self._pending_recv.pop(request.request_id, None)
        if entry is None or not num_external_tokens:
            return
        first, (host, port, remote_id, remote_ids) = entry
        last = -(-(first * self.block_size + num_external_tokens) // self.block_size)
        self._reqs_to_recv[request.request_id] = (list(block_ids[first:last]), host, port, remote_id,
                                                  list(remote_ids[first:last]))
        self.num_pulled_blocks += last - first

    def build_connector_meta(self, scheduler_output) -> SocketConnectorMetadata:
        self._check_role(KVConnectorRole.SCHEDULER, "build_connector_meta")
        meta = SocketConnectorMetadata(self._reqs_to_send, self._reqs_to_recv, self._reqs_to_release)
        self._reqs_to_send, self._reqs_to_recv, self._reqs_to_release = {}, {}, {}
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """A producer keeps a length-capped do_remote_decode request's blocks for the decode side to pull."""
        self._check_role(KVConnectorRole.SCHEDULER, "request_finished")
        rid = request.request_id
        self._asked.discard(rid)
        self._pending_recv.pop(rid, None)
        params = request.kv_transfer_params
        # Only a request stopped by max_tokens (the proxy's max_tokens=1) is continued elsewhere, as in vLLM; one
        # that met its stop token or was aborted is over. By name: the engine's enum sits above this layer.
        if (not self.config.is_kv_producer or not params or not params.get("do_remote_decode")
                or request.status.name != "FINISHED_LENGTH" or not block_ids):
            return False, None
        if self._handshake is None:
            raise RuntimeError("SocketConnector's scheduler half never got the worker's address "
                               "(set_xfer_handshake_metadata)")
        self._reqs_to_send[rid] = list(block_ids)
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(block_ids),
                      "remote_engine_id": self._handshake["engine_id"], "remote_host": self._handshake["host"],
                      "remote_port": self._handshake["port"], "remote_request_id": rid}

    # ----- worker side -----
    def register_kv_caches(self, cache) -> None:
        """Note the pools and their layout; a producer starts its side-channel server here."""
        self._check_role(KVConnectorRole.WORKER, "register_kv_caches")
        if cache.kv_cache_dtype != "auto":
            raise ValueError(f"SocketConnector copies K/V as stored; kv_cache_dtype={cache.kv_cache_dtype!r} also "
                             "keeps scales, which it does not copy: use kv_cache_dtype='auto'")
        self.cache, self.layout = cache, cache_layout(cache)
        if self.layout["block_size"] != self.block_size:
            raise ValueError(f"the cache's blocks hold {self.layout['block_size']} tokens but the connector's "
                             f"{self.block_size}")
        if self.config.is_kv_producer and self._server is None:
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                server.bind((self.kv_host, self.kv_port))
            except OSError as err:
                server.close()
                raise ValueError(f"kv_connector_extra_config: cannot listen on {self.kv_host}:{self.kv_port} "
                                 f"(kv_host, kv_port): {err}") from None
            server.listen(16)
            server.settimeout(0.2)  # so the thread notices shutdown
            self.kv_port = server.getsockname()[1]
            self._server = server
            self._server_thread = threading.Thread(target=self._serve, name="kvlab-kv-send", daemon=True)
            self._server_thread.start()

    def get_handshake_metadata(self) -> dict | None:
        """Where the decode side pulls from: {"engine_id", "host", "port"} (the port actually bound)."""
        return {"engine_id": self.engine_id, "host": self.kv_host, "port": self.kv_port}

    def start_load_kv(self) -> None:
        """Serve the newly finished requests' blocks; start this step's pulls on the pull threads."""
        meta = self._get_connector_metadata()
        if meta.reqs_to_send:
            deadline = time.monotonic() + self.kv_send_timeout_s
            with self._lock:
                for rid, ids in meta.reqs_to_send.items():
                    self._serving[rid] = (set(ids), deadline)
                self._lock.notify_all()
        if (meta.reqs_to_recv or meta.reqs_to_release) and self._executor is None:
            self._executor = ThreadPoolExecutor(2, thread_name_prefix="kvlab-kv-pull")
        for rid, order in meta.reqs_to_recv.items():
            self._pulls[rid] = self._executor.submit(self._pull, rid, *order)
        for rid, (host, port, remote_id) in meta.reqs_to_release.items():
            self._executor.submit(self._send_release, rid, host, port, remote_id)

    def _send_release(self, rid: str, host: str, port: int, remote_id: str) -> None:
        """Tell a producer that a request needs none of its blocks; a failure only leaves them to its timeout."""
        try:
            with socket.create_connection((host, port), timeout=self.kv_pull_timeout_s) as sock:
                send_frame(sock, {"op": "release", "request_id": remote_id})
                reply = recv_frame(sock)
            if not reply.get("ok"):
                raise RuntimeError(reply.get("error", "no reason given"))
        except Exception as err:  # noqa: BLE001 (the producer frees the blocks at its timeout anyway)
            logger.warning("request %s: releasing %s's blocks on %s:%d failed (%s: %s)", rid, remote_id, host, port,
                           type(err).__name__, err)

    def _pull(self, rid: str, local_ids: list[int], host: str, port: int, remote_id: str, remote_ids: list[int]):
        """One request's pull: its blocks written into local_ids, or every one of them reported failed."""
        try:
            data = pull_blocks(host, port, remote_id, remote_ids, self.layout, self.kv_pull_timeout_s)
            scatter_blocks(self.cache, local_ids, data)
            with self._lock:
                self.bytes_received += data.numel() * data.element_size()
        except Exception as err:  # noqa: BLE001 (any failure is a miss: the scheduler recomputes)
            logger.warning("request %s: pulling %d blocks of %s from %s:%d failed (%s: %s); they are recomputed",
                           rid, len(local_ids), remote_id, host, port, type(err).__name__, err)
            with self._lock:
                self._load_errors.update(local_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a pulled request runs only once its whole pull has landed."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata) -> None:
        """Nothing to save: the producer's blocks are read in place by the pull."""

    def wait_for_save(self) -> None:
        """Nothing to wait for: the blocks stay held until they are pulled (finished_sending)."""

    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose blocks were pulled or expired, requests whose pulls ended, well or not)."""
        now = time.monotonic()
        with self._lock:
            for rid, (_, deadline) in list(self._serving.items()):
                if now > deadline:
                    logger.warning("request %s: nobody pulled its blocks within kv_send_timeout_s=%g s; freeing them",
                                   rid, self.kv_send_timeout_s)
                    del self._serving[rid]
                    self._forget(rid)
                    self._done_sending.add(rid)
            sending, self._done_sending = self._done_sending, set()
        recving = {rid for rid, future in self._pulls.items() if future.done()}
        for rid in recving:
            self._pulls.pop(rid).result()  # _pull catches every failure; anything raised here is a bug
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def _serve(self) -> None:
        """The side channel: accept pulls until shutdown, one short-lived thread per connection."""
        while not self._stopping.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), name="kvlab-kv-send-conn", daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        """Answer one pull: the blocks, or an error reply saying why not."""
        with conn:
            conn.settimeout(self.kv_pull_timeout_s)
            rid, served = None, False
            try:
                ask = recv_frame(conn)
                rid, ids = ask.get("request_id"), ask.get("block_ids")
                if ask.get("op") == "release" and isinstance(rid, str):
                    served = self._wait_for(rid) is not None
                    send_frame(conn, {"ok": True} if served else {"ok": False, "error": f"request {rid!r} is "
                                                                                         "unknown here"})
                    return
                if ask.get("op") != "read" or not isinstance(rid, str) or not isinstance(ids, list):
                    send_frame(conn, {"ok": False, "error": "a pull is {'op': 'read', 'request_id': str, "
                                                            "'block_ids': [int, ...]}"})
                    return
                held = self._wait_for(rid)
                if held is None:
                    send_frame(conn, {"ok": False, "error": f"request {rid!r} is unknown here (never finished with "
                                                            "do_remote_decode, already pulled, or expired)"})
                    return
                foreign = [b for b in ids if b not in held]
                if foreign or not ids:
                    send_frame(conn, {"ok": False, "error": f"blocks {foreign or ids} are not blocks of request "
                                                            f"{rid!r}"})
                    return
                data = gather_blocks(self.cache, ids)
                payload = data.view(torch.uint8).reshape(-1).numpy()
                served = True  # from here a failure is the reader's loss: it recomputes, the blocks go back
                send_frame(conn, {"ok": True, **self.layout, "num_blocks": len(ids), "nbytes": payload.nbytes})
                conn.sendall(payload)
                with self._lock:
                    self.bytes_sent += payload.nbytes
            except (OSError, ValueError) as err:
                logger.warning("a pull%s failed on the producer's side: %s",
                               f" of request {rid}" if rid else "", err)
            finally:
                if served:
                    self._release(rid)

    def _wait_for(self, rid: str) -> set[int] | None:
        """The blocks the producer holds for rid; a request that finished a moment ago may not be registered yet."""
        deadline = time.monotonic() + REGISTER_GRACE_S
        with self._lock:
            while rid not in self._serving:
                left = deadline - time.monotonic()
                if rid in self._forgotten or left <= 0 or self._stopping.is_set():
                    return None
                self._lock.wait(left)
            return self._serving[rid][0]

    def _forget(self, rid: str) -> None:
        """Remember that rid is done with (the caller holds the lock), the oldest memory dropped past FORGOTTEN_KEPT."""
        self._forgotten[rid] = None
        if len(self._forgotten) > FORGOTTEN_KEPT:
            del self._forgotten[next(iter(self._forgotten))]

    def _release(self, rid: str) -> None:
        """After one answered pull the request's blocks are done with: report them in finished_sending."""
        with self._lock:
            if self._serving.pop(rid, None) is not None:
                self._forget(rid)
                self._done_sending.add(rid)

    def shutdown(self) -> None:
        """Stop the side-channel server and the pull threads."""
        self._stopping.set()
        with self._lock:
            self._lock.notify_all()
        if self._server is not None:
            self._server.close()
            if self._server_thread is not None:
                self._server_thread.join(5)
            self._server = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
