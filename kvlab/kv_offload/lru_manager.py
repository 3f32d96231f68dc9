"""LRU offloading: evict the unpinned ready copy used longest ago, as vLLM's vllm/v1/kv_offload/lru_manager.py.

One ordered dict holds every held block, least recently used first. A store appends, a touch moves to
the end, and eviction walks from the front skipping pinned blocks and blocks still being stored: the same
order kvlab.core.block_pool gets from its free queue, here for copies instead of GPU blocks.

LRU's weakness is a scan: a long run of blocks used once (a batch of unrelated long prompts) pushes out
every block that was used many times. ARCOffloadingManager keeps those.
"""

from collections import OrderedDict
from collections.abc import Iterator

from kvlab.kv_offload.abstract import BlockHash
from kvlab.kv_offload.backend import Backend, BlockStatus
from kvlab.kv_offload.policy_manager import PolicyOffloadingManager


class LRUOffloadingManager(PolicyOffloadingManager):
    """Block copies of one medium evicted least recently used first."""

    def __init__(self, backend: Backend, enable_events: bool = False):
        super().__init__(backend, enable_events)
        self.blocks: OrderedDict[BlockHash, BlockStatus] = OrderedDict()  # least recently used first

    def _find(self, block_hash):
        return self.blocks.get(block_hash)

    def _refresh(self, block_hash):
        if block_hash in self.blocks:
            self.blocks.move_to_end(block_hash)

    def _choose_victims(self, num_blocks, new_hashes, protected):
        victims = []
        for block_hash, block in self.blocks.items():
            if len(victims) == num_blocks:
                break
            if block.evictable and block_hash not in protected:
                victims.append(block_hash)
        return victims if len(victims) == num_blocks else None

    def _commit_store(self, new_hashes, blocks, victims):
        for block_hash in victims:
            del self.blocks[block_hash]
        self.blocks.update(zip(new_hashes, blocks))

    def _forget(self, block_hash):
        del self.blocks[block_hash]

    def held_blocks(self) -> Iterator[tuple[BlockHash, BlockStatus]]:
        return iter(list(self.blocks.items()))
