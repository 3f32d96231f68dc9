"""An offloading tier in the simulated engine: the real OffloadingConnector decides, the simulated worker times.

Hits from the tier must replace prefill tokens one for one; a load must cost its bytes over the link's bandwidth
(delaying only its own request when asynchronous, the step when synchronous), saves max(pass, copy); no tier, or a
tier that never serves a hit and saves faster than the passes compute, must give exactly the old results; after
a run nothing may stay pinned, parked or remembered.
"""

import random

import pytest

from kvlab.kv_transfer import KVConnectorFactory, KVConnectorRole, KVTransferConfig
from kvlab.simulation.engine import SimRequest, SimulatedEngine, offloading_tier, resolve_model, simulate
from kvlab.simulation.offload import KVTransferLinks, host_link_bytes_per_s

BLOCK = 16
DOC = [random.Random(1).randrange(1, 30000) for _ in range(40 * BLOCK)]        # 40 full blocks
OTHER = [random.Random(2).randrange(1, 30000) for _ in range(47 * BLOCK)]     # with its outputs, the whole pool


def revisit(gap: float = 10.0) -> list[SimRequest]:
    """A document, another one that evicts it from a 48-block pool, then the first again with a new question."""
    return [SimRequest(0.0, DOC, 8), SimRequest(gap, OTHER, 8), SimRequest(2 * gap, DOC + [7] * 100, 8)]


def connector(size_bytes: int, bytes_per_block: int, async_loads: bool = True):
    config = KVTransferConfig("OffloadingConnector", "kv_both",
                              {"kv_offloading_size": size_bytes, "async_loads": async_loads})
    return KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, block_size=BLOCK,
                                               bytes_per_block=bytes_per_block)


def engine(step_s: float, links: KVTransferLinks | None, async_loads: bool = True, num_blocks: int = 48):
    tier = {} if links is None else dict(kv_connector=connector(1000 * links.bytes_per_block, links.bytes_per_block,
                                                                async_loads), kv_transfer_links=links)
    return SimulatedEngine(lambda step: step_s, num_blocks, 4096, BLOCK, max_num_batched_tokens=2048, **tier)


def test_hits_from_the_tier_replace_prefill_tokens_one_for_one():
    plain = simulate(revisit(), "llama-3-8b", "H100-SXM", max_model_len=4096, num_blocks=48)
    tiered = simulate(revisit(), "llama-3-8b", "H100-SXM", max_model_len=4096, num_blocks=48,
                      kv_offloading_size=1 << 30)
    assert plain.num_cached_prompt_tokens == 0, "set-up: the second document must evict the first from the GPU"
    assert tiered.num_tier_hit_tokens == 40 * BLOCK, "the revisit loads the first document's 40 blocks from the tier"
    assert tiered.num_tokens_computed == plain.num_tokens_computed - tiered.num_tier_hit_tokens
    assert tiered.num_saved_blocks == 40 + 47 + 6, "every full prompt block is offloaded once (the revisit: 6 new)"
    assert tiered.timings[2].ttft < plain.timings[2].ttft, "loading 640 tokens over PCIe beats prefilling them"


@pytest.mark.parametrize("async_loads", [True, False])
def test_a_load_costs_its_bytes_over_the_bandwidth(async_loads):
    links = KVTransferLinks(2 << 20, load_bytes_per_s=1e9, save_bytes_per_s=1e12)   # 2 MiB blocks, 2.1 ms each
    step = 0.001
    result = engine(step, links, async_loads).run(revisit(), record_steps=True)
    load = 40 * (2 << 20) / 1e9
    assert result.num_loaded_blocks == 40 and result.load_s == pytest.approx(load, rel=1e-12)
    # Asynchronous: the admission step only polls until the copy ends, then the rest of the prompt runs.
    # Synchronous: the forward pass of the admission step waits for the copy.
    expected = (max(step, load) + step) if async_loads else (load + step)
    assert result.timings[2].ttft == pytest.approx(expected, rel=1e-9)
    assert result.load_wait_s == pytest.approx(0.0 if async_loads else load, rel=1e-12)


def test_saves_hide_behind_the_pass_until_they_take_longer():
    save = 40 * (2 << 20)                                   # the first document's 40 blocks, saved in its prefill
    hidden = engine(0.05, KVTransferLinks(2 << 20, 1e9, 1e10)).run(revisit(), record_steps=True)
    bound = engine(0.05, KVTransferLinks(2 << 20, 1e9, 1e8)).run(revisit(), record_steps=True)
    assert hidden.steps[0].end - hidden.steps[0].start == pytest.approx(0.05), \
        f"{save / 1e10 * 1e3:.1f} ms of saves hide behind a 50 ms pass"
    assert bound.steps[0].end - bound.steps[0].start == pytest.approx(save / 1e8), "the step lasts as long as its saves"
    assert bound.save_bound_s >= save / 1e8 - 0.05 and hidden.save_bound_s == 0


def test_no_tier_or_a_tier_that_never_hits_gives_the_old_results():
    rng = random.Random(0)
    unique = [SimRequest(0.02 * i, [rng.randrange(1, 30000) for _ in range(rng.randrange(40, 900))],
                         rng.randrange(1, 60)) for i in range(60)]
    old = simulate(unique, "llama-3-8b", "H100-SXM", max_model_len=4096, num_blocks=2000, record_steps=True)
    zero = simulate(unique, "llama-3-8b", "H100-SXM", max_model_len=4096, num_blocks=2000, record_steps=True,
                    kv_offloading_size=0)
    tier = simulate(unique, "llama-3-8b", "H100-SXM", max_model_len=4096, num_blocks=2000, record_steps=True,
                    kv_offloading_size=2 << 30)
    # A preempted request would find its own blocks in the tier (a hit the old engine recomputes): none here.
    assert old.num_preemptions == 0 and tier.num_loaded_blocks == 0, "set-up: nothing for the tier to serve"
    assert tier.num_saved_blocks > 0 and tier.save_bound_s == 0, "set-up: saves run, hidden behind the passes"
    for other in (zero, tier):
        assert [(s.tokens, s.preempted, s.start, s.end) for s in other.steps] == \
            [(s.tokens, s.preempted, s.start, s.end) for s in old.steps]
        assert [t.token_times for t in other.timings] == [t.token_times for t in old.timings]


def test_nothing_leaks():
    rng = random.Random(3)
    docs = [[rng.randrange(1, 30000) for _ in range(rng.randrange(200, 700))] for _ in range(6)]
    requests = [SimRequest(0.001 * i, docs[rng.randrange(6)] + [rng.randrange(1, 30000)] * rng.randrange(1, 40),
                           rng.randrange(1, 40)) for i in range(80)]
    sim = engine(0.002, KVTransferLinks(2 << 20, 2e10, 2e10), num_blocks=100)
    result = sim.run(requests)
    assert result.num_tier_hit_tokens > 0 and result.num_preemptions > 0, "set-up: tier hits and preemptions"
    conn, sched = sim.scheduler.connector, sim.scheduler
    assert sim.kv_cache_manager.num_used_blocks == 0
    assert not (sched.waiting_for_remote_kvs or sched._free_after_load or sched._admission_hits)
    assert not (conn._requests or conn._block_ids or conn._hashes or conn._hit_blocks or conn._num_stored)
    assert not (conn._step_loads or conn._loading or conn._loading_by_req or conn._storing)
    assert all(block.ref_cnt == 0 and block.is_ready for _, block in conn.manager.held_blocks()), \
        "every tier copy unpinned and stored"
    assert not sim.kv_transfers.pending and not sim.scheduler.requests


def test_the_deployment_sizes_the_tier_and_splits_each_block_over_the_gpus():
    model = resolve_model("llama-3-8b")
    tier = offloading_tier(model, "H100-SXM", 2, BLOCK, 100 * 10**9)
    per_block = 32 * 2 * BLOCK * 8 * 128 * 2                           # 2 MiB: layers x K,V x tokens x heads x dim
    assert tier["kv_connector"].num_cpu_blocks == 100 * 10**9 // per_block
    assert tier["kv_transfer_links"].bytes_per_block == per_block // 2
    assert tier["kv_transfer_links"].load_bytes_per_s == host_link_bytes_per_s("H100-SXM") == 64e9 * 0.78


def test_bad_input_says_what_is_wrong():
    links = KVTransferLinks(1 << 20, 1e9, 1e9)
    with pytest.raises(ValueError, match="give kv_connector and kv_transfer_links together"):
        SimulatedEngine(lambda step: 0.001, 48, 4096, BLOCK, kv_transfer_links=links)
    worker = KVConnectorFactory.create_connector(
        KVTransferConfig("OffloadingConnector", "kv_both", {"kv_offloading_size": 1 << 30}), KVConnectorRole.WORKER,
        block_size=BLOCK, bytes_per_block=1 << 20)
    with pytest.raises(ValueError, match="role KVConnectorRole.SCHEDULER"):
        SimulatedEngine(lambda step: 0.001, 48, 4096, BLOCK, kv_connector=worker, kv_transfer_links=links)
    with pytest.raises(ValueError, match="blocks of 16 tokens but the engine 32"):
        SimulatedEngine(lambda step: 0.001, 48, 4096, 32, kv_connector=connector(1 << 30, 1 << 20),
                        kv_transfer_links=links)
    with pytest.raises(ValueError, match="load_bytes_per_s must be positive"):
        KVTransferLinks(1 << 20, 0.0, 1e9)
    with pytest.raises(ValueError, match="kv_offloading_size must be a number of bytes >= 0"):
        simulate(revisit(), "llama-3-8b", "H100-SXM", max_model_len=4096, num_blocks=48, kv_offloading_size=-1)
    with pytest.raises(ValueError, match="efficiency must be in"):
        host_link_bytes_per_s("H100-SXM", 1.5)


# ---------------------------------------------------------------------------------------------
# A disk tier behind a CPU tier that keeps 10 blocks: the revisit's 40 blocks are on disk only.

def disk_engine(step_s: float, links: KVTransferLinks, disk_path, num_blocks: int = 48, disk_blocks: int = 1000):
    config = KVTransferConfig("OffloadingConnector", "kv_both",
                              {"kv_offloading_size": 10 * links.bytes_per_block, "async_loads": True,
                               "disk_path": str(disk_path), "disk_size": disk_blocks * links.bytes_per_block})
    conn = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, block_size=BLOCK,
                                               bytes_per_block=links.bytes_per_block)
    return SimulatedEngine(lambda step: step_s, num_blocks, 4096, BLOCK, max_num_batched_tokens=2048,
                           kv_connector=conn, kv_transfer_links=links)


def test_a_prefix_held_only_on_disk_loads_from_disk_at_the_drive_rate(tmp_path):
    B, step = 2 << 20, 0.001
    links = KVTransferLinks(B, 1e10, 1e12, disk_read_bytes_per_s=2e9, disk_write_bytes_per_s=1e9)
    result = disk_engine(step, links, tmp_path).run(revisit(), record_steps=True)
    assert result.num_loaded_blocks == 0, "set-up: the 10-block CPU tier lost the first document to the second"
    assert result.num_disk_hit_tokens == result.num_tier_hit_tokens == 40 * BLOCK
    plain = engine(step, None).run(revisit())
    assert result.num_tokens_computed == plain.num_tokens_computed - 40 * BLOCK
    read = 40 * B / 2e9
    assert result.num_disk_loaded_blocks == 40 and result.disk_load_s == pytest.approx(read, rel=1e-12)
    # Asynchronous: the admission step polls until the read ends, then the rest of the prompt runs.
    assert result.timings[2].ttft == pytest.approx(max(step, read) + step, rel=1e-9)
    assert result.num_disk_written_blocks == 40 + 47 + 6, "write-through: every full prompt block, once"
    assert result.disk_write_s == pytest.approx(93 * B / 1e9, rel=1e-12)
    assert list(tmp_path.iterdir()) == [], "no file is written: the worker's files are simulated"


def test_simulate_builds_the_disk_tier_and_leaves_no_directory():
    tier = offloading_tier(resolve_model("llama-3-8b"), "H100-SXM", 1, BLOCK, 10 * (2 << 20), kv_disk_size=1 << 30)
    assert tier["kv_connector"].num_disk_blocks == (1 << 30) // (2 << 20)
    assert not tier["kv_connector"].disk_path.exists(), "the scheduler half wrote nothing, its directory is gone"
    result = simulate(revisit(), "llama-3-8b", "H100-SXM", max_model_len=4096, num_blocks=48,
                      kv_offloading_size=10 * (2 << 20), kv_disk_size=1 << 30)
    cpu_only = simulate(revisit(), "llama-3-8b", "H100-SXM", max_model_len=4096, num_blocks=48,
                        kv_offloading_size=10 * (2 << 20))
    assert cpu_only.num_tier_hit_tokens == 0 and result.num_disk_hit_tokens == 40 * BLOCK
    assert result.timings[2].ttft < cpu_only.timings[2].ttft, "640 tokens off an NVMe drive beat prefilling them"
    with pytest.raises(ValueError, match="kv_disk_size must be a number of bytes >= 0"):
        simulate(revisit(), "llama-3-8b", "H100-SXM", max_model_len=4096, num_blocks=48,
                 kv_offloading_size=1 << 30, kv_disk_size=-1)
    with pytest.raises(ValueError, match="give kv_offloading_size too"):
        simulate(revisit(), "llama-3-8b", "H100-SXM", max_model_len=4096, num_blocks=48, kv_disk_size=1 << 30)


@pytest.mark.parametrize("gap, hit", [(6.5, False), (8.5, True)])
def test_a_disk_block_is_found_only_after_its_write_ends(tmp_path, gap, hit):
    B, step = 2 << 20, 0.001
    # The first document's 40 blocks take 40 * 2 MiB / 5.6 MB/s = 15.0 s to write, from the end of its prefill.
    links = KVTransferLinks(B, 1e10, 1e12, disk_read_bytes_per_s=2e9, disk_write_bytes_per_s=40 * B / 15.0)
    result = disk_engine(step, links, tmp_path).run(revisit(gap), record_steps=True)
    write_end = result.steps[0].end + 15.0
    assert (2 * gap > write_end) == hit, "set-up: the revisit arrives on the intended side of the write's end"
    assert result.num_disk_hit_tokens == (40 * BLOCK if hit else 0)


def test_no_disk_tier_gives_the_previous_results():
    """Figures of the CPU tier alone, recorded before the disk tier existed (hits, preemptions, reloads)."""
    rng = random.Random(3)
    docs = [[rng.randrange(1, 30000) for _ in range(rng.randrange(200, 700))] for _ in range(6)]
    requests = [SimRequest(0.001 * i, docs[rng.randrange(6)] + [rng.randrange(1, 30000)] * rng.randrange(1, 40),
                           rng.randrange(1, 40)) for i in range(80)]
    r = simulate(requests, "llama-3-8b", "H100-SXM", max_model_len=4096, num_blocks=100,
                 kv_offloading_size=60 * (2 << 20), kv_disk_size=0)
    assert (r.num_steps, r.num_preemptions, r.num_tokens_computed, r.num_tier_hit_tokens, r.num_tier_reloaded_tokens,
            r.num_loaded_blocks, r.num_saved_blocks) == (377, 6, 13079, 2032, 16, 128, 636)
    assert r.simulated_s == 4.389054984440849
    assert r.num_disk_hit_tokens == r.num_disk_written_blocks == 0


def test_nothing_leaks_with_a_disk_tier(tmp_path):
    rng = random.Random(3)
    docs = [[rng.randrange(1, 30000) for _ in range(rng.randrange(200, 700))] for _ in range(6)]
    requests = [SimRequest(0.001 * i, docs[rng.randrange(6)] + [rng.randrange(1, 30000)] * rng.randrange(1, 40),
                           rng.randrange(1, 40)) for i in range(80)]
    links = KVTransferLinks(2 << 20, 2e10, 2e10, disk_read_bytes_per_s=5e9, disk_write_bytes_per_s=3e9)
    sim = disk_engine(0.002, links, tmp_path, num_blocks=100, disk_blocks=300)
    result = sim.run(requests)
    assert result.num_disk_hit_tokens > 0 and result.num_preemptions > 0, "set-up: disk hits and preemptions"
    conn, sched, transfers = sim.scheduler.connector, sim.scheduler, sim.kv_transfers
    assert sim.kv_cache_manager.num_used_blocks == 0
    assert not (sched.waiting_for_remote_kvs or sched._free_after_load or sched._admission_hits)
    assert not (conn._requests or conn._block_ids or conn._hashes or conn._hit_blocks or conn._num_stored)
    assert not (conn._step_loads or conn._step_disk_loads or conn._loading or conn._loading_by_req)
    assert not (conn._storing or conn._disk_loading_by_req or conn._disk_storing), "every disk write reported"
    for manager in (conn.manager, conn.disk_manager):
        assert all(block.ref_cnt == 0 and block.is_ready for _, block in manager.held_blocks())
    assert {h for h, _ in conn.disk_manager.held_blocks()} == transfers.disk_files.hashes, \
        "the disk tier holds exactly the files written and not removed"
    assert conn.num_disk_dropped_blocks == 0
    assert not transfers.pending and not transfers.pending_writes and not sim.scheduler.requests
    assert list(tmp_path.iterdir()) == []
