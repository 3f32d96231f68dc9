"""Routing across replicas by their prefix caches.

    kv_index    the index a cache-aware router rebuilds from replicas' KV-cache events; Dynamo's cost
    policies    round-robin, least-loaded, approx-prefix, precise-prefix and kv-cost over the same inputs, shared by
                the live router (kvlab.entrypoints.router) and the simulation (kvlab.simulation.routing)
"""

from kvlab.router.kv_index import KVBlockIndex, choose_by_cost, kv_cost
from kvlab.router.policies import POLICIES, ReplicaLoad, RoutingPolicy, make_policy

__all__ = ["POLICIES", "KVBlockIndex", "ReplicaLoad", "RoutingPolicy", "choose_by_cost", "kv_cost", "make_policy"]
