"""ARC offloading: Megiddo and Modha's Adaptive Replacement Cache, as vLLM's vllm/v1/kv_offload/arc_manager.py.

N. Megiddo and D. S. Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", USENIX FAST 2003.

ARC splits the c = num_blocks held copies into two LRU lists and remembers the hashes it evicted from each:

* T1: copies used once since they were stored (recency); T2: copies used at least twice (frequency);
* B1, B2: ghost lists, hashes only (no id, no data) of copies recently evicted from T1 and T2;
* p (target_t1_size): how many of the c copies T1 should get. Storing again a hash found in B1 means T1
  was too small, so p grows by max(|B2| / |B1|, 1); a hash found in B2 shrinks it by max(|B1| / |B2|, 1).

To make room ARC evicts T1's least recently used copy while |T1| > p (or |T1| == p and the hash being
stored is in B2), and T2's otherwise; the evicted hash joins the matching ghost list, and ghosts are
trimmed so that |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c. A hash stored again from a ghost list
goes straight to T2: it has now been wanted twice.

The point for KV offloading is scan resistance: a burst of prompts used once fills T1 and evicts within
T1, while the shared system prompt's blocks, used over and over, sit in T2. Plain LRU loses them.

Adaptations to offloading, where the paper's single "request x" becomes the calls of OffloadingManager:

* a hit is a touch: T1 -> T2, T2 -> its most recent end (a copy still being stored stays in T1);
* a miss is a prepare_store: p adapts there, since a ghost means the copy is gone and must be stored again;
* pinned copies and copies still being stored are skipped when evicting; if the preferred list has none
  to give, the other list gives one, and if neither can, prepare_store returns None;
* a failed store drops its copies without ghosts (they never held data), but p keeps what it learned.
"""

from collections import OrderedDict
from collections.abc import Iterator

from kvlab.kv_offload.abstract import BlockHash
from kvlab.kv_offload.backend import Backend, BlockStatus
from kvlab.kv_offload.policy_manager import PolicyOffloadingManager


class ARCOffloadingManager(PolicyOffloadingManager):
    """Block copies of one medium evicted by ARC: T1/T2 hold copies, B1/B2 remember evicted hashes."""

    def __init__(self, backend: Backend, enable_events: bool = False):
        super().__init__(backend, enable_events)
        self.t1: OrderedDict[BlockHash, BlockStatus] = OrderedDict()  # least recently used first, in each list
        self.t2: OrderedDict[BlockHash, BlockStatus] = OrderedDict()
        self.b1: OrderedDict[BlockHash, None] = OrderedDict()
        self.b2: OrderedDict[BlockHash, None] = OrderedDict()
        self.target_t1_size = 0.0  # the paper's p, between 0 and c

    @property
    def capacity(self) -> int:
        """The paper's c: how many copies the medium holds."""
        return self.backend.num_blocks

    def _find(self, block_hash):
        block = self.t1.get(block_hash)
        return self.t2.get(block_hash) if block is None else block

    def _refresh(self, block_hash):
        if block_hash in self.t1:
            block = self.t1.pop(block_hash)
            # A use of a ready copy is its second: promote. One still being stored has not been used yet.
            (self.t2 if block.is_ready else self.t1)[block_hash] = block
        elif block_hash in self.t2:
            self.t2.move_to_end(block_hash)

    def _adapted_target(self, new_hashes: list[BlockHash]) -> float:
        """p after the ghost hits among new_hashes, taken one at a time as the paper's requests would be."""
        p, n1, n2 = self.target_t1_size, len(self.b1), len(self.b2)
        for block_hash in new_hashes:
            if block_hash in self.b1:
                p = min(float(self.capacity), p + max(n2 / n1, 1.0))
                n1 -= 1
            elif block_hash in self.b2:
                p = max(0.0, p - max(n1 / n2, 1.0))
                n2 -= 1
        return p

    def _choose_victims(self, num_blocks, new_hashes, protected):
        p = self._adapted_target(new_hashes)
        storing_a_b2_ghost = any(h in self.b2 for h in new_hashes)
        candidates = {
            name: iter([h for h, b in lst.items() if b.evictable and h not in protected])
            for name, lst in (("t1", self.t1), ("t2", self.t2))
        }
        t1_size, victims = len(self.t1), []
        while len(victims) < num_blocks:
            prefer_t1 = t1_size >= 1 and (t1_size > p or (storing_a_b2_ghost and t1_size == p))
            order = ("t1", "t2") if prefer_t1 else ("t2", "t1")
            for name in order:
                victim = next(candidates[name], None)
                if victim is not None:
                    victims.append(victim)
                    t1_size -= name == "t1"
                    break
            else:
                return None
        return victims

    def _commit_store(self, new_hashes, blocks, victims):
        self.target_t1_size = self._adapted_target(new_hashes)
        for block_hash in victims:
            if block_hash in self.t1:
                del self.t1[block_hash]
                self.b1[block_hash] = None
            else:
                del self.t2[block_hash]
                self.b2[block_hash] = None
        for block_hash, block in zip(new_hashes, blocks):
            if block_hash in self.b1 or block_hash in self.b2:
                self.b1.pop(block_hash, None)
                self.b2.pop(block_hash, None)
                self.t2[block_hash] = block
            else:
                self.t1[block_hash] = block
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            (self.b2 if self.b2 else self.b1).popitem(last=False)

    def _forget(self, block_hash):
        if self.t1.pop(block_hash, None) is None:
            del self.t2[block_hash]

    def held_blocks(self) -> Iterator[tuple[BlockHash, BlockStatus]]:
        return iter(list(self.t1.items()) + list(self.t2.items()))
