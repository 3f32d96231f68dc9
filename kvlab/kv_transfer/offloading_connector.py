"""OffloadingConnector: a CPU tier behind the GPU prefix cache, as vLLM's offloading_connector.py.

kv_transfer_config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"kv_offloading_size": <bytes>, "eviction_policy": "lru" | "arc",
                                                    "offload_prompt_only": True}}

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

Every copy completes within its step here. vLLM's run on a separate CUDA stream: a load may take longer than a
step, so get_num_new_matched_tokens answers load_async=True, the request waits in WAITING_FOR_REMOTE_KVS
holding its blocks while other requests run, and is scheduled once the worker's get_finished reports its load
(finished_recving); saves likewise may still be reading a request's blocks when it finishes, so
request_finished may delay their freeing until finished_sending names it. kvlab's copies are synchronous
(host memory on a CPU machine, or a pinned-memory copy that finishes before the pass), so none of that waits.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvlab.core.prefix_cache import hash_block_tokens
from kvlab.kv_offload import ARCOffloadingManager, CPUBackend, LRUOffloadingManager, num_blocks_for_budget
from kvlab.kv_offload.worker import make_host_pool, swap_in, swap_out
from kvlab.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from kvlab.kv_transfer.config import KVTransferConfig
from kvlab.validation import check_block_size, check_positive_int

EVICTION_POLICIES = {"lru": LRUOffloadingManager, "arc": ARCOffloadingManager}
EXTRA_KEYS = ("kv_offloading_size", "eviction_policy", "offload_prompt_only")


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    """One step's copies: (CPU block, GPU block) to load before the forward pass, (GPU block, CPU block) to save
    after it; per request, so a test or a log can tell whose they are."""

    loads: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    saves: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


def _extra(config: KVTransferConfig) -> tuple[int, str, bool]:
    """kv_offloading_size, eviction_policy and offload_prompt_only, checked, each error naming its field."""
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
    if config.kv_role != "kv_both":
        raise ValueError(f"kv_transfer_config.kv_role must be 'kv_both' for OffloadingConnector (it saves and loads "
                         f"its own copies), got {config.kv_role!r}")
    return size, policy, prompt_only


class OffloadingConnector(KVConnectorBase_V1):
    """Offloads full blocks to a CPU tier and loads a request's prefix back from it when the GPU cache lost it."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int, bytes_per_block: int):
        super().__init__(config, role)
        self.kv_offloading_size, self.eviction_policy, self.offload_prompt_only = _extra(config)
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
        self._num_stored: dict[str, int] = {}           # request -> blocks from its start already stored or held
        self._step_loads: dict[str, list[tuple[int, int]]] = {}
        self._loading: list[bytes] = []                 # hashes pinned by this step's loads
        self._storing: list[bytes] = []                 # hashes being stored by this step's saves
        self.num_loaded_blocks = 0
        self.num_stored_blocks = 0
        # Worker side.
        self.cache = None
        self.host_pool = None

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
        # At least the last token is computed: the model needs its logits.
        last = (request.num_tokens - 1) // size
        hashes = self._block_hashes(request)[first:last]
        hit = self.manager.lookup(hashes) if hashes else 0
        return hit * size, False

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        self._check_role(KVConnectorRole.SCHEDULER, "update_state_after_alloc")
        rid, size = request.request_id, self.block_size
        first = (request.num_computed_tokens - num_external_tokens) // size
        num_blocks = num_external_tokens // size
        self._requests[rid] = request
        self._num_stored[rid] = first + num_blocks  # earlier blocks came from the GPU cache, these from the tier
        if not num_blocks:
            return
        hashes = self._block_hashes(request)[first:first + num_blocks]
        spec = self.manager.prepare_load(hashes)
        self.manager.touch(hashes)
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
        if self._storing:
            self.manager.complete_store(self._storing)
            self._storing = []

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._check_role(KVConnectorRole.SCHEDULER, "request_finished")
        for table in (self._requests, self._block_ids, self._hashes):
            table.pop(request.request_id, None)
        self._num_stored.pop(request.request_id, None)
        self._step_loads.pop(request.request_id, None)
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
        """Copy every load of the step into the GPU pools; it finishes before returning."""
        pairs = [pair for pairs in self._get_connector_metadata().loads.values() for pair in pairs]
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
        return None, None
