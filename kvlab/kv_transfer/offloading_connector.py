"""OffloadingConnector: a CPU tier, and optionally a disk tier, behind the GPU prefix cache.

kv_transfer_config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"kv_offloading_size": <bytes>, "eviction_policy": "lru" | "arc",
                                                    "offload_prompt_only": True, "async_loads": False,
                                                    "disk_path": <directory>, "disk_size": <bytes>}}

The tiers, fastest first, each keyed by the same prefix block hashes (kvlab.core.prefix_cache's sha256 chain):

    GPU pool    the engine's own blocks; a hit costs nothing
    CPU tier    a host pool of kv_offloading_size bytes, LRU or ARC (kvlab.kv_offload.cpu, worker)
    disk tier   one checksummed safetensors file per block under disk_path, at most disk_size bytes of K/V,
                its own LRU over a DISK_MEDIUM backend (kvlab.kv_offload.disk); only with both disk keys

Scheduler side: an OffloadingManager per tier. At admission, after the GPU prefix-cache hit, the request's next
full-block hashes are looked up: the external run is the leading blocks each held by the CPU tier or the disk
tier, stopping at the first held by neither (a block is useless without the ones before it). It is loaded into
the request's newly allocated GPU blocks instead of being computed (never the block of the prompt's last token:
its logits are needed). After each step's tokens are computed, every newly filled full block is stored to the
CPU tier (only prompt blocks when offload_prompt_only, vLLM's default: decode blocks are rarely shared) and,
write-through, to the disk tier. A block loaded from disk is stored to the CPU tier again once the request
runs, so the next use finds it in the faster tier.

Worker side: a host pool [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] and
kvlab.kv_offload.worker's swap_in / swap_out over the runner's PagedKVCache pools: CPU loads before the forward
pass (start_load_kv), CPU saves after it (wait_for_save).

Saves to the CPU tier complete within their step (wait_for_save copies before the pool can be rewritten). CPU
loads do too by default; with async_loads, as vLLM's loads on their own CUDA stream, start_load_kv hands each
request's copies to a copy thread and returns: get_num_new_matched_tokens answers load_async=True, the request
waits in WAITING_FOR_REMOTE_KVS holding its blocks while other requests run, and is scheduled once get_finished
reports its load (finished_recving). Its tier copies stay pinned until then.

The disk tier's copies always outlast the step:

* writes: wait_for_save copies the step's new blocks out of the GPU pools into a fresh tensor (a snapshot: the
  pools and the host pool may be rewritten before the file is), and a writer thread saves one file per block.
  The disk manager marks a block ready only when get_finished reports the request's writes done
  (finished_sending), so a lookup never finds a file still being written. Files of blocks the disk tier
  evicts are deleted on the same thread, before the step's writes;
* reads: a request with any block only on disk loads asynchronously (load_async=True, even without
  async_loads): a reader thread reads each file, checks its sha256 and copies it into the GPU block. A missing
  or corrupted file is a miss, not an error: its file is deleted, its GPU block is reported by
  get_block_ids_with_load_errors (the scheduler recomputes from the first failed block), and when the load
  ends the scheduler's half finds the file gone and drops the block from the disk manager;
* restarts: the worker's handshake metadata carries its block layout, and the scheduler's half indexes
  disk_path at start, so a new engine on the same directory hits the blocks an earlier one wrote (only files
  whose header records this layout; the oldest beyond disk_size are deleted). The prefix hashes name only
  tokens, not the model: give each model its own disk_path.

The reader and the writer are Python threads: they share the GIL with the engine's loop, and with Python's
default switch interval a forward pass can wait for them (benchmarks/README.md measures it). A write that fails
(a full file system) leaves no file; the block is still marked ready and its first load
fails as a missing file, which recomputes it and drops it. shutdown() finishes every copy, read and write.

vLLM's OffloadingConnector (vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py) ships a CPU
backend only (vllm/v1/kv_offload/cpu.py); disk tiers come from LMCache (LMCacheConnectorV1 with local_disk and
max_local_disk_size: one file per chunk of tokens, LRU, docs/source/kv_cache/storage_backends/local_storage.rst)
or from newer vLLM offloading specs (vllm/v1/kv_offload/disk/spec.py, TieredOffloadingSpec: GPU -> CPU -> disk
with write-through on background I/O threads, extra config cpu_bytes_to_use, disk_path, disk_bytes_to_use).
kvlab keeps the disk behind the CPU tier in one connector and names its knobs after kv_offloading_size.
"""

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvlab.core.prefix_cache import hash_block_tokens, none_hash
from kvlab.kv_offload import (
    DISK_MEDIUM,
    ARCOffloadingManager,
    Backend,
    CPUBackend,
    LRUOffloadingManager,
    num_blocks_for_budget,
)
from kvlab.kv_offload.disk import DiskBlockError, DiskBlockStore
from kvlab.kv_offload.worker import make_host_pool, swap_in, swap_out
from kvlab.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from kvlab.kv_transfer.config import KVTransferConfig
from kvlab.validation import check_block_size, check_positive_int

EVICTION_POLICIES = {"lru": LRUOffloadingManager, "arc": ARCOffloadingManager}
EXTRA_KEYS = ("kv_offloading_size", "eviction_policy", "offload_prompt_only", "async_loads", "disk_path",
              "disk_size")


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    """One step's copies, per request so a test or a log can tell whose they are: CPU tier (CPU block, GPU block)
    loads before the forward pass and (GPU block, CPU block) saves after it; disk tier (block hash, GPU block)
    loads, (GPU block, block hash) writes, and the hashes whose files the disk tier evicted."""

    loads: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    saves: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    disk_loads: dict[str, list[tuple[bytes, int]]] = field(default_factory=dict)
    disk_saves: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)
    disk_removals: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class _Settings:
    """The connector's kv_connector_extra_config, checked (disk_path and disk_size None without a disk tier)."""

    kv_offloading_size: int
    eviction_policy: str
    offload_prompt_only: bool
    async_loads: bool
    disk_path: Path | None
    disk_size: int | None


def _extra(config: KVTransferConfig) -> _Settings:
    """The connector's settings (EXTRA_KEYS), checked, each error naming its field."""
    extra = config.kv_connector_extra_config
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ValueError(f"kv_connector_extra_config has unknown key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(unknown)}; OffloadingConnector knows {', '.join(EXTRA_KEYS)}")
    if "kv_offloading_size" not in extra:
        raise ValueError("kv_connector_extra_config.kv_offloading_size (bytes of CPU memory for KV copies) is "
                         "missing")
    size = extra["kv_offloading_size"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"kv_connector_extra_config.kv_offloading_size must be a positive number of bytes, "
                         f"got {size!r}")
    policy = extra.get("eviction_policy", "lru")
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"kv_connector_extra_config.eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, "
                         f"got {policy!r}")
    prompt_only = extra.get("offload_prompt_only", True)
    if not isinstance(prompt_only, bool):
        raise ValueError(f"kv_connector_extra_config.offload_prompt_only must be True or False, got {prompt_only!r}")
    async_loads = extra.get("async_loads", False)
    if not isinstance(async_loads, bool):
        raise ValueError(f"kv_connector_extra_config.async_loads must be True or False, got {async_loads!r}")
    disk_path, disk_size = _disk_extra(extra)
    if config.kv_role != "kv_both":
        raise ValueError(f"kv_transfer_config.kv_role must be 'kv_both' for OffloadingConnector (it saves and loads "
                         f"its own copies), got {config.kv_role!r}")
    return _Settings(size, policy, prompt_only, async_loads, disk_path, disk_size)


def _disk_extra(extra: dict) -> tuple[Path | None, int | None]:
    """disk_path and disk_size: both or neither; a directory (made if missing) and a positive number of bytes."""
    has_path, has_size = "disk_path" in extra, "disk_size" in extra
    if has_path != has_size:
        missing = "disk_size (bytes of K/V the disk tier may keep)" if has_path else \
            "disk_path (the directory of the disk tier's block files)"
        raise ValueError(f"kv_connector_extra_config.{missing} is missing: the disk tier needs disk_path and "
                         "disk_size together")
    if not has_path:
        return None, None
    path = extra["disk_path"]
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"kv_connector_extra_config.disk_path must be a directory path, got {path!r}")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"kv_connector_extra_config.disk_path {str(path)!r} exists and is not a directory")
    size = extra["disk_size"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"kv_connector_extra_config.disk_size must be a positive number of bytes, got {size!r}")
    return path, size


class OffloadingConnector(KVConnectorBase_V1):
    """Offloads full blocks to a CPU tier (and a disk tier) and loads a request's prefix back from them when the GPU
    cache lost it."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int, bytes_per_block: int,
                 hash_seed: str | None = None):
        super().__init__(config, role)
        settings = _extra(config)
        # The tiers name blocks by the engine's chain (its hash seed included), so a disk tier written by one
        # process is found by another only if both share the seed, as vLLM's connectors need PYTHONHASHSEED.
        self.none_hash = none_hash(hash_seed)
        self.kv_offloading_size, self.eviction_policy = settings.kv_offloading_size, settings.eviction_policy
        self.offload_prompt_only, self.async_loads = settings.offload_prompt_only, settings.async_loads
        self.disk_path, self.disk_size = settings.disk_path, settings.disk_size
        self.block_size = check_block_size(block_size)
        self.bytes_per_block = check_positive_int("bytes_per_block", bytes_per_block)
        self.num_cpu_blocks = num_blocks_for_budget(self.kv_offloading_size, self.bytes_per_block)
        self.num_disk_blocks = 0
        if self.disk_path is not None:
            if self.disk_size < self.bytes_per_block:
                raise ValueError(f"kv_connector_extra_config.disk_size={self.disk_size} bytes is less than one block "
                                 f"({self.bytes_per_block} bytes): raise it or leave the disk tier out")
            self.num_disk_blocks = self.disk_size // self.bytes_per_block
            try:
                self.disk_store = DiskBlockStore(self.disk_path)
            except OSError as e:
                raise ValueError(f"kv_connector_extra_config.disk_path {str(self.disk_path)!r} cannot be used as a "
                                 f"directory: {e}") from None
        else:
            self.disk_store = None
        # Scheduler side.
        self.manager = None
        self.disk_manager = None
        if role is KVConnectorRole.SCHEDULER:
            backend = CPUBackend(self.block_size, self.num_cpu_blocks)
            self.manager = EVICTION_POLICIES[self.eviction_policy](backend)
            if self.disk_store is not None:
                self.disk_manager = LRUOffloadingManager(Backend(DISK_MEDIUM, self.block_size, self.num_disk_blocks))
        self._requests: dict = {}                       # request id -> the scheduler's Request, while it runs
        self._block_ids: dict[str, list[int]] = {}      # request id -> its block table, as the runner is sent it
        self._hashes: dict[str, list[bytes]] = {}       # request id -> its full blocks' hashes so far
        self._hit_blocks: dict[str, int] = {}           # request id -> its GPU hit in blocks, at its last lookup
        self._num_stored: dict[str, int] = {}           # request -> blocks from its start already offered to the tiers
        self._step_loads: dict[str, list[tuple[int, int]]] = {}
        self._step_disk_loads: dict[str, list[tuple[bytes, int]]] = {}
        self._loading: list[bytes] = []                 # hashes pinned by this step's loads
        self._loading_by_req: dict[str, list[bytes]] = {}  # asynchronous loads: CPU hashes pinned until the load ends
        self._disk_loading_by_req: dict[str, list[bytes]] = {}  # disk hashes pinned until the request's load ends
        self._storing: list[bytes] = []                 # hashes being stored by this step's saves
        self._disk_storing: dict[str, list[bytes]] = {}  # request id -> its hashes whose files are being written
        self.num_loaded_blocks = 0                      # blocks loaded from the CPU tier
        self.num_stored_blocks = 0                      # blocks stored to the CPU tier
        self.num_disk_loaded_blocks = 0                 # blocks ordered loaded from the disk tier
        self.num_disk_stored_blocks = 0                 # blocks whose files were ordered written
        self.num_disk_dropped_blocks = 0                # disk blocks dropped because their file was gone or corrupt
        # Worker side.
        self.cache = None
        self.host_pool = None
        self._block_shape: tuple[int, ...] | None = None  # [num_layers, 2, block_size, num_kv_heads, head_dim]
        self._executor = None                           # async_loads: the thread that copies, one load at a time
        self._reader = None                             # the disk tier's reads
        self._writer = None                             # the disk tier's writes and deletions, in order
        self._pending_loads: dict[str, list] = {}       # request id -> its load's futures (CPU copy, disk reads)
        self._pending_writes: dict[str, list] = {}      # request id -> its writes' futures
        self._load_errors: set[int] = set()             # GPU blocks whose disk load failed, not yet reported
        self.num_disk_load_errors = 0
        self.num_disk_write_errors = 0

    # ----- scheduler side -----
    def _block_hashes(self, request) -> list[bytes]:
        """The request's full-block hashes, prompt and outputs, extended as its tokens grow."""
        hashes = self._hashes.setdefault(request.request_id, [])
        size = self.block_size
        full = request.num_tokens // size
        if len(hashes) < full:
            parent = hashes[-1] if hashes else self.none_hash
            for i in range(len(hashes), full):
                parent = hash_block_tokens(parent, request.token_ids_between(i * size, (i + 1) * size))
                hashes.append(parent)
        return hashes

    def _tier_run(self, hashes: list[bytes]) -> list[bool]:
        """Per leading block, whether it comes from disk (True) or the CPU tier (False); stops at one held by neither.

        The CPU tier is preferred where both hold a block: it is the faster one.
        """
        run = []
        for block_hash in hashes:
            if self.manager.lookup((block_hash,)):
                run.append(False)
            elif self.disk_manager is not None and self.disk_manager.lookup((block_hash,)):
                run.append(True)
            else:
                break
        return run

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        self._check_role(KVConnectorRole.SCHEDULER, "get_num_new_matched_tokens")
        size = self.block_size
        if num_computed_tokens % size:
            raise ValueError(f"num_computed_tokens must be a whole number of blocks ({size} tokens), "
                             f"got {num_computed_tokens}")
        first = num_computed_tokens // size
        self._hit_blocks[request.request_id] = first  # where the external tokens will start
        # At least the last token is computed: the model needs its logits.
        last = (request.num_tokens - 1) // size
        hashes = self._block_hashes(request)[first:last]
        run = self._tier_run(hashes) if hashes else []
        # A file read takes longer than a step: any block from disk makes the whole load asynchronous.
        return len(run) * size, bool(run) and (self.async_loads or any(run))

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        """The worker's block layout: index the disk tier's directory for the files an earlier engine wrote."""
        layout = metadata.get("disk_block_layout") if isinstance(metadata, dict) else None
        if self.disk_manager is None or layout is None:
            return
        found = self.disk_store.index(layout["shape"], layout["dtype"])
        # The newest files fit; the oldest beyond the budget go, as the LRU would have evicted them.
        overflow = max(0, len(found) - self.num_disk_blocks)
        for block_hash, _ in found[:overflow]:
            self.disk_store.remove(block_hash)
        hashes = [h for h, _ in found[overflow:] if self.disk_manager.lookup((h,)) == 0]
        if hashes:  # oldest first, so the newest end up the most recently used
            self.disk_manager.prepare_store(hashes)
            self.disk_manager.complete_store(hashes)

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        self._check_role(KVConnectorRole.SCHEDULER, "update_state_after_alloc")
        rid, size = request.request_id, self.block_size
        # From the lookup, not request.num_computed_tokens: a scheduler may update that before or after this call.
        # Without a lookup (a scheduler that asks nothing more of the connector after a failed load) nothing loads.
        first = self._hit_blocks.pop(rid, None)
        if first is None:
            if num_external_tokens:
                raise ValueError(f"request {rid!r} has {num_external_tokens} external tokens but was never looked up")
            first = request.num_computed_tokens // size
        num_blocks = num_external_tokens // size
        self._requests[rid] = request
        # From the GPU hit on: blocks loaded from the CPU tier are skipped as held, those loaded from disk are
        # stored to the CPU tier again.
        self._num_stored[rid] = first
        if not num_blocks:
            return
        hashes = self._block_hashes(request)[first:first + num_blocks]
        run = self._tier_run(hashes)
        if len(run) != num_blocks:
            raise ValueError(f"request {rid!r} has {num_blocks} external blocks but the tiers hold only {len(run)} "
                             "of them: load only what get_num_new_matched_tokens offered, in the same step")
        targets = block_ids[first:first + num_blocks]
        cpu = [(h, gpu) for h, gpu, on_disk in zip(hashes, targets, run) if not on_disk]
        disk = [(h, gpu) for h, gpu, on_disk in zip(hashes, targets, run) if on_disk]
        asynchronous = self.async_loads or bool(disk)
        if cpu:
            cpu_hashes = [h for h, _ in cpu]
            spec = self.manager.prepare_load(cpu_hashes)
            self.manager.touch(cpu_hashes)
            if asynchronous:
                self._loading_by_req[rid] = cpu_hashes
            else:
                self._loading += cpu_hashes
            self._step_loads[rid] = list(zip(spec.block_ids, [gpu for _, gpu in cpu]))
            self.num_loaded_blocks += len(cpu)
        if disk:
            disk_hashes = [h for h, _ in disk]
            self.disk_manager.prepare_load(disk_hashes)
            self._disk_loading_by_req[rid] = disk_hashes
            self._step_disk_loads[rid] = disk
            self.num_disk_loaded_blocks += len(disk)
        if self.disk_manager is not None:
            self.disk_manager.touch(hashes)  # a use of the prefix, whichever tier served it

    def build_connector_meta(self, scheduler_output) -> OffloadingConnectorMetadata:
        """Loads of this step's admissions, and saves of every block the step's tokens fill."""
        self._check_role(KVConnectorRole.SCHEDULER, "build_connector_meta")
        meta = OffloadingConnectorMetadata(loads=self._step_loads, disk_loads=self._step_disk_loads)
        self._step_loads, self._step_disk_loads = {}, {}
        size = self.block_size
        for new in scheduler_output.scheduled_new_reqs:
            self._block_ids[new.req_id] = list(new.block_ids)
        cached = scheduler_output.scheduled_cached_reqs
        for rid, resumed, new_ids in zip(cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids):
            if resumed:
                self._block_ids[rid] = list(new_ids)
            else:
                self._block_ids[rid].extend(new_ids)
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            request, block_ids = self._requests[rid], self._block_ids[rid]
            end = request.num_computed_tokens + n
            if self.offload_prompt_only:
                end = min(end, len(request.prompt_token_ids))
            full = end // size
            start = self._num_stored.get(rid, 0)
            if full <= start:
                continue
            self._num_stored[rid] = full
            by_hash = dict(zip(self._block_hashes(request)[start:full], block_ids[start:full]))
            # A tier smaller than the run keeps its leading blocks: a later block is useless without them.
            hashes = self._block_hashes(request)[start:min(full, start + self.num_cpu_blocks)]
            out = self.manager.prepare_store(hashes)
            if out is not None and out.block_hashes_to_store:  # None: every held copy is pinned by a load
                meta.saves[rid] = [(by_hash[h], cpu) for h, cpu in zip(out.block_hashes_to_store,
                                                                        out.store_spec.block_ids)]
                self._storing += out.block_hashes_to_store
                self.num_stored_blocks += len(out.block_hashes_to_store)
            if self.disk_manager is not None:  # write-through: the same blocks, to disk
                hashes = self._block_hashes(request)[start:min(full, start + self.num_disk_blocks)]
                out = self.disk_manager.prepare_store(hashes)
                if out is not None:
                    meta.disk_removals += out.block_hashes_evicted
                    if out.block_hashes_to_store:
                        meta.disk_saves[rid] = [(by_hash[h], h) for h in out.block_hashes_to_store]
                        self._disk_storing.setdefault(rid, []).extend(out.block_hashes_to_store)
                        self.num_disk_stored_blocks += len(out.block_hashes_to_store)
        return meta

    def update_connector_output(self, finished_sending, finished_recving) -> None:
        """The step's copies are done: unpin the loaded copies, mark stored ones ready, drop disk blocks found gone."""
        self._check_role(KVConnectorRole.SCHEDULER, "update_connector_output")
        if self._loading:
            self.manager.complete_load(self._loading)
            self._loading = []
        for rid in finished_recving or ():
            hashes = self._loading_by_req.pop(rid, None)
            if hashes:
                self.manager.complete_load(hashes)
            hashes = self._disk_loading_by_req.pop(rid, None)
            if hashes:
                self.disk_manager.complete_load(hashes)
                self._drop_missing_files(hashes)
        if self._storing:
            self.manager.complete_store(self._storing)
            self._storing = []
        # The worker names a request in finished_sending once every disk write ordered for it so far has ended.
        for rid in finished_sending or ():
            hashes = self._disk_storing.pop(rid, None)
            if hashes:
                self.disk_manager.complete_store(hashes)

    def _drop_missing_files(self, hashes: list[bytes]) -> None:
        """Forget the disk blocks of a finished load whose files are gone: the reader deletes a file it found missing
        or corrupt before it reports the load, so a file gone now means that block failed. A block another load
        still pins waits for that load's end (which fails too, and drops it)."""
        for block_hash in dict.fromkeys(hashes):
            if self.disk_store.contains(block_hash):
                continue
            try:
                self.disk_manager.remove((block_hash,))
            except ValueError:  # still pinned by another load, or already dropped
                continue
            self.num_disk_dropped_blocks += 1

    def has_pending_saves(self) -> bool:
        """Whether disk writes are in flight (their blocks not yet found by lookups): step to let them land."""
        return bool(self._disk_storing)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._check_role(KVConnectorRole.SCHEDULER, "request_finished")
        rid = request.request_id
        for table in (self._requests, self._block_ids, self._hashes, self._hit_blocks):
            table.pop(rid, None)
        self._num_stored.pop(rid, None)
        # A load already ordered still runs (its copies stay pinned until get_finished reports it); one that was
        # not yet sent to the worker never starts, so its copies are unpinned now. Disk writes go on: they read a
        # snapshot, not the request's blocks.
        unsent_cpu = self._step_loads.pop(rid, None) is not None
        unsent_disk = self._step_disk_loads.pop(rid, None) is not None
        if unsent_cpu and rid in self._loading_by_req:
            self.manager.complete_load(self._loading_by_req.pop(rid))
        if unsent_disk:
            self.disk_manager.complete_load(self._disk_loading_by_req.pop(rid))
        return False, None

    # ----- worker side -----
    def register_kv_caches(self, cache) -> None:
        """Allocate the host pool to match the runner's pools; refused for quantized pools (their scales stay)."""
        self._check_role(KVConnectorRole.WORKER, "register_kv_caches")
        k_pool = cache.k_pools[0]
        if cache.kv_cache_dtype != "auto":
            raise ValueError(f"OffloadingConnector copies K/V as stored; kv_cache_dtype={cache.kv_cache_dtype!r} "
                             "also keeps scales, which it does not copy: use kv_cache_dtype='auto'")
        num_blocks_, block_size, num_kv_heads, head_dim = k_pool.shape
        if block_size != self.block_size:
            raise ValueError(f"the cache's blocks hold {block_size} tokens but the connector's {self.block_size}")
        per_block = len(cache.k_pools) * 2 * block_size * num_kv_heads * head_dim * k_pool.element_size()
        if per_block != self.bytes_per_block:
            raise ValueError(f"the cache's blocks take {per_block} bytes but the connector was sized for "
                             f"{self.bytes_per_block}")
        self.cache = cache
        self.host_pool = make_host_pool(self.num_cpu_blocks, len(cache.k_pools), block_size, num_kv_heads, head_dim,
                                        k_pool.dtype, pin_memory=k_pool.is_cuda)
        self._block_shape = (len(cache.k_pools), 2, block_size, num_kv_heads, head_dim)

    def get_handshake_metadata(self) -> dict | None:
        """With a disk tier, the block layout its files must record, for the scheduler's half to index them."""
        if self.disk_store is None or self.cache is None:
            return None
        return {"disk_block_layout": {"shape": list(self._block_shape), "dtype": str(self.cache.k_pools[0].dtype)}}

    def start_load_kv(self) -> None:
        """Copy every CPU load of the step into the GPU pools, before returning or (async_loads) on the copy thread;
        hand every disk load to the reader thread."""
        meta = self._get_connector_metadata()
        sync_pairs = []
        for rid, pairs in meta.loads.items():
            if self.async_loads:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvlab-offload")
                self._pending_loads.setdefault(rid, []).append(self._executor.submit(
                    swap_in, self.host_pool, [c for c, _ in pairs], self.cache.k_pools, self.cache.v_pools,
                    [g for _, g in pairs]))
            else:
                sync_pairs += pairs
        if sync_pairs:
            swap_in(self.host_pool, [c for c, _ in sync_pairs], self.cache.k_pools, self.cache.v_pools,
                    [g for _, g in sync_pairs])
        for rid, pairs in meta.disk_loads.items():
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvlab-disk-read")
            self._pending_loads.setdefault(rid, []).append(self._reader.submit(self._read_blocks, list(pairs)))

    def _read_blocks(self, pairs: list[tuple[bytes, int]]) -> list[int]:
        """Read, verify and copy each (block hash, GPU block); the GPU blocks that failed (their files deleted)."""
        failed = []
        for block_hash, gpu in pairs:
            try:
                block = self.disk_store.load(block_hash)  # [num_layers, 2, block_size, num_kv_heads, head_dim]
                if tuple(block.shape) != self._block_shape or block.dtype != self.cache.k_pools[0].dtype:
                    raise DiskBlockError(f"block is {tuple(block.shape)} {block.dtype}, the pools hold "
                                         f"{self._block_shape} {self.cache.k_pools[0].dtype}")
            except DiskBlockError:
                self.disk_store.remove(block_hash)
                failed.append(gpu)
                continue
            for layer, (k_pool, v_pool) in enumerate(zip(self.cache.k_pools, self.cache.v_pools)):
                k_pool[gpu] = block[layer, 0].to(k_pool.device)
                v_pool[gpu] = block[layer, 1].to(v_pool.device)
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: start_load_kv copied every layer already."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata) -> None:
        """Nothing per layer: whole blocks, every layer at once, are saved in wait_for_save."""

    def wait_for_save(self) -> None:
        """Copy every CPU save of the step out of the GPU pools before returning; snapshot the disk writes' blocks and
        hand them, after the step's file deletions, to the writer thread."""
        meta = self._get_connector_metadata()
        pairs = [pair for pairs in meta.saves.values() for pair in pairs]
        if pairs:
            swap_out(self.cache.k_pools, self.cache.v_pools, [g for g, _ in pairs], self.host_pool,
                     [c for _, c in pairs])
        if not (meta.disk_saves or meta.disk_removals):
            return
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvlab-disk-write")
        if meta.disk_removals:  # one thread, in order: an evicted file is gone before its hash can be written again
            self._writer.submit(self._remove_files, list(meta.disk_removals))
        for rid, saves in meta.disk_saves.items():
            snapshot = torch.empty((len(saves), *self._block_shape), dtype=self.cache.k_pools[0].dtype)
            swap_out(self.cache.k_pools, self.cache.v_pools, [g for g, _ in saves], snapshot, range(len(saves)))
            self._pending_writes.setdefault(rid, []).append(
                self._writer.submit(self._write_blocks, snapshot, [h for _, h in saves]))

    def _remove_files(self, block_hashes: list[bytes]) -> None:
        for block_hash in block_hashes:
            self.disk_store.remove(block_hash)

    def _write_blocks(self, snapshot: torch.Tensor, block_hashes: list[bytes]) -> None:
        """Write snapshot[i] [num_layers, 2, block_size, num_kv_heads, head_dim] as block_hashes[i]'s file."""
        for block, block_hash in zip(snapshot, block_hashes):
            try:
                self.disk_store.save(block_hash, block)
            except OSError:  # no file: the block's first load fails as missing and recomputes it
                self.num_disk_write_errors += 1

    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose disk writes so far all ended, requests whose asynchronous loads ended); a CPU copy that
        raised is raised, a disk read that failed is reported by get_block_ids_with_load_errors."""
        recving = set()
        for rid, futures in list(self._pending_loads.items()):
            if all(future.done() for future in futures):
                for future in self._pending_loads.pop(rid):
                    failed = future.result()  # a copy that raised is a bug, not a miss: let it surface
                    if failed:
                        self._load_errors.update(failed)
                        self.num_disk_load_errors += len(failed)
                recving.add(rid)
        sending = set()
        for rid, futures in list(self._pending_writes.items()):
            if all(future.done() for future in futures):
                for future in self._pending_writes.pop(rid):
                    future.result()
                sending.add(rid)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks whose disk file was missing or corrupt, in loads get_finished reported since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Finish the loads, reads and writes in flight and stop their threads."""
        for name in ("_executor", "_reader", "_writer"):
            executor = getattr(self, name)
            if executor is not None:
                executor.shutdown(wait=True)
                setattr(self, name, None)
