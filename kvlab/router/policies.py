"""Where a router sends a request: five policies over the same inputs, shared by the live router and the simulation.

Every policy sees the prompt as its full-block hashes (hashed as the replicas hash them, hash seed included) and,
per replica that may be chosen, a ReplicaLoad: what the replica reports (waiting and running requests, KV usage,
from vLLM's /metrics names) and what the router counts itself (requests it sent that have not finished, and the
blocks they hold). The policies, from blind to cache-aware:

    round-robin     each replica in turn; ignores the prompt and the load
    least-loaded    fewest waiting requests, then lowest KV usage, then fewest in flight (a load balancer)
    approx-prefix   longest consecutive hit against the prompts this router has sent to each replica (no events:
                    llm-d's approximate prefix scorer and SGLang's router keep such a history); ties by load
    precise-prefix  longest consecutive hit in a KVBlockIndex fed by the replicas' KV-cache events (llm-d's
                    precise scorer); ties by load
    kv-cost         Dynamo's cost: overlap_score_weight x blocks still to prefill + blocks the replica is decoding

The two prefix policies are pure affinity: every request of a hot prefix goes to the replica that holds it, however
long its queue. kv-cost trades the two: a replica's hit saves `weight` per block, its active blocks cost one each.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kvlab.router.kv_index import KVBlockIndex, kv_cost

POLICIES = ("round-robin", "least-loaded", "approx-prefix", "precise-prefix", "kv-cost")


@dataclass
class ReplicaLoad:
    """What a router knows of one replica when it places a request."""

    num_waiting: int = 0          # vllm:num_requests_waiting
    num_running: int = 0          # vllm:num_requests_running
    kv_cache_usage: float = 0.0   # vllm:kv_cache_usage_perc, 0 to 1
    in_flight: int = 0            # requests this router sent there that have not finished
    active_blocks: int = 0        # blocks those requests hold (the router's estimate: prompt plus output so far)


def load_key(load: ReplicaLoad) -> tuple:
    """least-loaded's order: fewest waiting, then lowest KV usage, then fewest in flight."""
    return (load.num_waiting, load.kv_cache_usage, load.in_flight)


def _check_loads(loads: dict) -> None:
    if not loads:
        raise ValueError("no replica to route to: every replica is down or none was given")


def longest_prefix_hit(block_hashes: Sequence[Hashable], held: set) -> int:
    """How many of block_hashes a replica holding `held` serves: consecutive from the first, as a chain needs."""
    hit = 0
    for block_hash in block_hashes:
        if block_hash not in held:
            break
        hit += 1
    return hit


class RoutingPolicy:
    """Chooses a replica for a prompt's block hashes given the loads of the replicas that may serve it."""

    name = ""

    def choose(self, block_hashes: Sequence[Hashable], loads: dict[Hashable, ReplicaLoad]) -> Hashable:
        raise NotImplementedError

    def on_routed(self, replica: Hashable, block_hashes: Sequence[Hashable]) -> None:
        """Told where a request went (approx-prefix remembers it; the others need nothing)."""

    def remove_replica(self, replica: Hashable) -> None:
        """Forget a replica that died or left (its cache is gone with it)."""


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def __init__(self):
        self._turn = itertools.count()

    def choose(self, block_hashes, loads):
        _check_loads(loads)
        replicas = list(loads)
        return replicas[next(self._turn) % len(replicas)]


class LeastLoaded(RoutingPolicy):
    name = "least-loaded"

    def choose(self, block_hashes, loads):
        _check_loads(loads)
        return min(loads, key=lambda r: load_key(loads[r]))


def _best_hit(hits: dict, loads: dict):
    # The longest hit wins; among equal hits the least loaded, so that a prompt no replica holds is load-balanced.
    return min(loads, key=lambda r: (-hits.get(r, 0), load_key(loads[r])))


class ApproxPrefix(RoutingPolicy):
    """Scores replicas by the prompts this router sent them, an LRU of block hashes per replica (no events needed).

    The history can be wrong both ways: a block the replica has evicted still counts (until it ages out of the
    LRU), and blocks the replica computed for requests another router sent do not.
    """

    name = "approx-prefix"

    def __init__(self, capacity_blocks: int | None = None):
        if capacity_blocks is not None and (isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int)
                                            or capacity_blocks < 1):
            raise ValueError(f"approx_capacity_blocks must be a positive integer or None, got {capacity_blocks!r}")
        self.capacity_blocks = capacity_blocks
        self.history: dict[Hashable, OrderedDict] = {}

    def choose(self, block_hashes, loads):
        _check_loads(loads)
        hits = {r: longest_prefix_hit(block_hashes, self.history.get(r, {}).keys()) for r in loads}
        return _best_hit(hits, loads)

    def on_routed(self, replica, block_hashes):
        lru = self.history.setdefault(replica, OrderedDict())
        for block_hash in block_hashes:
            lru[block_hash] = None
            lru.move_to_end(block_hash)
        if self.capacity_blocks is not None:
            while len(lru) > self.capacity_blocks:
                lru.popitem(last=False)

    def remove_replica(self, replica):
        self.history.pop(replica, None)


class PrecisePrefix(RoutingPolicy):
    """Scores replicas by the longest consecutive hit in an index of their KV-cache events."""

    name = "precise-prefix"

    def __init__(self, index: KVBlockIndex):
        if not isinstance(index, KVBlockIndex):
            raise ValueError(f"{self.name} needs a KVBlockIndex fed by the replicas' KV-cache events, got {index!r}")
        self.index = index

    def choose(self, block_hashes, loads):
        _check_loads(loads)
        return _best_hit(self.index.longest_hits(block_hashes, loads), loads)

    def remove_replica(self, replica):
        self.index.remove_replica(replica)


class KVCost(PrecisePrefix):
    """Dynamo's cost over the events' hits: weight x blocks to prefill + active blocks; the lowest cost wins."""

    name = "kv-cost"

    def __init__(self, index: KVBlockIndex, overlap_score_weight: float = 1.0):
        super().__init__(index)
        if isinstance(overlap_score_weight, bool) or not isinstance(overlap_score_weight, (int, float)) \
                or not overlap_score_weight >= 0:
            raise ValueError(f"overlap_score_weight must be a number >= 0, got {overlap_score_weight!r}")
        self.overlap_score_weight = float(overlap_score_weight)

    def choose(self, block_hashes, loads):
        _check_loads(loads)
        hits = self.index.longest_hits(block_hashes, loads)
        n = len(block_hashes)
        # Ties (equal cost) go to the least loaded, then to the order of `loads`.
        return min(loads, key=lambda r: (kv_cost(n, hits.get(r, 0), loads[r].active_blocks, self.overlap_score_weight),
                                         load_key(loads[r])))


def make_policy(name: str, block_size: int, *, index: KVBlockIndex | None = None, overlap_score_weight: float = 1.0,
                approx_capacity_blocks: int | None = None) -> RoutingPolicy:
    """The policy called `name`; precise-prefix and kv-cost need an index of the replicas' events of this block size."""
    if name not in POLICIES:
        raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {name!r}")
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "approx-prefix":
        return ApproxPrefix(approx_capacity_blocks)
    if index is None:
        raise ValueError(f"the {name} policy reads the replicas' KV-cache events: give it a KVBlockIndex "
                         f"(and enable the replicas' --kv-events-config)")
    if isinstance(index, KVBlockIndex) and index.block_size != block_size:
        raise ValueError(f"the index hashes blocks of {index.block_size} tokens, the replicas use {block_size}")
    if name == "precise-prefix":
        return PrecisePrefix(index)
    return KVCost(index, overlap_score_weight)
