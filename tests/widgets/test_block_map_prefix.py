"""Chapter 3's block map drawing Chapter 4's prefix-caching engine: shared, cached and re-hit blocks."""

import pytest
from test_block_map_widget import elements

from conftest import make_tiny_model
from kvlab.decoding.prefix_generate import PrefixCachingGenerator
from kvlab.widgets import BlockMap, render_html, snapshot

SYSTEM = [5, 17, 23, 42, 8, 61, 3, 77, 12, 30]  # 10 tokens: 2 full blocks of 4, then 2 more
# Requests 0 and 1 join together and share the 2 system blocks; request 2 comes back after both finished.
PROMPTS = [(SYSTEM + [40, 41, 42], 3, 0), (SYSTEM + [50, 51], 4, 0), (SYSTEM + [60], 3, 8)]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


def make_engine(model, num_blocks=16):
    gen = PrefixCachingGenerator(model, num_blocks, block_size=4, enable_prefix_caching=True)
    for prompt, n, arrival in PROMPTS:
        gen.add_request(prompt, n, arrival_step=arrival)
    return gen


def test_shared_blocks_then_cached_then_hit_again(model):
    gen = make_engine(model)
    gen.step()
    snap = snapshot(gen)
    assert snap is not None and snap["num_blocks"] == 16
    shared = [b for b in snap["blocks"] if b["ref_count"] == 2]
    assert len(shared) == 2 and all(b["owners"] == [0, 1] and b["owner"] == 0 and b["fill"] == 4 for b in shared)
    assert all(b.get("hit") for b in shared) and all(b["note"].startswith("hash ") for b in shared)
    seqs = {s["id"]: s for s in snap["sequences"]}
    assert [seqs[i]["status"] for i in range(3)] == ["running", "running", "waiting"]
    assert (seqs[0]["num_cached_tokens"], seqs[1]["num_cached_tokens"], seqs[2]["num_cached_tokens"]) == (0, 8, None)
    assert snap["counters"]["extra"]["prefix hits (tokens)"] == 8
    assert snap["counters"]["used_blocks"] == gen.kv_cache_manager.block_pool.num_used_blocks
    markup = render_html(snap)
    assert 'data-ref-count="2"' in markup and "×2" in markup and "kvlab-legend" in markup
    drawn = {int(b["data-block"]): b for b in elements(markup, "kvlab-block")}
    for b in shared:
        assert drawn[b["id"]]["data-owners"] == "0 1" and drawn[b["id"]]["data-hit"] == "1"
    cached_tokens = {int(s["data-seq"]): s["data-cached-tokens"] for s in elements(markup, "kvlab-seq")}
    assert cached_tokens == {0: "0", 1: "8", 2: ""}
    assert "prefix-cache hit: 8 of 12 prompt tokens" in markup
    shared_ids = {b["id"] for b in shared}

    while not all(gen.sequences[i].finished for i in (0, 1)):
        gen.step()
    assert gen.step_count <= 8, "request 2 must not have joined yet"
    snap = snapshot(gen)
    cached = [b for b in snap["blocks"] if b["cached"]]
    # Request 0's 3 full prompt blocks (2 shared) plus request 1's third full block are kept for reuse.
    assert shared_ids <= {b["id"] for b in cached} and len(cached) == 4
    assert all(b["ref_count"] == 0 and not b["owners"] and b["fill"] == 4 for b in cached)
    assert snap["counters"]["used_blocks"] == 0 and snap["counters"]["free_blocks"] == 16
    markup = render_html(snap)
    drawn = {int(b["data-block"]): b for b in elements(markup, "kvlab-block")}
    assert all(drawn[i]["data-cached"] == "1" for i in shared_ids)
    assert elements(markup, "kvlab-block-map")[0]["data-used"] == "0", "cached blocks count as free"
    assert 'data-hit="1"' not in markup

    while gen.step_count <= 8:
        gen.step()
    snap = snapshot(gen)
    blocks = {b["id"]: b for b in snap["blocks"]}
    assert snap["counters"]["extra"]["prefix hits (tokens)"] == 16
    assert snap["counters"]["extra"]["prefill tokens saved"] == 16
    assert snap["counters"]["extra"]["evictions"] == 0
    seqs = {s["id"]: s for s in snap["sequences"]}
    assert seqs[2]["status"] == "running" and seqs[2]["num_cached_tokens"] == 8
    assert set(seqs[2]["block_table"][:2]) == shared_ids
    for i in shared_ids:
        assert blocks[i]["owners"] == [2] and blocks[i]["ref_count"] == 1 and not blocks[i]["cached"]
        assert blocks[i].get("hit")
    drawn = {int(b["data-block"]): b for b in elements(render_html(snap), "kvlab-block")}
    assert all(drawn[i]["data-owner"] == "2" and drawn[i]["data-hit"] == "1" for i in shared_ids)


def test_block_map_widget_plays_the_prefix_engine_to_the_end(model):
    bm = BlockMap(lambda: make_engine(model), title="Prefix caching")
    while bm.can_step():
        bm.step()
    assert bm.error is None and bm.done
    c = bm.snapshot()["counters"]
    assert c["used_blocks"] == 0 and c["extra"]["hit rate"] == f"{16 / 36:.0%}"
    assert "prefix hits (tokens): 16" in bm.html.value
