"""The offloading connector's disk tier: write-through files behind a CPU tier, read back on a reader thread.

The GPU pool (8 blocks) and the CPU tier (2 blocks) are both too small to keep a's 5-block prefix once c has run,
so b's prefix can only come back from disk.
"""

import threading
import time

import pytest
import torch
from offload_helpers import BLOCK_SIZE, greedy, prompts_fixture  # noqa: F401 (a fixture)

from kvlab.baselines.transformers_generate import reference_generate
from kvlab.core.prefix_cache import block_hashes
from kvlab.engine.llm_engine import LLMEngine
from kvlab.engine.request import RequestStatus
from kvlab.kv_offload.disk import DiskBlockStore
from kvlab.kv_transfer.offloading_connector import OffloadingConnector

KNOBS = dict(block_size=BLOCK_SIZE, num_blocks=8, max_model_len=64)
BLOCK_BYTES = 4 * 2 * BLOCK_SIZE * 2 * 64 * 4  # the embedded model: 4 layers, 2 KV heads of 64, float32


def tiered(disk_path, cpu_blocks=2, disk_blocks=64, async_loads=False) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"kv_offloading_size": cpu_blocks * BLOCK_BYTES, "async_loads": async_loads,
                                          "disk_path": str(disk_path), "disk_size": disk_blocks * BLOCK_BYTES}}


def step_until_done(engine, timeout_s=60.0) -> dict[str, list[int]]:
    """Step until every request finished, no load is in flight and every disk write has landed; outputs by id."""
    outputs = {}
    deadline = time.monotonic() + timeout_s
    connector = engine.kv_connector
    while engine.has_unfinished_requests() or engine.has_pending_kv_transfers() or \
            (connector is not None and connector.has_pending_saves()):
        assert time.monotonic() < deadline, f"the engine did not finish in {timeout_s} s"
        if not engine.has_schedulable_requests():
            time.sleep(0.001)  # only copies in flight: let the reader and writer threads run
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return outputs


def run_in_turn(engine, requests, max_tokens=8) -> dict[str, list[int]]:
    """Each request to its end, and its files written, before the next one is added."""
    outputs = {}
    for rid, prompt in requests:
        engine.add_request(rid, prompt, greedy(max_tokens))
        outputs.update(step_until_done(engine))
    return outputs


def watch_disk_loads(engine) -> list[int]:
    """Check every disk load, when the worker reports it, against what the GPU block held when it was saved (by the
    block hash the GPU prefix cache gave it); the GPU blocks checked."""
    worker = engine.model_runner.kv_connector
    gpu_blocks = engine.kv_cache_manager.block_pool.blocks
    saved, pending, checked = {}, {}, []
    save, start, finished = worker.wait_for_save, worker.start_load_kv, worker.get_finished

    def recording_save():
        meta = worker._get_connector_metadata()
        for pairs in meta.disk_saves.values():
            for gpu, block_hash in pairs:
                assert gpu_blocks[gpu].block_hash == block_hash, "a write names its block by the GPU cache's hash"
                saved[block_hash] = [(k[gpu].clone(), v[gpu].clone())
                                     for k, v in zip(worker.cache.k_pools, worker.cache.v_pools)]
        save()

    def recording_start():
        for rid, pairs in worker._get_connector_metadata().disk_loads.items():
            pending.setdefault(rid, []).extend(pairs)
        start()

    def checking_finished(ids):
        sending, recving = finished(ids)
        for rid in recving or ():
            for block_hash, gpu in pending.pop(rid, ()):
                for layer, (k, v) in enumerate(saved[block_hash]):
                    assert torch.equal(worker.cache.k_pools[layer][gpu].view(torch.uint8), k.view(torch.uint8)) and \
                        torch.equal(worker.cache.v_pools[layer][gpu].view(torch.uint8), v.view(torch.uint8)), \
                        f"GPU block {gpu} differs from what was written for its hash (layer {layer})"
                checked.append(gpu)
        return sending, recving

    worker.wait_for_save, worker.start_load_kv, worker.get_finished = recording_save, recording_start, \
        checking_finished
    return checked


def assert_released(engine):
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks, "every GPU block is back in the pool"
    connector = engine.kv_connector
    for tier in (connector.manager, connector.disk_manager):
        assert all(status.ref_cnt == 0 and status.is_ready for _, status in tier.held_blocks()), \
            f"no {tier.backend.medium} copy stays pinned by a load or half stored"
    assert not connector._requests and not connector._disk_loading_by_req and not connector._loading_by_req
    worker = engine.model_runner.kv_connector
    assert not worker._pending_loads and not worker._pending_writes, "no read or write is left in flight"
    assert not engine.has_pending_kv_transfers()


def files(path) -> set[str]:
    return {p.name for p in path.glob("*.safetensors")}


@pytest.mark.parametrize("async_loads", [False, True])
def test_a_prefix_comes_back_from_disk_bit_identical(embedded, prompts, tmp_path, async_loads):
    model, tokenizer = embedded
    order = [("a", prompts["a"]), ("c", prompts["c"]), ("b", prompts["b"])]
    plain = LLMEngine(model, tokenizer, **KNOBS)
    expected = run_in_turn(plain, order)
    engine = LLMEngine(model, tokenizer, kv_transfer_config=tiered(tmp_path, async_loads=async_loads), **KNOBS)
    checked = watch_disk_loads(engine)
    got = run_in_turn(engine, order)
    assert got == expected, "the tiers change no output"
    assert got["b"] == reference_generate(model, prompts["b"], 8), "and equal transformers' generate"
    connector = engine.kv_connector
    assert connector.num_disk_loaded_blocks == 5 and len(checked) == 5, \
        f"b's 5 prefix blocks came from disk, each compared byte for byte, got {checked}"
    assert connector.num_loaded_blocks == 0, "the 2-block CPU tier had lost them to c"
    assert engine.num_tokens_computed == plain.num_tokens_computed - 5 * BLOCK_SIZE, \
        "the loaded tokens are not computed"
    full = {rid: len(prompt) // BLOCK_SIZE for rid, prompt in order}
    assert len(files(tmp_path)) == connector.num_disk_stored_blocks == full["a"] + full["c"] + full["b"] - 5, \
        "every full prompt block was written once, the shared prefix not again for b"
    assert connector.manager.lookup(block_hashes(prompts["b"], BLOCK_SIZE)) == 2, \
        "b stored the blocks it loaded from disk to the CPU tier again (its 2 leading ones fit)"
    assert_released(engine)
    engine.shutdown()


@pytest.mark.parametrize("damage", ["corrupt", "delete"])
def test_a_bad_file_fails_its_load_cleanly_and_is_recomputed(embedded, prompts, tmp_path, damage):
    model, tokenizer = embedded
    engine = LLMEngine(model, tokenizer, kv_transfer_config=tiered(tmp_path), **KNOBS)
    run_in_turn(engine, [("a", prompts["a"]), ("c", prompts["c"])])
    bad_hash = block_hashes(prompts["a"], BLOCK_SIZE)[2]
    path = DiskBlockStore(tmp_path).path_for(bad_hash)
    if damage == "corrupt":
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF  # one byte of the tensor: the header still parses, the checksum does not match
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    worker = engine.model_runner.kv_connector
    reported, errors = [], worker.get_block_ids_with_load_errors

    def recording_errors():
        failed = errors()
        if failed:
            reported.append((set(failed), path.exists()))
        return failed

    worker.get_block_ids_with_load_errors = recording_errors
    engine.add_request("b", prompts["b"], greedy(8))
    computed_before = engine.num_tokens_computed
    outputs = step_until_done(engine)
    assert outputs["b"] == reference_generate(model, prompts["b"], 8), "the recompute gives generate's tokens"
    assert engine.scheduler.num_failed_loads == 1 and worker.num_disk_load_errors == 1
    assert len(reported) == 1 and len(reported[0][0]) == 1, f"one GPU block was reported failed, got {reported}"
    assert reported[0][1] is False, "the bad file was deleted before the failure was reported"
    assert engine.kv_connector.num_disk_dropped_blocks == 1, "and its block dropped from the disk manager"
    assert engine.num_tokens_computed - computed_before == len(prompts["b"]) - 2 * BLOCK_SIZE + 7, \
        "the 2 blocks before the bad one stay loaded; from the bad one on, b's prompt is computed"
    assert DiskBlockStore(tmp_path).load(bad_hash) is not None, "b's recompute wrote a good file for the block again"
    assert_released(engine)
    engine.shutdown()


def test_a_full_disk_tier_evicts_by_deleting_files(embedded, prompts, tmp_path):
    model, tokenizer = embedded
    engine = LLMEngine(model, tokenizer, kv_transfer_config=tiered(tmp_path, disk_blocks=6), **KNOBS)
    assert engine.kv_connector.num_disk_blocks == 6
    x = prompts["c"][25:] + prompts["a"][:20]
    order = [("a", prompts["a"]), ("c", prompts["c"]), ("x", x)]
    got = run_in_turn(engine, order)
    for rid, prompt in order:
        assert got[rid] == reference_generate(model, prompt, 8), f"{rid}: every output is still right"
    disk = engine.kv_connector.disk_manager
    store = DiskBlockStore(tmp_path)
    assert disk.backend.get_num_free_blocks() == 0 and len(files(tmp_path)) == 6, \
        "the tier is full, and holds exactly as many files as blocks"
    assert not any(store.contains(h) for h in block_hashes(prompts["a"], BLOCK_SIZE)), "a's files, the oldest, went"
    assert disk.lookup(block_hashes(x, BLOCK_SIZE)) == 5 and all(store.contains(h)
                                                                 for h in block_hashes(x, BLOCK_SIZE)), \
        "the newest prompt's blocks are held, each by its file"
    assert_released(engine)
    engine.shutdown()


def test_a_second_engine_on_the_same_directory_hits(embedded, prompts, tmp_path):
    model, tokenizer = embedded
    first = LLMEngine(model, tokenizer, kv_transfer_config=tiered(tmp_path), **KNOBS)
    run_in_turn(first, [("a", prompts["a"])])
    first.shutdown()
    # A file of another layout, under a valid name: the index skips it.
    stranger = bytes(32)
    DiskBlockStore(tmp_path).save(stranger, torch.zeros(1, 2, BLOCK_SIZE, 2, 64))
    second = LLMEngine(model, tokenizer, kv_transfer_config=tiered(tmp_path), **KNOBS)
    disk = second.kv_connector.disk_manager
    assert disk.lookup(block_hashes(prompts["a"], BLOCK_SIZE)) == 5, "the new engine indexed a's 5 files"
    assert disk.lookup([stranger]) == 0, "a file of another block layout is not indexed"
    got = run_in_turn(second, [("b", prompts["b"])])
    assert got["b"] == reference_generate(model, prompts["b"], 8)
    assert second.kv_connector.num_disk_loaded_blocks == 5, "b's prefix came from the files the first engine wrote"
    assert second.num_tokens_computed == len(prompts["b"]) - 5 * BLOCK_SIZE + 7
    assert_released(second)
    second.shutdown()


def test_an_abort_during_a_disk_load_releases_everything(embedded, prompts, tmp_path, monkeypatch):
    model, tokenizer = embedded
    opened = threading.Event()
    read = OffloadingConnector._read_blocks

    def gated(self, pairs):
        assert opened.wait(30), "the test never opened the gate"
        return read(self, pairs)

    monkeypatch.setattr(OffloadingConnector, "_read_blocks", gated)
    engine = LLMEngine(model, tokenizer, kv_transfer_config=tiered(tmp_path), **KNOBS)
    opened.set()
    run_in_turn(engine, [("a", prompts["a"]), ("c", prompts["c"])])
    opened.clear()
    engine.add_request("b", prompts["b"], greedy(8))
    engine.step()
    assert engine.requests["b"].status is RequestStatus.WAITING_FOR_REMOTE_KVS, "b waits for its disk load"
    disk = engine.kv_connector.disk_manager
    assert sum(status.ref_cnt for _, status in disk.held_blocks()) == 5, "its 5 disk blocks are pinned"
    engine.abort_request("b")
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks - 5, \
        "the reader still writes into b's blocks, so they are not handed to anyone else yet"
    opened.set()
    step_until_done(engine)
    assert_released(engine)
    got = run_in_turn(engine, [("b2", prompts["b"])])
    assert got["b2"] == reference_generate(model, prompts["b"], 8), "the tier serves the next request as before"
    assert_released(engine)
    engine.shutdown()


@pytest.mark.parametrize("extra, field", [
    ({"disk_path": "x"}, "disk_size"),
    ({"disk_size": 1 << 20}, "disk_path"),
    ({"disk_path": "", "disk_size": 1 << 20}, "disk_path"),
    ({"disk_path": "d", "disk_size": -1}, "disk_size"),
    ({"disk_path": "d", "disk_size": 100}, "disk_size"),
    ({"disk_path": "FILE", "disk_size": 1 << 20}, "disk_path"),
])
def test_bad_disk_settings_raise_naming_the_field(embedded, tmp_path, extra, field):
    model, tokenizer = embedded
    (tmp_path / "FILE").write_text("not a directory")
    extra = {k: (str(tmp_path / v) if k == "disk_path" and v else v) for k, v in extra.items()}
    config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"kv_offloading_size": 1 << 20, **extra}}
    with pytest.raises(ValueError, match=rf"kv_connector_extra_config\.{field}"):
        LLMEngine(model, tokenizer, kv_transfer_config=config, **KNOBS)
