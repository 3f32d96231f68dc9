"""Routing across replicas by their prefix caches: the index a cache-aware router rebuilds from KV-cache events."""

from kvlab.router.kv_index import KVBlockIndex, choose_by_cost, kv_cost

__all__ = ["KVBlockIndex", "choose_by_cost", "kv_cost"]
