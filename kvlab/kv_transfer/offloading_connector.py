"""OffloadingConnector: a CPU tier behind the GPU prefix cache, as vLLM's offloading_connector.py.

kv_transfer_config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"kv_offloading_size": <bytes>, "eviction_policy": "lru" | "arc",
                                                    "offload_prompt_only": True, "async_loads": False}}

Scheduler side: an OffloadingManager (kvlab.kv_offload: LRU or ARC) over a CPUBackend of as many blocks as
kv_offloading_size bytes hold. At admission, after the GPU prefix-cache hit, the request's next full-block
hashes (kvlab.core.prefix_cache's chain, the same hashes the GPU cache uses) are looked up in the tier: the
leading run it holds is external, loaded into the request's newly allocated GPU blocks instead of being
computed (never the block of the prompt's last token: its logits are needed). After each step's tokens are
computed, every newly filled full block is stored to the tier (only prompt blocks when offload_prompt_only,
vLLM's default: decode blocks are rarely shared).

Worker side: a host pool [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] and
kvlab.kv_offload.worker's swap_in / swap_out over the runner's PagedKVCache pools: loads before the forward
pass (start_load_kv), saves after it (wait_for_save).

Saves complete within their step (wait_for_save copies before the pool can be rewritten). Loads do too by
default; with async_loads, as vLLM's loads on their own CUDA stream, start_load_kv hands each request's copies
to a worker thread and returns: get_num_new_matched_tokens answers load_async=True, the request waits in
WAITING_FOR_REMOTE_KVS holding its blocks while other requests run, and is scheduled once get_finished reports
its load (finished_recving). Its tier copies stay pinned until then.
"""

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvlab.core.prefix_cache import hash_block_tokens
from kvlab.kv_offload import ARCOffloadingManager, CPUBackend, LRUOffloadingManager, num_blocks_for_budget
from kvlab.kv_offload.worker import make_host_pool, swap_in, swap_out
from kvlab.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from kvlab.kv_transfer.config import KVTransferConfig
from kvlab.validation import check_block_size, check_positive_int

EVICTION_POLICIES = {"lru": LRUOffloadingManager, "arc": ARCOffloadingManager}
EXTRA_KEYS = ("kv_offloading_size", "eviction_policy", "offload_prompt_only", "async_loads")


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    """One step's copies: (CPU block, GPU block) to load before the forward pass, (GPU block, CPU block) to save
    after it; per request, so a test or a log can tell whose they are."""

    loads: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    saves: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


def _extra(config: KVTransferConfig) -> tuple[int, str, bool, bool]:
    """The connector's four settings (EXTRA_KEYS), checked, each error naming its field."""
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
    if config.kv_role != "kv_both":
        raise ValueError(f"kv_transfer_config.kv_role must be 'kv_both' for OffloadingConnector (it saves and loads "
                         f"its own copies), got {config.kv_role!r}")
    return size, policy, prompt_only, async_loads


class OffloadingConnector(KVConnectorBase_V1):
    """Offloads full blocks to a CPU tier and loads a request's prefix back from it when the GPU cache lost it."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int, bytes_per_block: int):
        super().__init__(config, role)
        self.kv_offloading_size, self.eviction_policy, self.offload_prompt_only, self.async_loads = _extra(config)
        self.block_size = check_block_size(block_size)
        self.bytes_per_block = check_positive_int("bytes_per_block", bytes_per_block)
        self.num_cpu_blocks = num_blocks_for_budget(self.kv_offloading_size, self.bytes_per_block)
        # Scheduler side.
        self.manager = None
        if role is KVConnectorRole.SCHEDULER:
            backend = CPUBackend(self.block_size, self.num_cpu_blocks)
            self.manager = EVICTION_POLICIES[self.eviction_policy](backend)
        self._requests: dict = {}                       # request id -> the scheduler's Request, while it runs
        self._block_ids: dict[str, list[int]] = {}      # request id -> its block table, as the runner is sent it
        self._hashes: dict[str, list[bytes]] = {}       # request id -> its full blocks' hashes so far
        self._hit_blocks: dict[str, int] = {}           # request id -> its GPU hit in blocks, at its last lookup
        self._num_stored: dict[str, int] = {}           # request -> blocks from its start already stored or held
        self._step_loads: dict[str, list[tuple[int, int]]] = {}
        self._loading: list[bytes] = []                 # hashes pinned by this step's loads
        self._loading_by_req: dict[str, list[bytes]] = {}  # async_loads: hashes pinned until a request's load ends
        self._storing: list[bytes] = []                 # hashes being stored by this step's saves
        self.num_loaded_blocks = 0
        self.num_stored_blocks = 0
        # Worker side.
        self.cache = None
        self.host_pool = None
        self._executor = None                           # async_loads: the thread that copies, one load at a time
        self._pending_loads: dict[str, object] = {}     # request id -> its load's future

    # ----- scheduler side -----
    def _block_hashes(self, request) -> list[bytes]:
        """The request's full-block hashes, prompt and outputs, extended as its tokens grow."""
        hashes = self._hashes.setdefault(request.request_id, [])
        size = self.block_size
        full = request.num_tokens // size
        if len(hashes) < full:
            parent = hashes[-1] if hashes else None
            for i in range(len(hashes), full):
                parent = hash_block_tokens(parent, request.token_ids_between(i * size, (i + 1) * size))
                hashes.append(parent)
        return hashes

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
        hit = self.manager.lookup(hashes) if hashes else 0
        return hit * size, self.async_loads and hit > 0

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
        self._num_stored[rid] = first + num_blocks  # earlier blocks came from the GPU cache, these from the tier
        if not num_blocks:
            return
        hashes = self._block_hashes(request)[first:first + num_blocks]
        spec = self.manager.prepare_load(hashes)
        self.manager.touch(hashes)
        if self.async_loads:
            self._loading_by_req[rid] = hashes
        else:
            self._loading += hashes
        self._step_loads[rid] = list(zip(spec.block_ids, block_ids[first:first + num_blocks]))
        self.num_loaded_blocks += num_blocks

    def build_connector_meta(self, scheduler_output) -> OffloadingConnectorMetadata:
        """Loads of this step's admissions, and saves of every block the step's tokens fill."""
        self._check_role(KVConnectorRole.SCHEDULER, "build_connector_meta")
        meta = OffloadingConnectorMetadata(loads=self._step_loads)
        self._step_loads = {}
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
            # A tier smaller than the run keeps its leading blocks: a later block is useless without them.
            hashes = self._block_hashes(request)[start:min(full, start + self.num_cpu_blocks)]
            out = self.manager.prepare_store(hashes)
            if out is None:  # every held copy is pinned by a load: these blocks are not offloaded
                continue
            by_hash = dict(zip(hashes, block_ids[start:full]))
            if out.block_hashes_to_store:
                meta.saves[rid] = [(by_hash[h], cpu) for h, cpu in zip(out.block_hashes_to_store,
                                                                        out.store_spec.block_ids)]
                self._storing += out.block_hashes_to_store
                self.num_stored_blocks += len(out.block_hashes_to_store)
        return meta

    def update_connector_output(self, finished_sending, finished_recving) -> None:
        """The step's copies are done (synchronously): unpin the loaded copies and mark the stored ones ready."""
        self._check_role(KVConnectorRole.SCHEDULER, "update_connector_output")
        if self._loading:
            self.manager.complete_load(self._loading)
            self._loading = []
        for rid in finished_recving or ():
            hashes = self._loading_by_req.pop(rid, None)
            if hashes:
                self.manager.complete_load(hashes)
        if self._storing:
            self.manager.complete_store(self._storing)
            self._storing = []

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._check_role(KVConnectorRole.SCHEDULER, "request_finished")
        for table in (self._requests, self._block_ids, self._hashes, self._hit_blocks):
            table.pop(request.request_id, None)
        self._num_stored.pop(request.request_id, None)
        # A load already ordered still runs (its copies stay pinned until get_finished reports it); one that was
        # not yet sent to the worker never starts, so its copies are unpinned now.
        if self._step_loads.pop(request.request_id, None) is not None and request.request_id in self._loading_by_req:
            self.manager.complete_load(self._loading_by_req.pop(request.request_id))
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

    def start_load_kv(self) -> None:
        """Copy every load of the step into the GPU pools: before returning, or (async_loads) on the copy thread."""
        loads = self._get_connector_metadata().loads
        if self.async_loads:
            if loads and self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvlab-offload")
            for rid, pairs in loads.items():
                self._pending_loads[rid] = self._executor.submit(
                    swap_in, self.host_pool, [c for c, _ in pairs], self.cache.k_pools, self.cache.v_pools,
                    [g for _, g in pairs])
            return
        pairs = [pair for pairs in loads.values() for pair in pairs]
        if pairs:
            swap_in(self.host_pool, [c for c, _ in pairs], self.cache.k_pools, self.cache.v_pools,
                    [g for _, g in pairs])

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: start_load_kv copied every layer already."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata) -> None:
        """Nothing per layer: whole blocks, every layer at once, are saved in wait_for_save."""

    def wait_for_save(self) -> None:
        """Copy every save of the step out of the GPU pools; it finishes before returning."""
        pairs = [pair for pairs in self._get_connector_metadata().saves.values() for pair in pairs]
        if pairs:
            swap_out(self.cache.k_pools, self.cache.v_pools, [g for g, _ in pairs], self.host_pool,
                     [c for _, c in pairs])

    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str] | None, set[str] | None]:
        """(None, the requests whose asynchronous loads finished since the last call); a failed copy is raised."""
        done = {rid for rid, future in self._pending_loads.items() if future.done()}
        for rid in done:
            self._pending_loads.pop(rid).result()  # a copy that raised is a bug, not a miss: let it surface
        return None, done or None

    def shutdown(self) -> None:
        """Finish the loads in flight and stop the copy thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
