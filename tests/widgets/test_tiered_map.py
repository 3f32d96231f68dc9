"""Chapter 12's tier map: each prompt's blocks lettered by the tiers (GPU, CPU, disk) that hold their hashes."""

import pytest
from test_block_map_widget import elements

from kvlab import SamplingParams
from kvlab.core.prefix_cache import block_hashes
from kvlab.engine.llm_engine import LLMEngine
from kvlab.kv_offload import Backend, LRUOffloadingManager
from kvlab.widgets import render_tiered_html, tiered_snapshot

BLOCK_SIZE = 8
OFFLOADING = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"kv_offloading_size": 64 << 20}}


def run_to_end(engine, rid, prompt):
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.fixture(scope="module")
def evicted(embedded):
    """An engine whose 8-block GPU pool lost prompt a's prefix to prompt c, while the CPU tier kept it."""
    model, tokenizer = embedded
    engine = LLMEngine(model, tokenizer, block_size=BLOCK_SIZE, num_blocks=8, max_model_len=64,
                       kv_transfer_config=OFFLOADING)
    a = tokenizer("KING LEAR.\nNothing will come of nothing. Speak again.\nCORDELIA.\n")["input_ids"][:41]
    c = tokenizer("HAMLET.\nTo be, or not to be, that is the question: whether 'tis nobler")["input_ids"][:58]
    run_to_end(engine, "a", a)
    run_to_end(engine, "c", c)
    return engine, {"a": block_hashes(a, BLOCK_SIZE), "c": block_hashes(c, BLOCK_SIZE)}


def test_snapshot_reads_every_tier(evicted):
    engine, chains = evicted
    pool, manager = engine.kv_cache_manager.block_pool, engine.kv_connector.manager
    snap = tiered_snapshot(pool, cpu=manager, chains=chains, step=engine.step_count)
    assert [t["name"] for t in snap["tiers"]] == ["GPU", "CPU"]
    gpu, cpu = snap["tiers"]
    assert gpu["capacity"] == 8 and cpu["capacity"] == manager.backend.num_blocks
    assert {b["hash"] for b in gpu["blocks"]} == {b.block_hash.hex() for b in pool.blocks if b.block_hash}
    assert [b["hash"] for b in cpu["blocks"]] == [h.hex() for h, _ in manager.held_blocks()]
    assert [c["label"] for c in snap["chains"]] == ["a", "c"]
    assert snap["chains"][0]["hashes"] == [h.hex() for h in chains["a"]]


def test_the_evicted_prefix_lives_in_the_cpu_tier_only(evicted):
    engine, chains = evicted
    snap = tiered_snapshot(engine.kv_cache_manager.block_pool, cpu=engine.kv_connector.manager, chains=chains)
    markup = render_tiered_html(snap, title="after c")
    cells = {(c["data-chain"], int(c["data-index"])): c["data-tiers"] for c in elements(markup, "kvlab-tier-cell")}
    assert len(cells) == len(chains["a"]) + len(chains["c"])
    # a's five full prompt blocks were stored to the CPU tier; c's 62 tokens then took all 8 GPU blocks.
    assert [cells[("a", i)] for i in range(5)] == ["CPU"] * 5
    assert all("GPU" in cells[("c", i)] for i in range(len(chains["c"]) - 1)), "c's blocks are still cached on the GPU"
    assert "after c" in markup
    tiers = {t["data-tier"]: int(t["data-held"]) for t in elements(markup, "kvlab-tier")}
    assert tiers == {"GPU": len(snap["tiers"][0]["blocks"]), "CPU": len(snap["tiers"][1]["blocks"])}


def test_disk_tier_pending_and_pinned_blocks():
    gpu = type("Pool", (), {"blocks": [], "num_blocks": 4})()
    disk = LRUOffloadingManager(Backend("disk", 4, 3))
    disk.prepare_store([b"\x01", b"\x02"])
    disk.complete_store([b"\x01"])
    disk.prepare_load([b"\x01"])  # pinned
    markup = render_tiered_html(tiered_snapshot(gpu, disk=disk, chains={"p": [b"\x01", b"\x02", b"\x03"]}))
    cells = elements(markup, "kvlab-tier-cell")
    assert [c["data-tiers"] for c in cells] == ["disk", "disk", ""]
    assert "2px solid" in cells[0]["style"] and "ref count 1" in cells[0]["title"]
    assert "dotted" in cells[1]["style"] and "being stored" in cells[1]["title"]
    assert "in no tier" in cells[2]["title"]


def test_bad_input_names_what_is_wrong():
    with pytest.raises(TypeError, match="gpu_pool"):
        tiered_snapshot(object())
    gpu = type("Pool", (), {"blocks": [], "num_blocks": 1})()
    with pytest.raises(TypeError, match="CPU tier"):
        tiered_snapshot(gpu, cpu=[1, 2])
    with pytest.raises(ValueError, match=r"chains\['x'\]"):
        tiered_snapshot(gpu, chains={"x": "abc"})
    with pytest.raises(ValueError, match="'chains'"):
        render_tiered_html({"tiers": []})
