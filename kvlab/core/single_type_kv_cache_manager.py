"""One KV-cache group's blocks: its block table per request over a shared BlockPool, and its own cache-hit rule.

vLLM V1's hybrid KV cache manager keeps one SingleTypeKVCacheManager per group (vllm/v1/core/
single_type_kv_cache_manager.py); kvlab's follow the same division of labour:

* FullAttentionManager keeps every block; a prefix hit is the longest run of cached blocks from the left.
* SlidingWindowManager gives a block back to the pool once every future query's window has left it, and puts
  the pool's null block in its table entry (the block ids stay positional, and the kernel never reads it). A
  hit is searched from the right: the longest prefix that ends in window-many tokens of consecutive cached
  blocks, since the blocks before that are never read again.
* ChunkedLocalAttentionManager frees every block before the chunk of the next query; a hit needs the blocks of
  the last chunk only.

A group's blocks are cached under (block hash, group id): the same tokens hashed in two groups are two
different K/V tensors, so one must never answer for the other.
"""

from collections.abc import Sequence

from kvlab.core.block_pool import BlockPool, KVCacheBlock
from kvlab.core.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from kvlab.core.paging import num_blocks_needed


class SingleTypeKVCacheManager:
    """Block tables of one group: req_to_blocks[request_id] lists a KVCacheBlock (or the null block) per position."""

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, null_block: KVCacheBlock, group_id: int):
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.null_block = null_block
        self.group_id = group_id
        self.req_to_blocks: dict[object, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[object, int] = {}  # blocks of each request already cached (hashed)

    # ----- cache hits -----
    def cache_key(self, block_hash) -> tuple:
        return (block_hash, self.group_id)

    def find_longest_cache_hit(self, block_hashes: Sequence, max_length: int) -> list[KVCacheBlock]:
        """The longest run of cached blocks from the left covering at most max_length tokens."""
        hits = []
        get = self.block_pool.get_cached_block
        for block_hash in block_hashes[:max_length // self.block_size]:
            block = get(self.cache_key(block_hash))
            if block is None:
                break
            hits.append(block)
        return hits

    # ----- allocation -----
    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks whose tokens no query from position num_computed_tokens on reads."""
        return self.kv_cache_spec.num_skipped_tokens(num_computed_tokens) // self.block_size

    def remove_skipped_blocks(self, request_id, num_computed_tokens: int) -> int:
        """Give back the blocks every future query's window has left; their entries become the null block.
        Returns how many blocks went back to the pool."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return 0
        freed = []
        for i in range(min(self.num_skipped_blocks(num_computed_tokens), len(blocks)) - 1, -1, -1):
            if blocks[i] is self.null_block:
                break  # everything before it went back earlier
            freed.append(blocks[i])
            blocks[i] = self.null_block
        self.block_pool.free_blocks(freed)
        return len(freed)

    def num_blocks_to_allocate(self, request_id, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        """Blocks this group would take from the free queue to hold num_tokens tokens (hits included)."""
        held = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        new = max(0, num_blocks_needed(num_tokens, self.block_size) - held)
        # A hit on a free cached block takes it out of the free queue too; the null block is never free.
        return new + sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not self.null_block)

    def save_new_computed_blocks(self, request_id, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """A new request takes a reference to its hits (not to the null block, which nobody owns)."""
        self.block_pool.touch([b for b in new_computed_blocks if b is not self.null_block])
        self.req_to_blocks[request_id] = list(new_computed_blocks)
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's table until it covers num_tokens tokens; returns the new blocks."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        self.num_cached_block.setdefault(request_id, 0)
        need = num_blocks_needed(num_tokens, self.block_size) - len(blocks)
        if need <= 0:
            return []
        new = self.block_pool.get_new_blocks(need)
        blocks.extend(new)
        return new

    def cache_blocks(self, request_id, block_hashes: Sequence, num_full_blocks: int) -> None:
        """Cache the request's blocks that are full of verified tokens and not cached yet (null entries stay out)."""
        blocks = self.req_to_blocks[request_id]
        start = self.num_cached_block[request_id]
        end = min(num_full_blocks, len(block_hashes), len(blocks))
        if end <= start:
            return
        todo = [(b, self.cache_key(h)) for b, h in zip(blocks[start:end], block_hashes[start:end])
                if b is not self.null_block]
        if todo:
            self.block_pool.cache_full_blocks([b for b, _ in todo], [k for _, k in todo])
        self.num_cached_block[request_id] = end

    def free(self, request_id) -> None:
        """Drop the request's references, last block first (its tail is reused first), null entries skipped."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.block_pool.free_blocks([b for b in reversed(blocks) if b is not self.null_block])


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every block stays until the request ends."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Blocks older than the window go back to the pool; hits are searched from the right."""

    def find_longest_cache_hit(self, block_hashes: Sequence, max_length: int) -> list[KVCacheBlock]:
        """The longest prefix (at most max_length tokens) whose last window - 1 tokens lie in consecutive cached
        blocks; the blocks before those are the null block, since no query past the prefix reads them."""
        window = self.kv_cache_spec.sliding_window
        # Consecutive cached blocks the next query's window can reach into (vLLM's count for this rule).
        needed = num_blocks_needed(window - 1, self.block_size) if window > 1 else 0
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        if needed == 0:  # a window of one token reads only the query itself: no earlier block is needed
            return [self.null_block] * num_blocks
        get = self.block_pool.get_cached_block
        run = 0
        computed = [self.null_block] * num_blocks
        for i in range(num_blocks - 1, -1, -1):
            block = get(self.cache_key(block_hashes[i]))
            if block is None:
                run = 0
                continue
            computed[i] = block
            run += 1
            if run >= needed:
                del computed[i + run:]
                return computed
        # No run of `needed` blocks: the cached run that starts at the first block, if any, is still a hit (its
        # queries' windows begin at the prompt's start).
        return computed[:run]


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Blocks before the current chunk go back to the pool; a hit needs only the current chunk's blocks."""

    def find_longest_cache_hit(self, block_hashes: Sequence, max_length: int) -> list[KVCacheBlock]:
        """The longest prefix whose blocks inside its own last chunk are all cached; earlier entries are null."""
        chunk = self.kv_cache_spec.attention_chunk_size
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        get = self.block_pool.get_cached_block
        for end in range(num_blocks, 0, -1):
            first = (end * self.block_size) // chunk * chunk // self.block_size  # the chunk of the next query
            blocks = [get(self.cache_key(block_hashes[i])) for i in range(first, end)]
            if all(b is not None for b in blocks):
                return [self.null_block] * first + blocks
        return []


def manager_for(spec: KVCacheSpec, block_pool: BlockPool, null_block: KVCacheBlock,
                group_id: int) -> SingleTypeKVCacheManager:
    """The manager class of a spec (vLLM's spec_manager_map)."""
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, block_pool, null_block, group_id)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return ChunkedLocalAttentionManager(spec, block_pool, null_block, group_id)
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager(spec, block_pool, null_block, group_id)
    raise ValueError(f"no KV-cache manager for {type(spec).__name__}: kvlab keeps Mamba states as bookkeeping only "
                     f"(kvlab.analysis), not in its block pool")
