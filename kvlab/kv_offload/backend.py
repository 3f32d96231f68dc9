"""A medium's block ids and each held block's status: what an OffloadingManager allocates from.

As vLLM's vllm/v1/kv_offload/backend.py: the manager decides which hashes to keep, the backend hands out
and takes back the medium's ids (slots in a host pool, or a disk budget's slots). Ids are handed out lowest
first so a test can predict them; no id is ever held twice.
"""

import heapq
from collections.abc import Sequence

from kvlab.kv_offload.abstract import BlockHash, LoadStoreSpec
from kvlab.validation import check_block_size, check_positive_int


class BlockStatus:
    """One held block copy: its id in the medium, how many loads are in flight (ref_cnt), and whether it is ready.

    A copy is ready once its store completed; until then nobody may load it and nobody may evict it.
    """

    __slots__ = ("block_id", "ref_cnt", "is_ready")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.is_ready = False

    @property
    def evictable(self) -> bool:
        """Ready and with no load in flight: the only blocks a policy may throw away."""
        return self.is_ready and self.ref_cnt == 0

    def __repr__(self) -> str:
        return f"BlockStatus(block_id={self.block_id}, ref_cnt={self.ref_cnt}, is_ready={self.is_ready})"


class Backend:
    """The num_blocks ids of one medium (named `medium`), holding blocks of block_size tokens each."""

    def __init__(self, medium: str, block_size: int, num_blocks: int):
        if not isinstance(medium, str) or not medium:
            raise ValueError(f"medium must be a non-empty name such as 'CPU', got {medium!r}")
        self.medium = medium
        self.block_size = check_block_size(block_size)
        self.num_blocks = check_positive_int("num_blocks", num_blocks)
        # A min-heap, so the lowest free id goes first.
        self._free_ids = list(range(self.num_blocks))
        self._held: set[int] = set()

    def get_num_free_blocks(self) -> int:
        """How many ids are not held by any block."""
        return len(self._free_ids)

    def allocate_blocks(self, block_hashes: Sequence[BlockHash]) -> list[BlockStatus]:
        """One new (not ready) BlockStatus per hash; ValueError, changing nothing, if too few ids are free."""
        if len(block_hashes) > len(self._free_ids):
            raise ValueError(f"{self.medium}: {len(block_hashes)} blocks asked for but only "
                             f"{len(self._free_ids)} of {self.num_blocks} ids are free; evict first")
        blocks = [BlockStatus(heapq.heappop(self._free_ids)) for _ in block_hashes]
        self._held.update(b.block_id for b in blocks)
        return blocks

    def free(self, block: BlockStatus) -> None:
        """Give block's id back; ValueError if the id is not held (freed twice, or never allocated here)."""
        if block.block_id not in self._held:
            raise ValueError(f"{self.medium}: block id {block.block_id} is not allocated (freed twice?)")
        self._held.remove(block.block_id)
        heapq.heappush(self._free_ids, block.block_id)

    def get_load_store_spec(self, block_hashes: Sequence[BlockHash], blocks: Sequence[BlockStatus]) -> LoadStoreSpec:
        """Where these blocks live in this medium, in the order given."""
        if len(block_hashes) != len(blocks):
            raise ValueError(f"block_hashes has {len(block_hashes)} entries but blocks has {len(blocks)}")
        return LoadStoreSpec(self.medium, tuple(b.block_id for b in blocks), tuple(block_hashes))
