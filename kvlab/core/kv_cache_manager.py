"""Chapter 4's KV cache manager: per-request block tables on a reference-counted pool, with prefix caching.

Admitting a request is two calls:

    blocks, num_cached_tokens = manager.get_computed_blocks(request_id, prompt_ids)
    slots = manager.allocate_slots(request_id, len(prompt_ids) - num_cached_tokens,
                                   computed_blocks=blocks, new_token_ids=prompt_ids[num_cached_tokens:])

and only the uncached suffix goes through the model. A hit is capped at (len(prompt) - 1) // block_size
blocks, so at least the last prompt token is always computed: the model needs its logits to sample the
first output token. When a prompt of k full blocks is cached entirely, the hit is therefore k - 1
blocks and the whole last block (block_size tokens) is recomputed into a fresh block.

use_eagle=True (vLLM's KVCacheManager argument, set by its scheduler from speculative_config.use_eagle(), true
for the methods "eagle", "eagle3" and "mtp") drops the last block of every non-empty hit as well. Those
proposers draft from the target model's hidden states, and a cache hit brings back K/V, not hidden states:
recomputing the last matched block gives the drafter the states it needs. The two rules stack, as in vLLM
V1 (vllm/v1/core/kv_cache_manager.py get_computed_blocks caps the hit at len(prompt) - 1 tokens;
vllm/v1/core/single_type_kv_cache_manager.py FullAttentionManager.find_longest_cache_hit then pops one block
when use_eagle): a prompt of k full blocks, all cached, hits k - 2 blocks and recomputes two. The hit then
shrinks further to a multiple of alignment_tokens, which for one group of layers is the block size (a hybrid
model's groups align to the least common multiple of their block sizes): kvlab has one group, so nothing
more is dropped. kvlab has no EAGLE proposer and its engine builds the manager with use_eagle=False.

Speculative decoding (vLLM V1's way) adds two arguments and one call: allocate_slots(...,
num_draft_tokens=k, num_lookahead_tokens=L) takes slots for k unverified draft tokens (the last k of
new_token_ids, never hashed) and keeps L more slots free for a draft model's own K/V;
rollback_draft_tokens(request_id, num_accepted) then drops the rejected drafts, caches the blocks the
accepted ones filled, and returns the blocks that ended up wholly past the sequence (plus lookahead).

reservation_arena is for the paper's Orca baselines, which keep each request's whole reservation in one
contiguous range of memory: an arena of kvlab.analysis.contiguous (ContiguousArena, first fit, or BuddyArena, the
buddy allocator the paper assumes: Kwon et al., SOSP 2023, §6.1) with one slot per block of the pool, built by
the engine. reserve_range(request_id, n) places n tokens' blocks in it, and admission fails when no range fits
even though enough blocks are free (external fragmentation). The blocks themselves still come from the pool;
free() releases the range too.

These are the calls of every chapter's block manager (kvlab.core.paging.BaseBlockManager); Chapter 3's
BlockManager answers get_computed_blocks with no hits.
"""

from collections.abc import Hashable, Sequence

from kvlab.core.block_pool import KVCacheBlock, PooledBlockManager
from kvlab.core.block_views import pool_block_view
from kvlab.core.draft_tokens import plan_rollback
from kvlab.core.paging import num_blocks_needed, slot_mapping_for
from kvlab.core.prefix_cache import get_hash_fn, none_hash
from kvlab.validation import check_int, is_integer


class KVCacheManager(PooledBlockManager):
    """Block tables of running requests over one BlockPool; full blocks are cached by prefix hash.

    The block-manager vocabulary of kvlab.core.paging.BaseBlockManager, with prefix caching:
    get_computed_blocks finds cached blocks, and allocate_slots hashes every block that fills.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, use_eagle: bool = False,
                 prefix_caching_hash_algo: str = "sha256", reservation_arena=None,
                 enable_kv_cache_events: bool = False, hash_seed: str | None = None):
        if reservation_arena is not None and (
                not all(hasattr(reservation_arena, a) for a in ("allocate", "free", "largest_range", "num_slots"))
                or reservation_arena.num_slots != num_blocks):
            raise ValueError(f"reservation_arena must be None (no contiguous placement) or an arena of "
                             f"kvlab.analysis.contiguous with one slot per block ({num_blocks}), "
                             f"got {reservation_arena!r}")
        if not isinstance(use_eagle, bool):
            raise ValueError(f"use_eagle is True (a proposer that drafts from the target's hidden states) or False, "
                             f"got {use_eagle!r}")
        # vLLM's --prefix-caching-hash-algo (kvlab.core.prefix_cache): sha256 unless a simulation asks for builtin.
        self.hash_fn = get_hash_fn(prefix_caching_hash_algo)
        self.prefix_caching_hash_algo = prefix_caching_hash_algo
        # The first block's parent: every hash of this pool depends on it (vLLM's NONE_HASH from PYTHONHASHSEED).
        self.hash_seed = hash_seed
        self.none_hash = none_hash(hash_seed)
        super().__init__(num_blocks, block_size, enable_prefix_caching, enable_kv_cache_events)
        self.enable_prefix_caching = enable_prefix_caching
        self.use_eagle = use_eagle  # drop the last block of every cache hit: its hidden states must be recomputed
        self.num_cached_tokens: dict[object, int] = {}
        # To hash a block when it fills, keep each request's chain of full-block hashes and the
        # tokens of its partly filled last block.
        self._req_hashes: dict[object, list[bytes]] = {}
        self._req_tail: dict[object, list[int]] = {}
        self._req_extra_keys: dict[object, Hashable | None] = {}
        self._req_drafts: dict[object, list[int]] = {}  # each request's unverified draft tokens, not hashed yet
        # Tokens whose blocks wait to be cached until an asynchronous load has filled them (delay_cache_blocks).
        self._req_delayed: dict[object, list[int]] = {}
        # Prompt tokens looked up when requests were admitted (the whole prompt, however it is chunked), and of
        # those, the ones served from the cache; re-admissions after a preemption are counted apart.
        self.queries = 0
        self.hits = 0
        self.preempted_queries = 0
        self.preempted_hits = 0
        # In blocks: a range of k blocks stands for k * block_size contiguous token slots.
        self.arena = reservation_arena
        self._ranges: dict[object, int] = {}  # request id -> the start of its range in the arena

    def reserve_range(self, request_id, num_tokens: int) -> bool:
        """Place a reservation of num_tokens tokens in one contiguous range of the arena; False if no range fits
        (nothing changes then). True without an arena, or when the request holds its range already."""
        if self.arena is None or request_id in self._ranges:
            return True
        check_int("num_tokens", num_tokens, 1)
        size = num_blocks_needed(num_tokens, self.block_size)
        if size > self.arena.largest_range:
            raise ValueError(f"request {request_id!r}: a reservation of {num_tokens} tokens = {size} blocks can never "
                             f"fit the {type(self.arena).__name__}, whose largest range is "
                             f"{self.arena.largest_range} blocks")
        start = self.arena.allocate(size)
        if start is None:
            return False
        self._ranges[request_id] = start
        return True

    @property
    def hit_rate(self) -> float:
        """Share of admitted prompt tokens whose K/V came from the cache."""
        return self.hits / self.queries if self.queries else 0.0

    @property
    def prefill_tokens_saved(self) -> int:
        """Prompt tokens the model did not have to run thanks to cache hits."""
        return self.hits

    def get_computed_blocks(self, request_id, token_ids: Sequence[int],
                            extra_keys: Hashable | None = None) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks from the prompt's start, and the tokens they cover (changes nothing).

        The run stops one token short of the prompt, so the last token is always recomputed; with use_eagle it
        then loses its last block too, whose tokens are recomputed for their hidden states.
        """
        self._check_new(request_id)
        if not self.enable_prefix_caching:
            return [], 0
        size, hash_fn, get_cached_block = self.block_size, self.hash_fn, self.block_pool.get_cached_block
        hits: list[KVCacheBlock] = []
        parent = self.none_hash
        for start in range(0, (len(token_ids) - 1) // size * size, size):
            parent = hash_fn(parent, token_ids[start:start + size], extra_keys)
            block = get_cached_block(parent)
            if block is None:
                break
            hits.append(block)
        if self.use_eagle and hits:
            hits.pop()
        return hits, len(hits) * self.block_size

    def num_blocks_to_allocate(self, request_id, num_new_tokens: int,
                               computed_blocks: Sequence[KVCacheBlock] = (), num_lookahead_tokens: int = 0) -> int:
        """Blocks allocate_slots would take from the free queue: new ones plus free cached hits."""
        current = self.num_tokens.get(request_id, 0)
        after = current + len(computed_blocks) * self.block_size + num_new_tokens + num_lookahead_tokens
        # A speculating request may already hold lookahead blocks past its tokens.
        held = len(self.req_to_blocks.get(request_id, ())) + len(computed_blocks)
        new = -(-after // self.block_size) - held  # num_blocks_needed, inline: every running request, every step
        if new < 0:
            new = 0
        if not computed_blocks:  # a running request (every step): no hits to take out of the free queue
            return new
        free_hits = {b.block_id for b in computed_blocks if b.ref_cnt == 0}
        return new + len(free_hits)

    def allocate_slots(self, request_id, num_new_tokens: int, computed_blocks: Sequence[KVCacheBlock] = (),
                       new_token_ids: Sequence[int] | None = None, extra_keys: Hashable | None = None,
                       num_draft_tokens: int = 0, num_lookahead_tokens: int = 0,
                       num_query_tokens: int | None = None, preempted: bool = False) -> list[int]:
        """Grow a request by num_new_tokens after its computed blocks; returns the new tokens' slots.

        A new request first takes a reference to its cache hits; blocks come from the pool only as the
        last one fills, and every block that is now full of verified tokens gets cached under its prefix
        hash. With prefix caching on, new_token_ids (the tokens being added) are required to hash those
        blocks. The last num_draft_tokens new tokens are unverified drafts (see rollback_draft_tokens);
        num_lookahead_tokens more slots past them are held too (a draft model writes its K/V there).
        num_query_tokens, at admission: the length of the token sequence the hit was looked up in, which the
        hit-rate counters count as queried (default: the hit plus this call's tokens; give the whole prompt when
        it is admitted a chunk at a time). preempted: a re-admission after a preemption, whose lookup finds its
        own blocks again; it is counted apart (preempted_queries, preempted_hits), as vLLM V1 does.
        allocate_blocks does all of this without building the slots.
        """
        self.allocate_blocks(request_id, num_new_tokens, computed_blocks, new_token_ids, extra_keys, num_draft_tokens,
                             num_lookahead_tokens, num_query_tokens, preempted)
        start = self.num_tokens[request_id] - num_new_tokens
        first = start // self.block_size  # only the blocks the new tokens land in, not the whole table, on every decode
        return slot_mapping_for([b.block_id for b in self.req_to_blocks[request_id][first:]],
                                start - first * self.block_size, num_new_tokens, self.block_size)

    def allocate_blocks(self, request_id, num_new_tokens: int, computed_blocks: Sequence[KVCacheBlock] = (),
                        new_token_ids: Sequence[int] | None = None, extra_keys: Hashable | None = None,
                        num_draft_tokens: int = 0, num_lookahead_tokens: int = 0,
                        num_query_tokens: int | None = None, preempted: bool = False,
                        delay_cache_blocks: bool = False) -> None:
        """allocate_slots without the slot mapping: the scheduler's call, as in vLLM V1, where the model runner
        computes each step's slots from the block tables it is sent (vllm/v1/worker/block_table.py).

        delay_cache_blocks: the new tokens' K/V arrive by an asynchronous load (a KV connector's), so their blocks
        are cached only when cache_blocks says the load is done: until then another request must not hit them.
        """
        if computed_blocks:
            computed_blocks = list(computed_blocks)
        blocks = self.req_to_blocks.get(request_id)
        # Check everything before changing anything, so a failed call leaves the manager as it was. The common
        # case (plain ints) is tested inline; anything else goes to the check that names what is wrong.
        if type(num_new_tokens) is not int or num_new_tokens < 1 \
                or (new_token_ids is not None and len(new_token_ids) != num_new_tokens):
            self._check_new_tokens(num_new_tokens, new_token_ids)
        if type(num_lookahead_tokens) is not int or num_lookahead_tokens < 0:
            check_int("num_lookahead_tokens", num_lookahead_tokens, minimum=0)
        if (type(num_draft_tokens) is not int or num_draft_tokens) \
                and (not is_integer(num_draft_tokens) or not 0 <= num_draft_tokens <= num_new_tokens):
            raise ValueError(f"num_draft_tokens must be an integer from 0 to num_new_tokens ({num_new_tokens}), "
                             f"got {num_draft_tokens!r}")
        if num_draft_tokens and new_token_ids is None:
            raise ValueError("draft tokens need new_token_ids: the accepted ones are hashed after verification")
        if delay_cache_blocks and (num_draft_tokens or new_token_ids is None and self.enable_prefix_caching):
            raise ValueError("delay_cache_blocks is for loaded prompt tokens: give new_token_ids and no drafts")
        if blocks is not None and self._req_delayed.get(request_id):
            raise ValueError(f"request {request_id!r} still waits for a load: call cache_blocks before allocating more")
        if blocks is not None and self._req_drafts[request_id]:
            raise ValueError(f"request {request_id!r} still has {len(self._req_drafts[request_id])} unverified draft "
                             f"tokens: call rollback_draft_tokens after verifying them, before allocating more")
        if computed_blocks and blocks is not None:
            raise ValueError(f"request {request_id!r} is already running: computed blocks only come with admission")
        if num_query_tokens is not None and (
                not is_integer(num_query_tokens)
                or num_query_tokens < len(computed_blocks) * self.block_size + num_new_tokens):
            raise ValueError(f"num_query_tokens is the length looked up at admission: None or at least the hit plus "
                             f"the new tokens ({len(computed_blocks) * self.block_size} + {num_new_tokens}), got "
                             f"{num_query_tokens!r}")
        if self.enable_prefix_caching and new_token_ids is None:
            raise ValueError("prefix caching needs new_token_ids to hash the blocks that fill up")
        for block in computed_blocks:
            if block.block_hash is None or self.block_pool.get_cached_block(block.block_hash) is not block:
                raise ValueError(f"computed block {block.block_id} of request {request_id!r} is no longer cached "
                                 f"(evicted since get_computed_blocks?)")
        needed = self.num_blocks_to_allocate(request_id, num_new_tokens, computed_blocks, num_lookahead_tokens)
        if needed > self.block_pool.free_block_queue.num_free_blocks:
            self._check_free_blocks(request_id, needed)

        if blocks is None:
            # Touch hits before taking new blocks, so the new ones cannot evict them.
            self.block_pool.touch(computed_blocks)
            blocks = self.req_to_blocks[request_id] = list(computed_blocks)
            self.num_tokens[request_id] = len(computed_blocks) * self.block_size
            self.num_cached_tokens[request_id] = self.num_tokens[request_id]
            self._req_hashes[request_id] = [b.block_hash for b in computed_blocks]
            self._req_tail[request_id] = []
            self._req_extra_keys[request_id] = extra_keys
            self._req_drafts[request_id] = []
            if num_query_tokens is None:
                num_query_tokens = self.num_tokens[request_id] + num_new_tokens
            if preempted:
                self.preempted_queries += num_query_tokens
                self.preempted_hits += self.num_tokens[request_id]
            else:
                self.queries += num_query_tokens
                self.hits += self.num_tokens[request_id]
        end = self.num_tokens[request_id] + num_new_tokens
        wanted = num_blocks_needed(end + num_lookahead_tokens, self.block_size)
        if wanted > len(blocks):
            blocks.extend(self.block_pool.get_new_blocks(wanted - len(blocks)))
        self.num_tokens[request_id] = end
        verified = num_new_tokens - num_draft_tokens
        if num_draft_tokens:
            self._req_drafts[request_id] = [int(t) for t in new_token_ids[verified:]]
        if delay_cache_blocks:
            if self.enable_prefix_caching:
                self._req_delayed[request_id] = [int(t) for t in new_token_ids]
        elif self.enable_prefix_caching:
            self._cache_filled_blocks(request_id, new_token_ids[:verified] if num_draft_tokens else new_token_ids)

    def cache_blocks(self, request_id, num_tokens: int | None = None) -> None:
        """A load allocated with delay_cache_blocks has finished: cache the blocks its tokens fill, all of them or only
        those within the request's first num_tokens tokens (a load that failed part-way; the rest are dropped)."""
        self._check_running(request_id, "cache the blocks of")
        delayed = self._req_delayed.pop(request_id, [])
        if num_tokens is not None:
            first = self.num_tokens[request_id] - len(delayed)
            if not is_integer(num_tokens) or num_tokens < first:
                raise ValueError(f"num_tokens must be at least the tokens before the load ({first}), got "
                                 f"{num_tokens!r}")
            delayed = delayed[:num_tokens - first]
        if delayed:
            self._cache_filled_blocks(request_id, delayed)

    def rollback_draft_tokens(self, request_id, num_accepted_tokens: int, num_lookahead_tokens: int = 0) -> list[int]:
        """After verification: keep the first num_accepted_tokens drafts, drop the rest; returns the freed block ids.

        The accepted drafts are verified tokens now, so the blocks they fill are cached; blocks wholly
        past the remaining tokens plus num_lookahead_tokens go back to the pool, last block first.
        """
        self._check_running(request_id, "roll back")
        drafts = self._req_drafts[request_id]
        blocks = self.req_to_blocks[request_id]
        plan = plan_rollback(self.num_tokens[request_id], len(drafts), num_accepted_tokens, len(blocks),
                             self.block_size, num_lookahead_tokens)
        self.num_tokens[request_id] = plan.num_computed_tokens
        self._req_drafts[request_id] = []
        if self.enable_prefix_caching:
            self._cache_filled_blocks(request_id, drafts[:num_accepted_tokens])
        freed = blocks[plan.num_blocks_to_keep:]
        del blocks[plan.num_blocks_to_keep:]
        self.block_pool.free_blocks(reversed(freed))
        return [b.block_id for b in freed]

    def num_draft_tokens(self, request_id) -> int:
        """Unverified draft tokens the request holds slots for (0 between steps)."""
        return len(self._req_drafts.get(request_id, ()))

    def _cache_filled_blocks(self, request_id, new_token_ids: Sequence[int]) -> None:
        tail = self._req_tail[request_id]
        tail += map(int, new_token_ids)
        size = self.block_size
        if len(tail) < size:  # a decode fills a block once every block_size tokens
            return
        hashes, hash_fn, extra_keys = self._req_hashes[request_id], self.hash_fn, self._req_extra_keys[request_id]
        first_new = len(hashes)
        # Events name a first block's parent None, as vLLM's do; the chain itself starts from the seed's root.
        first_parent = hashes[-1] if hashes else None
        parent = hashes[-1] if hashes else self.none_hash
        full = len(tail) // size * size
        for start in range(0, full, size):
            parent = hash_fn(parent, tail[start:start + size], extra_keys)
            hashes.append(parent)
        filled = tail[:full]
        del tail[:full]
        if len(hashes) > first_new:
            blocks = self.req_to_blocks[request_id]
            self.block_pool.cache_full_blocks(blocks[first_new:len(hashes)], hashes[first_new:], filled, first_parent,
                                              size)

    def block_views(self, hit_blocks=frozenset()) -> list[dict]:
        """Every block as the block map's plain data: owners, fill, ref count, cached, hash, hit (see kvlab.widgets)."""
        size = self.block_size
        blocks = []
        for block in self.block_pool.blocks:
            entry = pool_block_view(block, size, hit_blocks)
            if block.block_hash is not None:
                digest = block.block_hash.hex() if isinstance(block.block_hash, bytes) \
                    else f"{hash(block.block_hash) & 0xFFFFFFFF:08x}"
                entry["note"] = f"hash {digest[:4]}…"
            blocks.append(entry)
        # req_to_blocks is in admission order, so the first owner listed is the first request that held the block.
        for rid, table in self.req_to_blocks.items():
            stored = self.num_tokens[rid]
            for logical, block in enumerate(table):
                entry = blocks[block.block_id]
                if entry["owner"] is None:
                    entry.update(owner=rid, logical=logical)
                entry["owners"].append(rid)
                entry["fill"] = max(entry["fill"], min(size, stored - logical * size))
        return blocks

    def _forget(self, request_id) -> None:
        if request_id in self._ranges:
            self.arena.free(self._ranges.pop(request_id))
        for table in (self.num_cached_tokens, self._req_hashes, self._req_tail, self._req_extra_keys, self._req_drafts):
            del table[request_id]
        self._req_delayed.pop(request_id, None)
