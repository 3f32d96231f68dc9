"""What LRU and ARC share: validation, pinning, the backend's ids and the events; the policy only orders.

A policy subclass keeps the held blocks in its own lists and answers four questions: which block does a
hash name (_find), how does a use reorder the lists (_refresh), which unpinned ready blocks would it evict to
make room for n new ones (_choose_victims, without changing anything), and how do the lists change once
the store goes ahead (_commit_store) or a block is dropped without trace (_forget).

Every public call checks all its arguments before it changes anything, so a ValueError leaves the manager
exactly as it was.
"""

from abc import abstractmethod
from collections import Counter
from collections.abc import Iterable, Iterator

from kvlab.kv_offload.abstract import (
    BlockHash,
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
)
from kvlab.kv_offload.backend import Backend, BlockStatus


class PolicyOffloadingManager(OffloadingManager):
    """An OffloadingManager over one Backend; subclasses supply the eviction order."""

    def __init__(self, backend: Backend, enable_events: bool = False):
        if not isinstance(backend, Backend):
            raise ValueError(f"backend must be a kvlab.kv_offload.Backend, got {type(backend).__name__}")
        self.backend = backend
        self.events: list[OffloadingEvent] | None = [] if enable_events else None

    # The policy's part.
    @abstractmethod
    def _find(self, block_hash: BlockHash) -> BlockStatus | None:
        """The held block for this hash (ready or being stored), or None."""

    @abstractmethod
    def _refresh(self, block_hash: BlockHash) -> None:
        """Record one use of a held or remembered hash."""

    @abstractmethod
    def _choose_victims(self, num_blocks: int, new_hashes: list[BlockHash],
                        protected: set[BlockHash]) -> list[BlockHash] | None:
        """num_blocks evictable hashes not in protected, in eviction order, or None; changes nothing."""

    @abstractmethod
    def _commit_store(self, new_hashes: list[BlockHash], blocks: list[BlockStatus],
                      victims: list[BlockHash]) -> None:
        """Drop the victims from the lists and add the new blocks (not ready yet)."""

    @abstractmethod
    def _forget(self, block_hash: BlockHash) -> None:
        """Drop a held block from the lists, leaving no memory of it (a failed store)."""

    @abstractmethod
    def held_blocks(self) -> Iterator[tuple[BlockHash, BlockStatus]]:
        """Every held block with its hash, in the policy's eviction order (first evicted first)."""

    # The API.
    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        hit = 0
        for block_hash in block_hashes:
            block = self._find(block_hash)
            if block is None or not block.is_ready:
                break
            hit += 1
        return hit

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        block_hashes = list(block_hashes)
        blocks = []
        for block_hash in block_hashes:
            block = self._find(block_hash)
            if block is None:
                raise ValueError(f"prepare_load: block {block_hash!r} is not offloaded to {self.backend.medium}; "
                                 "load only the prefix that lookup counted")
            if not block.is_ready:
                raise ValueError(f"prepare_load: block {block_hash!r} is still being stored to "
                                 f"{self.backend.medium}; wait for complete_store")
            blocks.append(block)
        for block in blocks:
            block.ref_cnt += 1
        return self.backend.get_load_store_spec(block_hashes, blocks)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        # Last hash first, so the first block of a prefix ends up the most recently used: without it the
        # blocks after it are useless (lookup stops at the first miss), so it should be evicted last.
        for block_hash in reversed(list(block_hashes)):
            self._refresh(block_hash)

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        counts = Counter(block_hashes)
        for block_hash, n in counts.items():
            block = self._find(block_hash)
            pinned = 0 if block is None else block.ref_cnt
            if pinned < n:
                raise ValueError(f"complete_load: block {block_hash!r} has {pinned} load(s) in flight in "
                                 f"{self.backend.medium} but {n} completion(s) were given; "
                                 "complete only what prepare_load pinned")
        for block_hash, n in counts.items():
            self._find(block_hash).ref_cnt -= n

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        block_hashes = list(block_hashes)
        # Held blocks (ready or being stored) are skipped, and so is a repeat within the call.
        new_hashes = list(dict.fromkeys(h for h in block_hashes if self._find(h) is None))
        shortfall = len(new_hashes) - self.backend.get_num_free_blocks()
        victims: list[BlockHash] = []
        if shortfall > 0:
            # The caller's own held blocks are about to be useful again: never evict them to make room.
            chosen = self._choose_victims(shortfall, new_hashes, set(block_hashes))
            if chosen is None:
                return None
            victims = chosen
        victim_blocks = [self._find(h) for h in victims]
        assert all(b is not None and b.evictable for b in victim_blocks), "a policy chose a pinned or unready victim"
        for block in victim_blocks:
            self.backend.free(block)
        blocks = self.backend.allocate_blocks(new_hashes)
        self._commit_store(new_hashes, blocks, victims)
        if victims and self.events is not None:
            self.events.append(OffloadingEvent(list(victims), self.backend.block_size, self.backend.medium, True))
        return PrepareStoreOutput(new_hashes, self.backend.get_load_store_spec(new_hashes, blocks), list(victims))

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        block_hashes = list(dict.fromkeys(block_hashes))
        unknown = [h for h in block_hashes if self._find(h) is None]
        if unknown:
            raise ValueError(f"complete_store: block {unknown[0]!r} was never prepared for {self.backend.medium} "
                             "(or its store already failed); call prepare_store first")
        # Hashes that were already ready were skipped by prepare_store: nothing to complete for them.
        pending = [h for h in block_hashes if not self._find(h).is_ready]
        if success:
            for block_hash in pending:
                self._find(block_hash).is_ready = True
            if pending and self.events is not None:
                self.events.append(OffloadingEvent(pending, self.backend.block_size, self.backend.medium, False))
        else:
            for block_hash in pending:
                block = self._find(block_hash)
                self._forget(block_hash)
                self.backend.free(block)

    def remove(self, block_hashes: Iterable[BlockHash]) -> None:
        """Forget ready, unpinned copies whose data turned out to be gone (a deleted or corrupted file): their ids
        go back to the backend, as if evicted. Not part of vLLM's API; ValueError, changing nothing, for a block
        that is not held, still being stored, or pinned by a load."""
        block_hashes = list(dict.fromkeys(block_hashes))
        for block_hash in block_hashes:
            block = self._find(block_hash)
            if block is None or not block.evictable:
                state = "not held" if block is None else ("pinned by a load" if block.ref_cnt else "being stored")
                raise ValueError(f"remove: block {block_hash!r} is {state} in {self.backend.medium}; only a ready, "
                                 "unpinned copy can be removed")
        for block_hash in block_hashes:
            block = self._find(block_hash)
            self._forget(block_hash)
            self.backend.free(block)
        if block_hashes and self.events is not None:
            self.events.append(OffloadingEvent(block_hashes, self.backend.block_size, self.backend.medium, True))

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return []
        events, self.events = self.events, []
        return events
