"""The offloading tiers under a random load: shared prefixes, random lengths, a GPU pool small enough to preempt,
CPU and disk tiers small enough to evict, and aborts. After every step the GPU pool's bookkeeping is consistent
and the tiers pin only blocks of loads in flight; at the end everything is released and every request that ran
to its end produced the plain engine's tokens."""

import random
import time
from collections import Counter

import pytest
from offload_helpers import greedy

from kvlab.engine.llm_engine import LLMEngine
from kvlab.paths import ASSETS_DIR

BLOCK_SIZE = 8
KNOBS = dict(block_size=BLOCK_SIZE, num_blocks=14, max_model_len=96, max_num_batched_tokens=64, max_num_seqs=4)
BLOCK_BYTES = 4 * 2 * BLOCK_SIZE * 2 * 64 * 4  # the embedded model: 4 layers, 2 KV heads of 64, float32


def workload(tokenizer, seed: int) -> list[tuple[str, list[int], int, int, int | None]]:
    """(request id, prompt, max tokens, arrival step, abort step or None), from a seeded generator: prompts are one
    of six shared prefixes of 2 to 5 whole blocks (so they hit) plus a random tail, cut from the shipped text."""
    rng = random.Random(seed)
    text = tokenizer((ASSETS_DIR / "text" / "shakespeare.txt").read_text(encoding="utf-8")[:6000])["input_ids"]
    prefixes = [text[i * 100:i * 100 + rng.randrange(2, 6) * BLOCK_SIZE] for i in range(6)]
    requests, step = [], 0
    for i in range(24):
        prefix = rng.choice(prefixes)
        tail_start = rng.randrange(700, len(text) - 24)
        prompt = prefix + text[tail_start:tail_start + rng.randrange(1, 24)]
        step += rng.randrange(0, 4)
        abort = step + rng.randrange(0, 6) if rng.random() < 0.25 else None
        requests.append((f"r{i}", prompt, rng.randrange(2, 16), step, abort))
    return requests


def tiers(disk_path, async_loads: bool) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"kv_offloading_size": 6 * BLOCK_BYTES, "async_loads": async_loads,
                                          "disk_path": str(disk_path), "disk_size": 16 * BLOCK_BYTES}}


def check_invariants(engine) -> None:
    """The GPU pool's bookkeeping, and the tiers' pins, between two steps."""
    manager = engine.kv_cache_manager
    pool = manager.block_pool
    free_ids = pool.free_block_queue.block_ids()
    held = Counter(block.block_id for table in manager.req_to_blocks.values() for block in table)
    assert len(free_ids) == len(set(free_ids)), "a block is twice in the free queue"
    assert len(free_ids) + sum(1 for b in pool.blocks if b.ref_cnt > 0) == pool.num_blocks, "free + used != total"
    for block in pool.blocks:
        assert block.ref_cnt == held[block.block_id], \
            f"block {block.block_id} has ref_cnt {block.ref_cnt} but {held[block.block_id]} tables hold it"
    assert not set(free_ids) & set(held), "a block is both free and held"
    scheduler, connector = engine.scheduler, engine.kv_connector
    in_flight = set(scheduler.waiting_for_remote_kvs) | scheduler._free_after_load
    for tier, pinned_by in ((connector.manager, connector._loading_by_req),
                            (connector.disk_manager, connector._disk_loading_by_req)):
        pins = Counter({h: s.ref_cnt for h, s in tier.held_blocks() if s.ref_cnt})
        assert set(pinned_by) <= in_flight, \
            f"{tier.backend.medium} pins for requests with no load in flight: {set(pinned_by) - in_flight}"
        expected = Counter(h for rid in pinned_by for h in pinned_by[rid])
        assert pins == expected, f"{tier.backend.medium} pins {dict(pins)} are not those of the loads in flight"
    assert not connector._loading, "a synchronous load's pins outlived its step"


def run(engine, requests, check: bool, timeout_s: float = 60.0) -> dict[str, list[int]]:
    """Add each request at its arrival step and abort it at its abort step; outputs of those that finished."""
    outputs, step = {}, 0
    arrivals = sorted(requests, key=lambda r: r[3])
    aborts = {rid: abort for rid, _, _, _, abort in requests if abort is not None}
    deadline = time.monotonic() + timeout_s
    connector = engine.kv_connector
    while arrivals or engine.has_unfinished_requests() or engine.has_pending_kv_transfers() or \
            (connector is not None and connector.has_pending_saves()):
        assert time.monotonic() < deadline, "the workload did not finish in time"
        while arrivals and arrivals[0][3] <= step:
            rid, prompt, max_tokens, _, _ = arrivals.pop(0)
            engine.add_request(rid, prompt, greedy(max_tokens))
        for rid, when in list(aborts.items()):
            if when <= step and engine.is_running(rid):
                engine.abort_request(rid)
                del aborts[rid]
        if not engine.has_schedulable_requests():
            time.sleep(0.001)  # only copies in flight
        for out in engine.step():
            if out.finished and out.outputs[0].finish_reason != "abort":
                outputs[out.request_id] = out.outputs[0].token_ids
        if check:
            check_invariants(engine)
        step += 1
    return outputs


@pytest.mark.parametrize("async_loads", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_load_keeps_the_invariants_and_the_outputs(embedded, tmp_path, seed, async_loads):
    model, tokenizer = embedded
    requests = workload(tokenizer, seed)
    plain = LLMEngine(model, tokenizer, **KNOBS)
    expected = run(plain, [(rid, p, n, 0, None) for rid, p, n, _, _ in requests], check=False)
    engine = LLMEngine(model, tokenizer, kv_transfer_config=tiers(tmp_path, async_loads), **KNOBS)
    got = run(engine, requests, check=True)
    assert got, "some requests ran to their end"
    for rid, tokens in got.items():
        assert tokens == expected[rid], f"{rid}: the tiers changed the output"
    connector = engine.kv_connector
    assert engine.scheduler.num_preemptions > 0, "the GPU pool was small enough to preempt"
    # The CPU tier is too small to serve every seed's workload; the disk tier serves each.
    assert connector.num_disk_loaded_blocks > 0, "the disk tier served loads"
    assert connector.manager.backend.get_num_free_blocks() == 0 and \
        connector.disk_manager.backend.get_num_free_blocks() == 0, "both tiers filled up and evicted"
    # Everything is released.
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    for tier in (connector.manager, connector.disk_manager):
        assert all(s.ref_cnt == 0 and s.is_ready for _, s in tier.held_blocks()), f"{tier.backend.medium} settled"
    assert not connector._requests and not connector._loading_by_req and not connector._disk_loading_by_req
    worker = engine.model_runner.kv_connector
    assert not worker._pending_loads and not worker._pending_writes
    assert len(list(tmp_path.glob("*.safetensors"))) == connector.num_disk_blocks, "one file per disk block held"
    engine.shutdown()
