"""A router's view of many replicas' prefix caches, rebuilt from their KV-cache events (kvlab.core.kv_events).

llm-d's KV-cache manager and NVIDIA Dynamo's KV router keep the same structure: an index from block hash to
the replicas that hold it, fed by each replica's BlockStored / BlockRemoved / AllBlocksCleared events. To place
a request, the router hashes its prompt's full blocks exactly as the replicas do (kvlab.core.prefix_cache) and
asks, per replica, for the **longest consecutive hit** from the first block: block i is only useful after
blocks 0 .. i-1 (each hash chains its parent's), so a replica holding blocks 0, 1 and 3 serves two.

Two ways the index goes stale, each detected here rather than silently mis-routing:

* a missed batch: events carry sequence numbers per replica, and a gap marks that replica as needing a resync
  (its entries are dropped until it is replayed or re-registered, since they may name evicted blocks);
* a different hash seed: a replica whose first block hashes differently from the router's (vLLM's NONE_HASH
  comes from PYTHONHASHSEED, random when unset) reports hashes no prompt the router hashes will ever match.
  BlockStored carries the token ids, so the router re-hashes every block stored at a sequence's start
  (parent None) from its own seed's root and flags the replica on the first mismatch. kvlab's engines take the
  seed as hash_seed (`kvlab serve`: $PYTHONHASHSEED); the index takes the router's.

choose_by_cost is the trade-off Dynamo's router documents: for each replica, the blocks it would have to
prefill (the prompt's blocks less its hit) weighted by overlap_score_weight, plus the blocks it is already
decoding; the lowest cost wins. A weight of 0 is pure load balance, a large weight pure prefix affinity.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from kvlab.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvlab.core.prefix_cache import chain_hashes, hash_block_tokens, none_hash
from kvlab.validation import check_block_size


class KVBlockIndex:
    """Block hash -> replicas holding it, per replica the hashes it holds, and each replica's event health."""

    def __init__(self, block_size: int, hash_fn=hash_block_tokens, hash_seed: str | int | None = None):
        self.block_size = check_block_size(block_size)
        self.hash_fn = hash_fn
        self.hash_seed = hash_seed
        self.none_hash = none_hash(hash_seed)
        self.holders: dict[Hashable, set] = {}
        self.held: dict[Hashable, set] = {}        # replica -> its hashes
        self.last_seq: dict[Hashable, int] = {}
        self.needs_resync: set = set()             # replicas whose stream had a gap
        self.seed_mismatch: set = set()            # replicas whose first blocks hash differently

    @property
    def replicas(self) -> list:
        """Every replica the index has heard of, in the order it first did."""
        return list(self.held)

    def apply(self, replica: Hashable, batch: KVEventBatch, seq: int | None = None) -> None:
        """Apply one replica's batch; a seq that skips numbers marks the replica for a resync and drops its entries."""
        if seq is not None:
            last = self.last_seq.get(replica)
            if last is not None and seq <= last:
                return  # a replayed batch already applied
            if last is not None and seq != last + 1:
                self.needs_resync.add(replica)
                self.clear(replica)
            self.last_seq[replica] = seq
        self.held.setdefault(replica, set())
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(replica, event)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._forget(replica, block_hash)
            elif isinstance(event, AllBlocksCleared):
                self.clear(replica)
            else:
                raise ValueError(f"not a KV-cache event: {event!r}")

    def _stored(self, replica, event: BlockStored) -> None:
        if event.block_size != self.block_size:
            raise ValueError(f"replica {replica!r} reports blocks of {event.block_size} tokens; this index hashes "
                             f"blocks of {self.block_size}")
        if event.parent_block_hash is None and event.token_ids:
            mine = self.hash_fn(self.none_hash, event.token_ids[:self.block_size])
            if mine != event.block_hashes[0]:
                self.seed_mismatch.add(replica)
        for block_hash in event.block_hashes:
            self.holders.setdefault(block_hash, set()).add(replica)
            self.held[replica].add(block_hash)

    def _forget(self, replica, block_hash) -> None:
        holders = self.holders.get(block_hash)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self.holders[block_hash]
        self.held.get(replica, set()).discard(block_hash)

    def clear(self, replica: Hashable) -> None:
        """Forget everything a replica holds (AllBlocksCleared, a gap in its events, a replica that died)."""
        for block_hash in list(self.held.get(replica, ())):
            self._forget(replica, block_hash)

    def remove_replica(self, replica: Hashable) -> None:
        """Drop a replica entirely, its entries and its health flags."""
        self.clear(replica)
        for table in (self.held, self.last_seq):
            table.pop(replica, None)
        self.needs_resync.discard(replica)
        self.seed_mismatch.discard(replica)

    def longest_hits(self, block_hashes: Sequence[Hashable], replicas: Iterable | None = None) -> dict:
        """Per replica (default: every healthy one), how many of block_hashes it holds consecutively from the first."""
        candidates = [r for r in (self.replicas if replicas is None else replicas)
                      if r not in self.needs_resync and r not in self.seed_mismatch]
        hits = dict.fromkeys(candidates, 0)
        alive = set(candidates)
        for block_hash in block_hashes:
            alive &= self.holders.get(block_hash, set())
            if not alive:
                break
            for replica in alive:
                hits[replica] += 1
        return hits

    def prompt_hits(self, token_ids: Sequence[int], replicas: Iterable | None = None) -> dict:
        """longest_hits for a prompt's full blocks, hashed as the replicas hash them."""
        return self.longest_hits(self.block_hashes(token_ids), replicas)

    def block_hashes(self, token_ids: Sequence[int]) -> list:
        """A prompt's full-block hashes as replicas that share this index's seed and hash function name them."""
        return chain_hashes(list(token_ids), self.block_size, self.hash_fn, self.none_hash)


def kv_cost(num_prompt_blocks: int, hit_blocks: int, active_blocks: int, overlap_score_weight: float = 1.0) -> float:
    """Dynamo's routing cost: weight x blocks still to prefill, plus blocks already being decoded."""
    if not 0 <= hit_blocks <= num_prompt_blocks:
        raise ValueError(f"hit_blocks must be between 0 and num_prompt_blocks ({num_prompt_blocks}), got {hit_blocks}")
    if active_blocks < 0 or overlap_score_weight < 0:
        raise ValueError(f"active_blocks and overlap_score_weight must be >= 0, got {active_blocks} and "
                         f"{overlap_score_weight}")
    return overlap_score_weight * (num_prompt_blocks - hit_blocks) + active_blocks


def choose_by_cost(num_prompt_blocks: int, hits: dict, active_blocks: dict, overlap_score_weight: float = 1.0):
    """The replica of least kv_cost (ties: the first listed in active_blocks); ValueError with no replica."""
    if not active_blocks:
        raise ValueError("no replica to choose from")
    return min(active_blocks, key=lambda r: kv_cost(num_prompt_blocks, hits.get(r, 0), active_blocks[r],
                                                    overlap_score_weight))
