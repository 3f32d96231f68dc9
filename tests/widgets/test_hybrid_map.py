"""Chapter 11's hybrid block map: each group's tables side by side, freed entries shown as the null block, one pool."""

import pytest
from test_block_map_widget import elements

from kvlab.core.kv_cache_coordinator import HybridKVCacheCoordinator
from kvlab.core.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from kvlab.widgets import hybrid_snapshot, render_hybrid_html, seq_colour

BLOCK, WINDOW = 4, 8
GROUPS = [KVCacheGroupSpec((0, 2), FullAttentionSpec(BLOCK, 2, 8)),
          KVCacheGroupSpec((1, 3), SlidingWindowSpec(BLOCK, 2, 8, sliding_window=WINDOW))]


def run(steps: int):
    """Two requests, 'a' prefilled with 14 tokens then decoding, 'b' sharing its first 8 tokens; steps decodes."""
    kv = HybridKVCacheCoordinator(GROUPS, num_blocks=24)
    a = list(range(100, 114))
    kv.allocate_slots("a", len(a), new_token_ids=a, computed_token_ids=[])
    b = a[:8] + [7, 7, 7]
    hits, num_cached = kv.get_computed_blocks("b", b)
    kv.allocate_slots("b", len(b) - num_cached, hits, new_token_ids=b[num_cached:], computed_token_ids=b[:num_cached])
    for i in range(steps):
        kv.allocate_slots("a", 1, new_token_ids=[200 + i])
        kv.remove_skipped_blocks("a", kv.num_tokens["a"])
    return kv


def test_snapshot_follows_the_coordinator():
    kv = run(6)
    snap = hybrid_snapshot(kv, step=6)
    assert snap["step"] == 6 and snap["null_block"] == 0 and snap["num_blocks"] == 24
    assert [(g["kind"], g["window"], g["layers"]) for g in snap["groups"]] == [("full", None, [0, 2]),
                                                                               ("sliding", WINDOW, [1, 3])]
    tables = {r["id"]: r["tables"] for r in snap["requests"]}
    assert tables == {rid: [list(t) for t in kv.get_block_ids(rid)] for rid in ("a", "b")}
    # 'a' holds 20 tokens: every block in the full group; the window keeps only the blocks of its last 7 tokens.
    full, sliding = tables["a"]
    assert len(full) == len(sliding) == 5 and 0 not in full
    assert sliding[:3] == [0, 0, 0] and 0 not in sliding[3:]
    assert snap["counters"]["freed_entries"] == 3 + tables["b"][1].count(0)
    assert snap["counters"]["used_blocks"] == kv.block_pool.num_used_blocks - 1
    assert snap["counters"]["free_blocks"] == kv.num_free_blocks
    by_id = {b["id"]: b for b in snap["blocks"]}
    # 'b' hit a's first two full-attention blocks: they have two owners and a count of 2.
    shared = tables["b"][0][:2]
    assert shared == full[:2]
    for block_id in shared:
        assert sorted(map(tuple, by_id[block_id]["owners"])) == [("a", 0), ("b", 0)]
        assert by_id[block_id]["ref_count"] == 2 and by_id[block_id]["cached"]
    held = {b for r in snap["requests"] for t in r["tables"] for b in t if b != 0}
    assert {b["id"] for b in snap["blocks"] if b["owners"]} == held


def test_html_draws_each_group_side_by_side_and_freed_entries_as_null():
    kv = run(6)
    snap = hybrid_snapshot(kv)
    markup = render_hybrid_html(snap, title="two groups")
    assert "two groups" in markup and "group 1: sliding, window 8, layers [1, 3]" in markup
    entries = elements(markup, "kvlab-entry")
    drawn = {(e["data-req"], int(e["data-group"]), int(e["data-logical"])): e for e in entries}
    for request in snap["requests"]:
        for g, table in enumerate(request["tables"]):
            for i, block_id in enumerate(table):
                entry = drawn.pop((request["id"], g, i))
                assert int(entry["data-block"]) == block_id
                assert entry["data-freed"] == ("1" if block_id == 0 else "0")
    assert not drawn, "an entry was drawn that no table holds"
    pool = {int(b["data-block"]): b for b in elements(markup, "kvlab-pool-block")}
    assert sorted(pool) == list(range(24))
    a_full = snap["requests"][0]["tables"][0]
    assert pool[a_full[0]]["data-owners"] == "a:0 b:0"
    for entry in entries:
        if entry["data-freed"] == "0":
            assert seq_colour(entry["data-req"]) in entry["style"], "an entry takes its request's colour"
    assert pool[0]["data-owners"] == "" and "null block" in pool[0]["title"]


def test_freed_blocks_return_to_the_pool_and_finished_requests_leave_the_map():
    kv = run(6)
    before = hybrid_snapshot(kv)["counters"]["used_blocks"]
    kv.free("b")
    snap = hybrid_snapshot(kv)
    assert [r["id"] for r in snap["requests"]] == ["a"]
    assert snap["counters"]["used_blocks"] < before
    cached_free = [b for b in snap["blocks"] if not b["owners"] and b["cached"]]
    assert cached_free, "b's full, hashed blocks stay cached after it finishes"
    markup = render_hybrid_html(snap)
    pool = {int(b["data-block"]): b for b in elements(markup, "kvlab-pool-block")}
    assert all(pool[b["id"]]["data-cached"] == "1" for b in cached_free)


def test_bad_input_names_what_is_wrong():
    with pytest.raises(TypeError, match="HybridKVCacheCoordinator"):
        hybrid_snapshot(object())
    with pytest.raises(ValueError, match="'requests'"):
        render_hybrid_html({"groups": [], "blocks": [], "null_block": 0})
