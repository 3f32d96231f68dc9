"""The routing policies: what each one reads, and the order it puts replicas in."""

import pytest

from kvlab.core.kv_events import BlockStored, KVEventBatch
from kvlab.core.prefix_cache import block_hashes
from kvlab.router import KVBlockIndex
from kvlab.router.policies import (
    POLICIES,
    ApproxPrefix,
    KVCost,
    LeastLoaded,
    PrecisePrefix,
    ReplicaLoad,
    RoundRobin,
    longest_prefix_hit,
    make_policy,
)

B = 4
PROMPT = list(range(16))
HASHES = block_hashes(PROMPT, B)


def loads(**kw):
    return {name: ReplicaLoad(**values) for name, values in kw.items()}


def index_with(holdings: dict) -> KVBlockIndex:
    index = KVBlockIndex(B)
    for replica, n in holdings.items():
        index.apply(replica, KVEventBatch(0.0, [BlockStored(HASHES[:n], None, PROMPT[:n * B], B)] if n else []))
    return index


def test_round_robin_takes_turns_whatever_the_prompt_or_load():
    policy = RoundRobin()
    state = loads(a={"num_waiting": 9}, b={}, c={})
    assert [policy.choose(HASHES, state) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_orders_by_waiting_then_kv_usage_then_in_flight():
    policy = LeastLoaded()
    assert policy.choose(HASHES, loads(a={"num_waiting": 2}, b={"num_waiting": 1, "kv_cache_usage": 0.9})) == "b"
    assert policy.choose(HASHES, loads(a={"kv_cache_usage": 0.5}, b={"kv_cache_usage": 0.2})) == "b"
    assert policy.choose(HASHES, loads(a={"in_flight": 3}, b={"in_flight": 1})) == "b"


def test_the_longest_consecutive_hit_stops_at_the_first_missing_block():
    assert longest_prefix_hit(HASHES, {HASHES[0], HASHES[1], HASHES[3]}) == 2
    assert longest_prefix_hit(HASHES, set()) == 0


def test_precise_prefix_follows_the_events_and_breaks_ties_by_load():
    policy = PrecisePrefix(index_with({"a": 1, "b": 3, "c": 0}))
    assert policy.choose(HASHES, loads(a={}, b={"num_waiting": 50}, c={})) == "b", \
        "pure affinity: the longest hit wins however long the queue"
    cold = block_hashes(list(range(100, 116)), B)
    assert policy.choose(cold, loads(a={"num_waiting": 1}, b={"num_waiting": 2}, c={})) == "c", \
        "a prompt nobody holds goes to the least loaded replica"
    assert policy.choose(HASHES, loads(a={}, c={})) == "a", "only the replicas offered are scored"


def test_approx_prefix_remembers_what_it_sent_where_and_forgets_old_blocks():
    policy = ApproxPrefix(capacity_blocks=4)
    state = loads(a={}, b={})
    first = policy.choose(HASHES, state)
    policy.on_routed(first, HASHES)
    assert policy.choose(HASHES, loads(a={"num_waiting": 5}, b={"num_waiting": 5})) == first
    other = block_hashes(list(range(50, 66)), B)
    policy.on_routed(first, other)  # 4 newer blocks push the first prompt's out of a 4-block history
    assert policy.choose(HASHES, loads(a={"num_waiting": 1}, b={})) == "b", "an aged-out history no longer counts"
    policy.remove_replica(first)
    assert first not in policy.history


def test_kv_cost_trades_hit_length_against_active_blocks():
    index = index_with({"hot": 4, "idle": 0})
    state = loads(hot={"active_blocks": 30}, idle={"active_blocks": 2})
    assert KVCost(index, 1.0).choose(HASHES, state) == "idle", "30 active blocks outweigh a 4-block hit"
    assert KVCost(index, 10.0).choose(HASHES, state) == "hot", "weighting the hit ten times keeps the affinity"
    assert KVCost(index, 0.0).choose(HASHES, loads(hot={"active_blocks": 1}, idle={"active_blocks": 2})) == "hot"


def test_make_policy_refuses_what_cannot_work():
    assert {make_policy(n, B, index=KVBlockIndex(B)).name for n in POLICIES} == set(POLICIES)
    with pytest.raises(ValueError, match="round-robin"):
        make_policy("random", B)
    with pytest.raises(ValueError, match="KV-cache events"):
        make_policy("precise-prefix", B)
    with pytest.raises(ValueError, match="8 tokens"):
        make_policy("kv-cost", B, index=KVBlockIndex(8))
    with pytest.raises(ValueError, match="overlap_score_weight"):
        make_policy("kv-cost", B, index=KVBlockIndex(B), overlap_score_weight=-1)
    with pytest.raises(ValueError, match="approx_capacity_blocks"):
        make_policy("approx-prefix", B, approx_capacity_blocks=0)
    with pytest.raises(ValueError, match="no replica"):
        LeastLoaded().choose(HASHES, {})
