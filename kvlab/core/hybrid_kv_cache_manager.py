"""The engine's KV cache manager for a hybrid model: the scheduler's calls, answered by a HybridKVCacheCoordinator.

In vLLM V1 the scheduler always talks to one KVCacheManager (vllm/v1/core/kv_cache_manager.py), which hands
every call to a coordinator with one manager per KV-cache group. kvlab's Chapter 4 KVCacheManager serves a
model whose layers are all full attention; HybridKVCacheManager serves one with sliding-window (or chunked local)
layers, under the same calls, so kvlab.engine.scheduler.Scheduler runs both unchanged:

    hits, num_cached = manager.get_computed_blocks(request_id, token_ids)     # a ComputedBlocks, and its tokens
    manager.num_blocks_to_allocate(request_id, n, hits)                       # what admission takes from the pool
    manager.allocate_blocks(request_id, n, hits, new_token_ids=...)           # every group grows
    manager.get_block_ids(request_id)                                         # one block table per group
    manager.remove_skipped_blocks(request_id, num_computed_tokens)            # after a step: windows give back

Block ids are a tuple of lists, one per group, as vLLM's scheduler sends them to its runner. What the scheduler
counts in blocks (preemption's gain, hits shared with earlier requests) is over req_to_blocks, which lists each
request's real blocks of every group (the null block left out), position by position.

Not supported for hybrid models, as the engine's configuration says before anything is built: speculative
decoding's draft tokens, swap preemption (vLLM V1 has recompute only) and Orca's contiguous reservations.
"""

from collections.abc import Hashable, Sequence

from kvlab.core.block_pool import KVCacheBlock
from kvlab.core.block_views import pool_block_view
from kvlab.core.kv_cache_coordinator import HybridKVCacheCoordinator
from kvlab.core.kv_cache_interface import KVCacheGroupSpec, SlidingWindowSpec


class ComputedBlocks(list):
    """A prefix hit in every group: as a list, its real blocks (null entries left out) position by position;
    per_group, each group's list as the coordinator found it; token_ids, the tokens it covers."""

    def __init__(self, per_group: Sequence[Sequence[KVCacheBlock]], token_ids: Sequence[int], null_block):
        super().__init__(_interleave(per_group, null_block))
        self.per_group = [list(blocks) for blocks in per_group]
        self.token_ids = list(token_ids)


def _interleave(tables: Sequence[Sequence[KVCacheBlock]], null_block) -> list[KVCacheBlock]:
    """Every group's real blocks, position by position (a hit's blocks come before any block after the hit)."""
    out = []
    for position in range(max((len(t) for t in tables), default=0)):
        for table in tables:
            if position < len(table) and table[position] is not null_block:
                out.append(table[position])
    return out


class _Tables:
    """req_to_blocks, read-only: request id -> its real blocks of every group, position by position."""

    def __init__(self, coordinator: HybridKVCacheCoordinator):
        self._coordinator = coordinator

    def __getitem__(self, request_id) -> list[KVCacheBlock]:
        c = self._coordinator
        return _interleave([m.req_to_blocks[request_id] for m in c.managers], c.null_block)

    def get(self, request_id, default=None):
        return self[request_id] if request_id in self else default

    def __contains__(self, request_id) -> bool:
        return request_id in self._coordinator.num_tokens

    def __iter__(self):
        return iter(list(self._coordinator.num_tokens))

    def __len__(self) -> int:
        return len(self._coordinator.num_tokens)

    def items(self):
        return [(rid, self[rid]) for rid in self]


class HybridKVCacheManager:
    """One block pool for every KV-cache group of a hybrid model, under Chapter 4's KVCacheManager calls."""

    def __init__(self, kv_cache_groups: Sequence[KVCacheGroupSpec], num_blocks: int,
                 enable_prefix_caching: bool = True, prefix_caching_hash_algo: str = "sha256",
                 hash_seed: str | None = None):
        self.coordinator = HybridKVCacheCoordinator(kv_cache_groups, num_blocks, enable_prefix_caching,
                                                    prefix_caching_hash_algo, hash_seed)
        sizes = self.coordinator.block_sizes
        if len(sizes) != 1:
            raise ValueError(f"the groups' block sizes differ ({sizes}): kvlab's engine runs one block size")
        self.block_size = sizes[0]
        self.kv_cache_groups = self.coordinator.kv_cache_groups
        self.block_pool = self.coordinator.block_pool
        self.null_block = self.coordinator.null_block
        self.enable_prefix_caching = enable_prefix_caching
        self.arena = None  # Orca's contiguous reservations are not for hybrid models
        self.req_to_blocks = _Tables(self.coordinator)
        self.num_cached_tokens: dict[object, int] = {}

    # ----- what the scheduler and the engine read -----
    @property
    def num_blocks(self) -> int:
        """Blocks that can be lent (the pool less the null block)."""
        return self.coordinator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.coordinator.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request in some group (the null block not counted)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_tokens(self) -> dict:
        """Request id -> tokens it holds slots for."""
        return self.coordinator.num_tokens

    @property
    def block_tables(self) -> dict[object, tuple[list[int], ...]]:
        """Request id -> its block table in every group (0, the null block, where a group gave a block back)."""
        return {rid: self.coordinator.get_block_ids(rid) for rid in self.coordinator.num_tokens}

    @property
    def queries(self) -> int:
        return self.coordinator.queries

    @property
    def hits(self) -> int:
        return self.coordinator.hits

    @property
    def preempted_queries(self) -> int:
        return self.coordinator.preempted_queries

    @property
    def preempted_hits(self) -> int:
        return self.coordinator.preempted_hits

    @property
    def hit_rate(self) -> float:
        return self.coordinator.hit_rate

    @property
    def prefill_tokens_saved(self) -> int:
        return self.coordinator.hits

    # ----- the scheduler's calls -----
    def get_computed_blocks(self, request_id, token_ids: Sequence[int],
                            extra_keys: Hashable | None = None) -> tuple[ComputedBlocks, int]:
        """The longest prefix every group serves from the cache, and its length in tokens (changes nothing)."""
        if extra_keys is not None:
            raise ValueError("extra_keys (a cache salt) is not supported for hybrid models")
        per_group, num_cached = self.coordinator.get_computed_blocks(request_id, token_ids)
        return ComputedBlocks(per_group, token_ids[:num_cached], self.null_block), num_cached

    def num_blocks_to_allocate(self, request_id, num_new_tokens: int, computed_blocks=(),
                               num_lookahead_tokens: int = 0) -> int:
        """Blocks allocate_blocks would take from the free queue, less those the windows give back first."""
        return self.coordinator.num_blocks_to_allocate(request_id, num_new_tokens,
                                                       self._per_group(computed_blocks), num_lookahead_tokens)

    def allocate_blocks(self, request_id, num_new_tokens: int, computed_blocks=(),
                        new_token_ids: Sequence[int] | None = None, extra_keys: Hashable | None = None,
                        num_draft_tokens: int = 0, num_lookahead_tokens: int = 0,
                        num_query_tokens: int | None = None, preempted: bool = False) -> None:
        """Grow the request by num_new_tokens in every group (after its hits, at admission)."""
        if num_draft_tokens or extra_keys is not None:
            raise ValueError("draft tokens and extra_keys are not supported for hybrid models")
        running = request_id in self.coordinator.num_tokens
        computed_token_ids = None if running else getattr(computed_blocks, "token_ids", [])
        self.coordinator.allocate_slots(request_id, num_new_tokens, self._per_group(computed_blocks), new_token_ids,
                                        num_lookahead_tokens, computed_token_ids, num_query_tokens, preempted)
        if not running:
            self.num_cached_tokens[request_id] = len(computed_token_ids or ())

    def remove_skipped_blocks(self, request_id, num_computed_tokens: int) -> int:
        """Give back every group's blocks no query from num_computed_tokens on reads; how many went back."""
        return self.coordinator.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_block_ids(self, request_id, start: int | Sequence[int] = 0) -> tuple[list[int], ...]:
        """The request's block table in every group, from position start (one start per group, or one for all)."""
        tables = self.coordinator.get_block_ids(request_id)
        starts = [start] * len(tables) if isinstance(start, int) else list(start)
        return tuple(table[s:] for table, s in zip(tables, starts))

    def reserve_range(self, request_id, num_tokens: int) -> bool:
        """No contiguous reservations here: every request fits anywhere in the pool."""
        return True

    def rollback_draft_tokens(self, request_id, num_accepted: int, num_lookahead_tokens: int = 0):
        raise ValueError("speculative decoding is not supported for hybrid models")

    def free(self, request_id) -> None:
        """Drop the request's references in every group."""
        self.coordinator.free(request_id)
        self.num_cached_tokens.pop(request_id, None)

    # ----- the block map -----
    def block_views(self, hit_blocks=frozenset()) -> list[dict]:
        """Every block as the block map's plain data, plus the group that holds it ("group", "window") and the
        null block ("null": True); a block's owners are the requests whose table in that group lists it."""
        size = self.block_size
        blocks = []
        for block in self.block_pool.blocks:
            entry = pool_block_view(block, size, hit_blocks)
            if block is self.null_block:
                entry.update(null=True, note="null block: stands where a window gave a block back")
            elif block.block_hash is not None:
                block_hash, group = block.block_hash
                entry["group"] = group
                entry["note"] = f"group {group}, hash {block_hash.hex()[:4]}…" if isinstance(block_hash, bytes) \
                    else f"group {group}"
            blocks.append(entry)
        for manager in self.coordinator.managers:
            spec = manager.kv_cache_spec
            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            for rid, table in manager.req_to_blocks.items():
                stored = self.coordinator.num_tokens[rid]
                for logical, block in enumerate(table):
                    if block is self.null_block:
                        continue
                    entry = blocks[block.block_id]
                    if entry["owner"] is None:
                        entry.update(owner=rid, logical=logical)
                    entry.update(group=manager.group_id, window=window)
                    entry["owners"].append(rid)
                    entry["fill"] = max(entry["fill"], min(size, stored - logical * size))
        return blocks

    # ----- helpers -----
    def _per_group(self, computed_blocks):
        if isinstance(computed_blocks, ComputedBlocks):
            return computed_blocks.per_group
        if computed_blocks:
            raise ValueError("computed_blocks must be what get_computed_blocks returned")
        return None
