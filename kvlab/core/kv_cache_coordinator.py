"""A hybrid model's KV cache manager: one manager per KV-cache group over one shared block pool.

vLLM V1's HybridKVCacheCoordinator (vllm/v1/core/kv_cache_coordinator.py) sits between the scheduler and one
SingleTypeKVCacheManager per group. kvlab's keeps the scheduler's vocabulary of one manager (get_computed_blocks,
num_blocks_to_allocate, allocate_slots, free), answering per group where a single manager answers once:

    hits, num_cached = coordinator.get_computed_blocks("r", prompt_ids)    # one list of blocks per group
    coordinator.allocate_slots("r", len(prompt_ids) - num_cached, hits, new_token_ids=prompt_ids[num_cached:],
                               computed_token_ids=prompt_ids[:num_cached])
    coordinator.get_block_ids("r")                                         # one block table per group

A request's prefix hit is the longest prefix every group can serve: full attention finds its run from the left,
sliding window and chunked local attention theirs from the right, and the shortest wins, rounded down to a
multiple of every group's block size; a group that hits less shortens the others, so the search repeats until
no group shortens it (the fixed point vLLM's coordinator computes). Block 0 of the pool is the null block: it
stands in a table where a sliding-window or chunked group gave a block back, and it is never handed out.
"""

import math
from collections.abc import Sequence

from kvlab.core.block_pool import BlockPool, KVCacheBlock
from kvlab.core.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from kvlab.core.prefix_cache import get_hash_fn, none_hash
from kvlab.core.single_type_kv_cache_manager import manager_for
from kvlab.validation import check_int, check_positive_int, is_integer


class HybridKVCacheCoordinator:
    """Block tables of running requests, one per KV-cache group, over one BlockPool whose block 0 is the null block."""

    def __init__(self, kv_cache_groups: Sequence[KVCacheGroupSpec], num_blocks: int,
                 enable_prefix_caching: bool = True, prefix_caching_hash_algo: str = "sha256",
                 hash_seed: str | None = None):
        groups = list(kv_cache_groups)
        if not groups:
            raise ValueError("kv_cache_groups is empty: a model has at least one group of layers")
        pages = {g.kv_cache_spec.page_size_bytes for g in groups}
        if len(pages) != 1:
            raise ValueError(f"the groups' page sizes differ ({sorted(pages)} bytes): one pool needs one page size "
                             f"(kvlab.core.kv_cache_interface.unify_page_sizes)")
        check_positive_int("num_blocks", num_blocks)
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: the pool needs the null block and one block to hand out")
        self.kv_cache_groups = groups
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        # Block 0, held for good: it fills the table entries of blocks a group gave back.
        self.null_block = self.block_pool.get_new_blocks(1)[0]
        self.managers = [manager_for(g.kv_cache_spec, self.block_pool, self.null_block, i)
                         for i, g in enumerate(groups)]
        self.block_sizes = sorted({m.block_size for m in self.managers})
        # A hit must end on a block boundary of every group.
        self.hit_alignment = math.lcm(*self.block_sizes)
        self.hash_fn = get_hash_fn(prefix_caching_hash_algo)
        self.none_hash = none_hash(hash_seed)  # the chains' root (kvlab.core.prefix_cache)
        self.num_tokens: dict[object, int] = {}
        self._req_tokens: dict[object, list[int]] = {}
        self._req_hashes: dict[object, dict[int, list]] = {}
        # Prompt tokens looked up at admission and those served from the cache; re-admissions after a preemption
        # apart (as kvlab.core.kv_cache_manager.KVCacheManager counts them).
        self.queries = 0
        self.hits = 0
        self.preempted_queries = 0
        self.preempted_hits = 0

    # ----- what the scheduler reads -----
    @property
    def num_blocks(self) -> int:
        """Blocks that can ever be handed out (the pool less the null block)."""
        return self.block_pool.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def hit_rate(self) -> float:
        """Share of admitted prompt tokens whose K/V came from the cache."""
        return self.hits / self.queries if self.queries else 0.0

    def get_block_ids(self, request_id) -> tuple[list[int], ...]:
        """The request's block table in every group (block 0 where a group gave a block back)."""
        self._check_running(request_id)
        return tuple([b.block_id for b in m.req_to_blocks[request_id]] for m in self.managers)

    # ----- prefix hits -----
    def _hashes(self, token_ids: Sequence[int], block_size: int, known: list | None = None) -> list:
        hashes = list(known or [])
        parent = hashes[-1] if hashes else self.none_hash
        for start in range(len(hashes) * block_size, len(token_ids) // block_size * block_size, block_size):
            parent = self.hash_fn(parent, token_ids[start:start + block_size], None)
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request_id, token_ids: Sequence[int]) -> tuple[list[list[KVCacheBlock]], int]:
        """The longest prefix every group serves from the cache, as each group's blocks, and its length in tokens
        (never the whole prompt: its last token is always computed). Changes nothing."""
        if request_id in self.num_tokens:
            raise ValueError(f"request {request_id!r} is already running: only a new request looks up the cache")
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return [[] for _ in self.managers], 0
        hashes = {size: self._hashes(token_ids, size) for size in self.block_sizes}
        length = (len(token_ids) - 1) // self.hit_alignment * self.hit_alignment
        # Full attention first: its left-to-right hit bounds the rest (and it is the cheapest to find).
        order = sorted(self.managers, key=lambda m: type(m.kv_cache_spec) is not FullAttentionSpec)
        while True:
            shortest = length
            for manager in order:
                found = manager.find_longest_cache_hit(hashes[manager.block_size], length)
                shortest = min(shortest, len(found) * manager.block_size)
            shortest = shortest // self.hit_alignment * self.hit_alignment
            if shortest == length:
                break
            length = shortest
        blocks = [m.find_longest_cache_hit(hashes[m.block_size], length)[:length // m.block_size]
                  for m in self.managers]
        return blocks, length

    # ----- allocation -----
    def num_blocks_to_allocate(self, request_id, num_new_tokens: int,
                               computed_blocks: Sequence[Sequence[KVCacheBlock]] | None = None,
                               num_lookahead_tokens: int = 0) -> int:
        """Blocks allocate_slots would take from the free queue, less those its window rule gives back first."""
        computed_blocks = self._computed(request_id, computed_blocks)
        start = self.num_tokens.get(request_id, len(computed_blocks[0]) * self.managers[0].block_size)
        total = start + num_new_tokens + num_lookahead_tokens
        needed = 0
        for manager, hits in zip(self.managers, computed_blocks):
            needed += manager.num_blocks_to_allocate(request_id, total, hits)
            table = manager.req_to_blocks.get(request_id, hits)
            skipped = table[:manager.num_skipped_blocks(start)]
            # Running blocks are given back before the new ones are taken; a hit's skipped entries are null.
            needed -= sum(1 for b in skipped if b is not self.null_block and (b.ref_cnt == 1 or b in hits))
        return max(0, needed)

    def remove_skipped_blocks(self, request_id, num_computed_tokens: int) -> int:
        """Give back every group's blocks that no query from num_computed_tokens on reads; how many went back."""
        self._check_running(request_id)
        return sum(m.remove_skipped_blocks(request_id, num_computed_tokens) for m in self.managers)

    def allocate_slots(self, request_id, num_new_tokens: int,
                       computed_blocks: Sequence[Sequence[KVCacheBlock]] | None = None,
                       new_token_ids: Sequence[int] | None = None, num_lookahead_tokens: int = 0,
                       computed_token_ids: Sequence[int] | None = None, num_query_tokens: int | None = None,
                       preempted: bool = False) -> None:
        """Grow the request by num_new_tokens in every group, after its hits (a new request) or its tokens so far.

        First each group gives back the blocks this step's queries cannot see; then the request takes references
        to its hits, new blocks as its tables need them, and every group caches the blocks that are now full.
        With prefix caching, new_token_ids are the new tokens, and at admission computed_token_ids the hit's
        (the prompt's first num_cached tokens): the blocks after a hit are hashed from it, as vLLM hashes a
        request's whole token list. num_query_tokens: at admission, the length the hit was looked up in (default:
        the hit plus this call's tokens; give the whole prompt when it is admitted a chunk at a time); preempted: a
        re-admission, counted apart.
        """
        check_int("num_new_tokens", num_new_tokens, 1)
        check_int("num_lookahead_tokens", num_lookahead_tokens, 0)
        if self.enable_prefix_caching and (new_token_ids is None or len(new_token_ids) != num_new_tokens):
            raise ValueError(f"prefix caching needs the {num_new_tokens} new token ids to hash the blocks that fill")
        running = request_id in self.num_tokens
        computed_blocks = self._computed(request_id, computed_blocks)
        if running and any(computed_blocks):
            raise ValueError(f"request {request_id!r} is already running: computed blocks only come with admission")
        num_cached = 0 if running else len(computed_blocks[0]) * self.managers[0].block_size
        if not running and num_query_tokens is not None and (
                not is_integer(num_query_tokens) or num_query_tokens < num_cached + num_new_tokens):
            raise ValueError(f"num_query_tokens is the length looked up at admission: None or at least the hit plus "
                             f"the new tokens ({num_cached} + {num_new_tokens}), got {num_query_tokens!r}")
        if self.enable_prefix_caching and not running and len(computed_token_ids or ()) != num_cached:
            raise ValueError(f"computed_token_ids must be the hit's {num_cached} tokens (the prompt's start), got "
                             f"{len(computed_token_ids or ())}")
        for manager, hits in zip(self.managers, computed_blocks):
            if len(hits) * manager.block_size != num_cached:
                raise ValueError(f"group {manager.group_id}: {len(hits)} computed blocks of {manager.block_size} "
                                 f"tokens, but group 0 covers {num_cached} tokens; pass get_computed_blocks' lists")
        needed = self.num_blocks_to_allocate(request_id, num_new_tokens, computed_blocks, num_lookahead_tokens)
        if needed > self.num_free_blocks:
            raise MemoryError(f"request {request_id!r} needs {needed} more blocks but only {self.num_free_blocks} "
                              f"are free")
        if not running:
            for manager, hits in zip(self.managers, computed_blocks):
                manager.save_new_computed_blocks(request_id, hits)
            self.num_tokens[request_id] = num_cached
            self._req_tokens[request_id] = []
            self._req_hashes[request_id] = {size: [] for size in self.block_sizes}
            queried = num_cached + num_new_tokens if num_query_tokens is None else num_query_tokens
            if preempted:
                self.preempted_queries += queried
                self.preempted_hits += num_cached
            else:
                self.queries += queried
                self.hits += num_cached
        start = self.num_tokens[request_id]
        self.remove_skipped_blocks(request_id, start)
        end = start + num_new_tokens
        for manager in self.managers:
            manager.allocate_new_blocks(request_id, end + num_lookahead_tokens)
        self.num_tokens[request_id] = end
        if self.enable_prefix_caching:
            tokens = self._req_tokens[request_id]
            if not running:
                tokens.extend(int(t) for t in computed_token_ids or ())
            tokens.extend(int(t) for t in new_token_ids)
            for manager in self.managers:
                known = self._req_hashes[request_id][manager.block_size] = self._hashes(
                    tokens, manager.block_size, self._req_hashes[request_id][manager.block_size])
                manager.cache_blocks(request_id, known, len(known))

    def free(self, request_id) -> None:
        """Drop the request's references in every group, last block first."""
        self._check_running(request_id)
        for manager in self.managers:
            manager.free(request_id)
        del self.num_tokens[request_id], self._req_tokens[request_id], self._req_hashes[request_id]

    # ----- helpers -----
    def _computed(self, request_id, computed_blocks):
        if computed_blocks is None:
            return [[] for _ in self.managers]
        computed_blocks = [list(b) for b in computed_blocks]
        if len(computed_blocks) != len(self.managers):
            raise ValueError(f"computed_blocks has {len(computed_blocks)} lists for {len(self.managers)} groups")
        return computed_blocks

    def _check_running(self, request_id) -> None:
        if request_id not in self.num_tokens:
            raise KeyError(f"request {request_id!r} holds no blocks (unknown or already freed)")
