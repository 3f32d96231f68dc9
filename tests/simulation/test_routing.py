"""Routing across simulated replicas (kvlab.simulation.routing): conservation, the policies' placements, the index fed
by the replicas' KV-cache events, the hot-prefix case and the rate search."""

import random

import pytest

from kvlab.router.policies import RoutingPolicy, load_key
from kvlab.simulation.engine import SimRequest
from kvlab.simulation.routing import (
    hot_prefix_requests,
    max_rate_scale_under_slo,
    mooncake_requests,
    policy_grid,
    prompt_block_hashes,
    rescale_arrivals,
    simulate_routing,
    weight_sweep,
)

POLICY_NAMES = ("round-robin", "least-loaded", "approx-prefix", "precise-prefix", "kv-cost")


def shared_prefix_requests(count=80, rate=20.0, groups=6, prefix_len=512, suffix_len=48, output_len=12, seed=1):
    """Requests that each open with one of `groups` system prompts of prefix_len tokens, then fresh tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(prefix_len)] for _ in range(groups)]
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(SimRequest(t, rng.choice(prefixes) + [rng.randrange(32000) for _ in range(suffix_len)],
                              output_len))
    return out


@pytest.fixture(scope="module")
def shared():
    return shared_prefix_requests()


@pytest.fixture(scope="module")
def shared_runs(shared):
    return {p: simulate_routing(shared, p, 3) for p in POLICY_NAMES}


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_request_finishes_once_on_one_replica(shared, shared_runs, policy):
    """Conservation: each request gets all its tokens and one finish, on exactly one replica, whatever the policy."""
    result = shared_runs[policy]
    assert len(result.timings) == len(result.replica_of) == len(shared)
    for request, timing in zip(shared, result.timings):
        assert timing.finish is not None and timing.finish == timing.token_times[-1]
        assert len(timing.token_times) == request.output_len  # one token per step, each once
        assert timing.first_token >= request.arrival
    engines = result.extra["engines"]
    assert [e._arrivals for e in engines] == result.requests_per_replica
    assert sum(result.requests_per_replica) == len(shared)
    assert all(not e.has_unfinished_requests() for e in engines)
    assert sum(result.prompt_tokens) == sum(len(r.prompt_token_ids) for r in shared)
    assert result.num_preemptions == 0 and result.simulated_s >= shared[-1].arrival


def test_round_robin_spreads_evenly(shared_runs):
    """Round-robin sends request i to replica i mod N, whatever the prompts and the loads."""
    result = shared_runs["round-robin"]
    assert result.replica_of == [i % 3 for i in range(len(result.replica_of))]
    assert result.request_imbalance <= 80 / 3 / (80 // 3)


def test_precise_prefix_hits_at_least_round_robin_and_its_index_matches_the_pools(shared_runs):
    """precise-prefix keeps each system prompt's requests together: more hits than round-robin; and the index that
    the replicas' KV-cache events fed holds exactly what each replica's pool has cached at the end."""
    precise, blind = shared_runs["precise-prefix"], shared_runs["round-robin"]
    assert precise.prefix_hit_rate >= blind.prefix_hit_rate
    assert precise.prefix_hit_rate > 0.5
    assert sum(precise.prefill_tokens) < sum(blind.prefill_tokens)
    for result in (precise, shared_runs["kv-cost"], blind):
        index = result.extra["index"]
        for rep, engine in enumerate(result.extra["engines"]):
            pool = set(engine.kv_cache_manager.block_pool.cached_block_hash_to_block)
            assert index.held.get(rep, set()) == pool, f"{result.policy}: replica {rep}"
        assert result.index_blocks == sum(len(e.kv_cache_manager.block_pool.cached_block_hash_to_block)
                                          for e in result.extra["engines"])
        assert not index.needs_resync and not index.seed_mismatch


def test_the_router_hashes_prompts_as_the_replicas_do(shared, shared_runs):
    """The prompt hashes the router computes are the very keys a replica's pool caches for that prompt."""
    result = shared_runs["precise-prefix"]
    engine = result.extra["engines"][result.replica_of[-1]]
    kv = engine.kv_cache_manager
    hashes = prompt_block_hashes(shared[-1].prompt_token_ids, kv.block_size, kv.hash_fn, kv.none_hash)
    assert len(hashes) == len(shared[-1].prompt_token_ids) // kv.block_size
    assert all(h in kv.block_pool.cached_block_hash_to_block for h in hashes)


@pytest.mark.parametrize("algo", ["builtin", "sha256"])
def test_a_hash_seed_is_shared_by_the_replicas_and_the_router(shared, shared_runs, algo):
    """With a hash seed the replicas' chains start from its root; the router hashes from the same root, so
    precise-prefix finds the same hits as without a seed, and the index flags no replica for another seed."""
    seeded = simulate_routing(shared, "precise-prefix", 3, hash_seed="1234", prefix_caching_hash_algo=algo)
    unseeded = shared_runs["precise-prefix"]
    assert seeded.replica_of == unseeded.replica_of
    assert seeded.prefix_hit_rate == unseeded.prefix_hit_rate
    index = seeded.extra["index"]
    assert not index.seed_mismatch and index.hash_seed == "1234"
    pools = [set(e.kv_cache_manager.block_pool.cached_block_hash_to_block) for e in seeded.extra["engines"]]
    assert [index.held[r] for r in range(3)] == pools
    assert not pools[0] & set(unseeded.extra["engines"][0].kv_cache_manager.block_pool.cached_block_hash_to_block)


class Recording(RoutingPolicy):
    """least-loaded's choice, keeping every ReplicaLoad it was shown."""

    name = "recording"

    def __init__(self):
        self.seen = []

    def choose(self, block_hashes, loads):
        self.seen.append({r: load for r, load in loads.items()})
        return min(loads, key=lambda r: load_key(loads[r]))


def test_the_router_counts_what_it_has_been_told_by_each_arrival(shared):
    """At the k-th arrival t, a replica's in_flight is the requests placed there that had not finished by t, and its
    active_blocks their blocks of prompt plus the tokens delivered by t: nothing of a step still in flight leaks."""
    recorder = Recording()
    result = simulate_routing(shared, lambda index: recorder, 3)
    assert len(recorder.seen) == len(shared)
    for k, loads in enumerate(recorder.seen):
        t = shared[k].arrival
        for rep, load in loads.items():
            mine = [(req, timing) for req, timing, r in zip(shared[:k], result.timings, result.replica_of) if r == rep]
            open_ = [(req, timing) for req, timing in mine if timing.finish > t]
            assert load.in_flight == len(open_)
            assert load.active_blocks == sum(-(-(len(req.prompt_token_ids) + sum(x <= t for x in timing.token_times))
                                                // 16) for req, timing in open_)
            assert load.num_waiting + load.num_running >= 0 and 0 <= load.kv_cache_usage <= 1


class MinActiveBlocks(RoutingPolicy):
    """A prefix-blind balancer: fewest active blocks, then least-loaded's order."""

    name = "min-active-blocks"

    def choose(self, block_hashes, loads):
        return min(loads, key=lambda r: (loads[r].active_blocks, load_key(loads[r])))


def test_kv_cost_with_weight_zero_is_load_balance(shared, shared_runs):
    """With overlap_score_weight 0 the cost is the active blocks alone: kv-cost places every request where a
    prefix-blind balancer on active blocks does, and its hits are no better than least-loaded's by design."""
    zero = simulate_routing(shared, "kv-cost", 3, overlap_score_weight=0)
    blind = simulate_routing(shared, lambda index: MinActiveBlocks(), 3)
    assert blind.policy == "min-active-blocks"
    assert zero.replica_of == blind.replica_of
    assert zero.prefix_hit_rate < shared_runs["kv-cost"].prefix_hit_rate


@pytest.fixture(scope="module")
def hot():
    return hot_prefix_requests(240, 48.0, prefix_len=2048, output_len=128, seed=3)


def test_hot_prefix_piles_on_one_replica_under_pure_affinity(hot):
    """A prefix too hot for one replica: precise-prefix sends nearly every hot request to its holder and loses the
    TTFT tail and the SLO to kv-cost, whose cost sends requests elsewhere, and to least-loaded; kv-cost with a huge
    weight piles them as precise-prefix does. Replicas of 32 sequences at most: the hot share needs about 100."""
    runs = {p: simulate_routing(hot, p, 3, max_num_seqs=32) for p in ("least-loaded", "precise-prefix", "kv-cost")}
    heavy = simulate_routing(hot, "kv-cost", 3, overlap_score_weight=1e6, max_num_seqs=32)
    precise, cost, least = runs["precise-prefix"], runs["kv-cost"], runs["least-loaded"]
    assert least.slo_attainment() > 0.95
    assert max(precise.requests_per_replica) > 0.75 * len(hot)
    assert max(heavy.requests_per_replica) > 0.75 * len(hot)
    assert max(cost.requests_per_replica) < 0.5 * len(hot)
    p99 = {name: r.latency()["ttft"]["p99"] for name, r in runs.items()}
    assert p99["precise-prefix"] > 5 * p99["kv-cost"]
    assert p99["precise-prefix"] > 5 * p99["least-loaded"]
    assert precise.slo_attainment() < cost.slo_attainment()
    assert cost.slo_attainment() > 0.95
    # Affinity does save prefill: the pile's replica computes the prefix once.
    assert sum(precise.prefill_tokens) <= sum(cost.prefill_tokens)


def test_weight_sweep_and_grid_return_rows(hot):
    """The chapter's plot data: one summary per weight and per baseline, one per policy and replica count."""
    small = hot[:60]
    sweep = weight_sweep(small, 2, [0, 1e6], baselines=("least-loaded",))
    assert [row["weight"] for row in sweep["kv-cost"]] == [0, 1e6]
    assert sweep["least-loaded"]["requests"] == 60
    rows = policy_grid(small, ("round-robin", "kv-cost"), (1, 2))
    assert [(r["policy"], r["replicas"]) for r in rows] == [("round-robin", 1), ("kv-cost", 1), ("round-robin", 2),
                                                            ("kv-cost", 2)]
    assert rows[0]["requests_per_replica"] == [60]
    with pytest.raises(ValueError, match="weights"):
        weight_sweep(small, 2, [])


def test_rate_search_brackets_the_breaking_scale():
    """The highest rate scale found meets the objective; one tolerance above it fails."""
    requests = shared_prefix_requests(count=60, rate=2.0, output_len=40, prefix_len=2048, suffix_len=512)
    search = max_rate_scale_under_slo(requests, "least-loaded", 1, 1.0, 256.0, 8.0, ttft_slo=0.5, tpot_slo=0.1)
    assert search.rate_scale is not None and 1.0 <= search.rate_scale < 256.0
    assert search.runs[search.rate_scale]["met"]
    failed = [s for s, run in search.runs.items() if not run["met"]]
    assert failed and min(failed) - search.rate_scale <= 8.0
    # At a rate scale no deployment holds, nothing is found.
    assert max_rate_scale_under_slo(requests, "least-loaded", 1, 1e4, 2e4, 1e3, ttft_slo=0.01,
                                    tpot_slo=0.1).rate_scale is None


def test_mooncake_slice_keeps_the_trace_sharing():
    """A slice of the Mooncake trace, time-compressed: arrivals divided by the scale, equal hash ids equal tokens."""
    plain = mooncake_requests(40)
    fast = mooncake_requests(40, rate_scale=4.0)
    assert [r.arrival for r in fast] == pytest.approx([r.arrival / 4 for r in plain])
    assert rescale_arrivals(plain, 4.0)[-1].arrival == pytest.approx(fast[-1].arrival)
    assert plain[0].prompt_token_ids == fast[0].prompt_token_ids
    assert all(len(r.prompt_token_ids) > 0 for r in plain)


def test_bad_arguments_are_clear_errors(shared):
    """Each bad argument names itself."""
    with pytest.raises(ValueError, match="num_replicas"):
        simulate_routing(shared, "round-robin", 0)
    with pytest.raises(ValueError, match="round-robin, least-loaded"):
        simulate_routing(shared, "random", 2)
    with pytest.raises(ValueError, match="sorted by arrival"):
        simulate_routing(list(reversed(shared)), "round-robin", 2)
    with pytest.raises(ValueError, match=r"requests\[0\] must be a SimRequest"):
        simulate_routing([(0.0, [1, 2], 3)], "round-robin", 2)
    with pytest.raises(ValueError, match="sequence"):
        simulate_routing(iter(shared), "round-robin", 2)
    with pytest.raises(ValueError, match="overlap_score_weight"):
        simulate_routing(shared, "kv-cost", 2, overlap_score_weight=-1)
    with pytest.raises(ValueError, match="max_model_len"):
        simulate_routing([SimRequest(0.0, [1] * 9000, 8)], "round-robin", 2)
    with pytest.raises(ValueError, match="hot_fraction"):
        hot_prefix_requests(10, 1.0, hot_fraction=1.5)
    with pytest.raises(ValueError, match="rate_scale"):
        rescale_arrivals(shared, 0)
    with pytest.raises(ValueError, match="rate_scale"):
        mooncake_requests(5, rate_scale=-1)
