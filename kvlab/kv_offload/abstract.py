"""The offloading API: what the scheduler asks of a tier that keeps copies of KV blocks by their hash.

This is the list-based form of vLLM V1's OffloadingManager (vllm/v1/kv_offload/abstract.py as first
released). One manager runs in the scheduler and owns one medium (CPU memory, a disk directory); it never
touches tensors, it only answers where each block's copy lives and which copies may be thrown away.

A block copy moves through these states, keyed by its block hash (kvlab.core.prefix_cache's hash):

    absent --prepare_store--> being stored --complete_store(success=True)--> ready
    being stored --complete_store(success=False)--> absent (its id freed, as if never asked)
    ready --prepare_load--> pinned (ref_cnt > 0) --complete_load--> ready
    ready and unpinned --evicted by a later prepare_store--> absent

Invariants every manager keeps:

* lookup(hashes) is the number of leading hashes whose copies are ready: a prefix, because block i's K/V
  is only useful with blocks 0..i-1 (each hash chains its parent's);
* a pinned block (a load in flight) or one still being stored is never evicted;
* the medium never holds more blocks than it has ids;
* a call that cannot be honoured raises ValueError naming the block and changes nothing, and
  prepare_store that cannot make room returns None and changes nothing.

Newer vLLM (the same file, vllm/v1/kv_offload/abstract.py, in later releases) keys the calls per block with
an offload key and a per-request context instead of a bare list of hashes, and lets lookup answer None for
"ask again later" while a copy is in flight. The list form here is the one the course builds on.
"""

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

BlockHash = Hashable  # bytes from sha256 in an engine, any hashable in a test


@dataclass(frozen=True)
class LoadStoreSpec:
    """Where a transfer reads or writes: a medium's name and the block ids in that medium, in transfer order.

    block_hashes travel along (same order) for media that name their blocks by hash, such as a disk directory.
    """

    medium: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...] = field(default=())


@dataclass
class PrepareStoreOutput:
    """What prepare_store decided: the hashes to copy out (those not already held), where to, and who made room."""

    block_hashes_to_store: list[BlockHash]
    store_spec: LoadStoreSpec
    block_hashes_evicted: list[BlockHash]


@dataclass(frozen=True)
class OffloadingEvent:
    """Blocks that became ready in (removed=False) or were evicted from (removed=True) a medium, for KV events."""

    block_hashes: list[BlockHash]
    block_size: int
    medium: str
    removed: bool


class OffloadingManager(ABC):
    """The scheduler's view of one offloading medium: which block copies it holds and which it may evict."""

    @abstractmethod
    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        """How many of block_hashes, from the first, have a ready copy in this medium."""

    @abstractmethod
    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        """Pin these ready blocks against eviction until complete_load, and say where to read them."""

    @abstractmethod
    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        """Mark these blocks as just used, so the eviction policy keeps them longer."""

    @abstractmethod
    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        """Unpin blocks whose load (from prepare_load) has finished."""

    @abstractmethod
    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        """Reserve room for the blocks not yet held, evicting if needed; None (nothing changed) if it cannot."""

    @abstractmethod
    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Mark stored blocks ready (success) or forget them and free their ids (failure)."""

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The events since the last call, oldest first, then forgotten; none from a manager that keeps none."""
        return ()
