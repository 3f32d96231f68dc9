"""Chapter 4's block pool: every KV block exists from the start, with a reference count and maybe a hash.

A block is in exactly one of three states:

* used: ref_cnt > 0, held by that many requests (several when they share a cached prefix);
* free and cached: ref_cnt == 0 but it still holds the K/V of a full block, findable by its hash;
* free and empty: ref_cnt == 0 and no hash.

Free blocks (cached or not) wait in one queue, and a new block is always taken from its front. Where
a freed block joins the queue depends on whether it is cached, as in vLLM V1's BlockPool.free_blocks:

* a freed block with a hash goes to the BACK, so cached blocks are reused (and their contents
  evicted) in the order they were freed, the block freed longest ago first: LRU eviction without
  any timestamps;
* a freed block without a hash (a request's partly filled last block, or any block when prefix
  caching is off) goes to the FRONT: it can never be a cache hit, so reusing it first costs nothing,
  and a new request never evicts a cached block while an uncached free block exists.

The blocks one free_blocks call sends to the front keep the order they were given in (a request
frees its blocks last block first), ahead of every block already free. A cache hit on a free block
takes it out of the middle of the queue, which is why the queue is a doubly linked list rather than
a deque.

With enable_kv_cache_events the pool also records what it does to its prefix cache as vLLM's KV-cache events
(kvlab.core.kv_events): BlockStored when blocks are cached, BlockRemoved when a cached block is reused,
AllBlocksCleared when reset_prefix_cache drops them all; take_events hands them over once each.

PooledBlockManager is the part of the block-manager vocabulary (kvlab.core.paging.BaseBlockManager)
that every manager on a BlockPool shares: Chapter 4's KVCacheManager and Chapter 5's CowBlockManager.
"""

from collections.abc import Hashable, Iterable, Iterator, Sequence

from kvlab.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvlab.core.paging import BaseBlockManager
from kvlab.validation import check_block_size, check_int, check_positive_int


class KVCacheBlock:
    """One physical block: its id, how many requests hold it, its hash when full and cached, and its queue links."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Hashable | None = None
        # Links are only meaningful while the block sits in the free queue.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else ", cached"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeKVCacheBlockQueue:
    """The free blocks in eviction order, as a doubly linked list: O(1) popleft, append, prepend and remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()):
        # Two sentinels spare every operation the "is this the first/last block?" special cases.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free_block
        while block is not self._tail:
            yield block
            block = block.next_free_block

    def popleft(self) -> KVCacheBlock:
        """Take the block freed longest ago."""
        if self.num_free_blocks == 0:
            raise MemoryError("the free block queue is empty")
        block = self._head.next_free_block
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the back: it will be reused last."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free_block
        block.prev_free_block, block.next_free_block = last, self._tail
        last.next_free_block = block
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def prepend(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put blocks at the front in the given order (the first is reused next), ahead of every block already free."""
        blocks = list(blocks)
        seen: set[int] = set()
        for block in blocks:
            if block.prev_free_block is not None or block.next_free_block is not None or id(block) in seen:
                raise ValueError(f"block {block.block_id} is already in the free queue")
            seen.add(id(block))
        # Insert from the last block to the first, each right after the head sentinel.
        for block in reversed(blocks):
            first = self._head.next_free_block
            block.prev_free_block, block.next_free_block = self._head, first
            first.prev_free_block = block
            self._head.next_free_block = block
            self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue (a cache hit on a free block)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block, nxt.prev_free_block = nxt, prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def block_ids(self) -> list[int]:
        """The free blocks' ids, next to be reused first (O(n): for tests and widgets)."""
        return [block.block_id for block in self]


class BlockPool:
    """All num_blocks KV blocks, a free queue in LRU order, and (with prefix caching) a hash -> block map."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True, enable_kv_cache_events: bool = False):
        check_positive_int("num_blocks", num_blocks)
        if not isinstance(enable_kv_cache_events, bool):
            raise ValueError(f"enable_kv_cache_events must be True or False, got {enable_kv_cache_events!r}")
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list = []  # events not yet taken (take_events)
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # One block per hash: a second block filled with the same prefix simply stays uncached.
        self.cached_block_hash_to_block: dict[Hashable, KVCacheBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached or not: all of them can be handed out."""
        return self.free_block_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - self.num_free_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether get_new_blocks(num_blocks) would succeed (changes nothing)."""
        return 0 <= num_blocks <= self.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take num_blocks blocks from the front of the free queue, evicting any cached contents; ref_cnt becomes 1."""
        check_int("num_blocks", num_blocks, minimum=0)
        if num_blocks > self.num_free_blocks:
            raise MemoryError(f"asked for {num_blocks} blocks but only {self.num_free_blocks} are free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def _evict(self, block: KVCacheBlock) -> None:
        # The block's K/V are about to be overwritten: it must no longer answer to its old hash.
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
                if self.enable_kv_cache_events:
                    self.kv_event_queue.append(BlockRemoved([block.block_hash]))
            block.block_hash = None
            self.num_evictions += 1

    def _check_owned(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            block_id = getattr(block, "block_id", None)
            if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks \
                    or self.blocks[block_id] is not block:
                raise ValueError(f"{block!r} does not belong to this pool of {self.num_blocks} blocks")

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks nobody holds now become free.

        Of those, blocks without a hash go to the front of the free queue (reused first: they hold no
        cached K/V) and cached blocks to the back (evicted last, least recently freed first); each
        group keeps the order given, so callers pass blocks in the order they should be reused.
        """
        blocks = list(blocks)
        self._check_owned(blocks)
        # A block may appear twice in one call: it needs that many references left.
        counts: dict[int, int] = {}
        for block in blocks:
            counts[block.block_id] = counts.get(block.block_id, 0) + 1
            if counts[block.block_id] > block.ref_cnt:
                raise ValueError(f"double free: block {block.block_id} has ref_cnt {block.ref_cnt}, "
                                 f"freed {counts[block.block_id]} times")
        uncached, cached = [], []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (uncached if block.block_hash is None else cached).append(block)
        self.free_block_queue.prepend(uncached)
        for block in cached:
            self.free_block_queue.append(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block (a cache hit); a free cached block leaves the free queue."""
        blocks = list(blocks)
        self._check_owned(blocks)
        for block in blocks:
            if block.ref_cnt == 0 and block.block_hash is None:
                raise ValueError(f"block {block.block_id} is free and holds no cached contents: nothing to share")
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[Hashable],
                          token_ids: Sequence[int] | None = None, parent_block_hash: Hashable | None = None,
                          block_size: int | None = None) -> int:
        """Record the hashes of blocks that just became full; returns how many were newly cached.

        With KV-cache events on, token_ids (the blocks' tokens, block_size each), parent_block_hash (the hash of
        the block before the first, None at a sequence's start) and block_size describe them for BlockStored.
        """
        blocks = list(blocks)
        if len(blocks) != len(block_hashes):
            raise ValueError(f"{len(blocks)} blocks but {len(block_hashes)} hashes")
        if self.enable_kv_cache_events and self.enable_prefix_caching and (
                block_size is None or token_ids is None or len(token_ids) != len(blocks) * block_size):
            raise ValueError(f"KV-cache events need each block's tokens: block_size and block_size token ids per "
                             f"block ({len(blocks)} blocks), got block_size={block_size!r} and "
                             f"{None if token_ids is None else len(token_ids)} token ids")
        self._check_owned(blocks)
        for block in blocks:
            if block.ref_cnt == 0:
                raise ValueError(f"block {block.block_id} is free: only a block a request holds can be cached")
        if not self.enable_prefix_caching:
            return 0
        if any(block_hash is None for block_hash in block_hashes):
            raise ValueError(f"block {blocks[block_hashes.index(None)].block_id} is given no hash")
        cached = 0
        run: list[int] = []  # positions of newly cached blocks in a row, reported as one BlockStored
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes)):
            if block.block_hash is None and block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block
                cached += 1
                if self.enable_kv_cache_events:
                    if run and run[-1] != i - 1:
                        self._stored(run, block_hashes, token_ids, parent_block_hash, block_size)
                        run = []
                    run.append(i)
        if run:
            self._stored(run, block_hashes, token_ids, parent_block_hash, block_size)
        return cached

    def _stored(self, run: list[int], block_hashes, token_ids, parent_block_hash, block_size: int) -> None:
        first, last = run[0], run[-1] + 1
        parent = block_hashes[first - 1] if first else parent_block_hash
        self.kv_event_queue.append(BlockStored(list(block_hashes[first:last]), parent,
                                               [int(t) for t in token_ids[first * block_size:last * block_size]],
                                               block_size))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, as vLLM's reset_prefix_cache; only when no block is held (False otherwise)."""
        if self.num_used_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def take_events(self) -> list:
        """The KV-cache events recorded since the last call, oldest first."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def get_cached_block(self, block_hash: Hashable) -> KVCacheBlock | None:
        """The block holding the K/V of this hash's block, or None (a miss)."""
        if not self.enable_prefix_caching:
            return None
        return self.cached_block_hash_to_block.get(block_hash)


class PooledBlockManager(BaseBlockManager):
    """Request block tables as lists of KVCacheBlocks, over one reference-counted BlockPool.

    Holds what KVCacheManager and CowBlockManager share: the pool, each running request's blocks
    (`req_to_blocks`) and token count (`num_tokens`), the queries, and free(), which drops the
    request's reference to each of its blocks, last block first, so that a request's tail (the
    block least likely to be shared) is reused before its prefix: its cached blocks join the back
    of the free queue tail first, and its uncached blocks (with prefix caching on, usually only the
    partly filled last one) go to the front.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 enable_kv_cache_events: bool = False):
        self.block_size = check_block_size(block_size)
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching, enable_kv_cache_events)
        self.req_to_blocks: dict[object, list[KVCacheBlock]] = {}
        self.num_tokens: dict[object, int] = {}

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached or not): all of them can be handed out."""
        return self.block_pool.num_free_blocks

    @property
    def block_tables(self) -> dict[object, list[int]]:
        """Request id -> its physical block ids, in logical order (a new dict on every call)."""
        return {rid: [b.block_id for b in blocks] for rid, blocks in self.req_to_blocks.items()}

    def get_block_ids(self, request_id, start: int = 0) -> list[int]:
        """A running request's physical block ids from logical block `start` on (a new list; see BaseBlockManager)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            self._check_running(request_id, "read the blocks of")
        return [b.block_id for b in blocks[start:]]

    def free(self, request_id) -> None:
        """Drop the request's references, last block first; only blocks nobody else holds become free."""
        self._check_running(request_id, "free")
        self.block_pool.free_blocks(reversed(self.req_to_blocks.pop(request_id)))
        del self.num_tokens[request_id]
        self._forget(request_id)

    def take_events(self) -> list:
        """The pool's KV-cache events since the last call (kvlab.core.kv_events), oldest first."""
        return self.block_pool.take_events()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash when no request holds a block (vLLM's reset_prefix_cache); False otherwise."""
        return self.block_pool.reset_prefix_cache()

    def _forget(self, request_id) -> None:
        """Drop whatever else a subclass keeps about a request that was just freed."""
