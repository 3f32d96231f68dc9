"""Chapter 5's block map: beam search stepped one step at a time, showing shared blocks, copies and dead beams."""

import pytest
from test_block_map_widget import elements

from conftest import make_tiny_model
from kvlab.decoding.beam_search import BeamSearch, beam_search
from kvlab.widgets import BlockMap, render_html, snapshot

PROMPT = [3, 5, 7, 11, 13, 17]  # 6 tokens: with block size 4, one full block and a half-filled one


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("llama")


def run_all(search):
    snaps = [snapshot(search)]
    while not search.done:
        search.step()
        snaps.append(snapshot(search))
    return snaps


def test_stepping_equals_the_one_call(tiny):
    stepped = BeamSearch(tiny, PROMPT, 4, 10, block_size=4)
    run_all(stepped)
    stats = {}
    assert stepped.results() == beam_search(tiny, PROMPT, 4, 10, block_size=4, stats=stats)
    assert stepped.stats() == stats


def test_every_snapshot_matches_the_pool(tiny):
    search = BeamSearch(tiny, PROMPT, 4, 10, block_size=4)
    snaps = run_all(search)
    assert snaps[0]["counters"]["used_blocks"] == 0, "step 0 is before the prefill: nothing is stored yet"
    after_prefill = snaps[1]
    assert after_prefill["counters"]["used_blocks"] == 2, "a 6-token prompt fills one block of 4 and half of another"
    assert [s["id"] for s in after_prefill["sequences"]] == [0], "before the first selection all beams are one sequence"
    copies_seen = 0
    for snap in snaps[1:-1]:
        for block in snap["blocks"]:
            assert block["ref_count"] == len(block["owners"]), (
                f"block {block['id']}: ref count {block['ref_count']} but owned by {block['owners']}")
        shared = [b for b in snap["blocks"] if len(b["owners"]) > 1]
        assert snap["counters"]["extra"]["shared blocks"] == len(shared)
        assert shared and shared[0]["id"] == 0 or snap["step"] == 1, "the full prompt block stays shared by every beam"
        copied = [b for b in snap["blocks"] if b.get("copied")]
        assert len(copied) == snap["counters"]["extra"]["copy-on-write copies"]
        assert all(len(b["owners"]) == 1 for b in copied), "a fresh copy belongs to exactly one beam"
        copies_seen += len(copied)
    assert copies_seen == search.stats()["copies"] > 0, "the half-filled prompt block must be copied for extra beams"
    last = snaps[-1]
    assert last["done"] and last["counters"]["used_blocks"] == 0, "a finished search returns every block"
    finished = [s for s in last["sequences"] if s["status"].startswith("finished")]
    assert len(finished) == 4 and all(s["block_table"] == [] for s in finished)


def test_fork_counters_agree_with_the_search(tiny):
    search = BeamSearch(tiny, PROMPT, 4, 24, block_size=4)
    snaps = run_all(search)
    per_step = [snap["counters"]["extra"]["forks"] for snap in snaps]
    assert sum(per_step) == search.stats()["forks"], "the block map's forks add up to the search's counter"
    assert per_step[2] == 3, "the first beam step: one child continues the prompt's sequence, 3 are forks"
    for after in snaps[2:-1]:
        beams = len(after["sequences"])
        assert after["counters"]["extra"]["forks"] <= beams - 1, "a parent's first child is no fork"
        assert after["counters"]["extra"]["copy-on-write copies"] <= after["counters"]["extra"]["forks"]


def test_beams_die(tiny):
    search = BeamSearch(tiny, PROMPT, 4, 12, block_size=4)
    died = []
    while not search.done:
        search.step()
        died.append(snapshot(search)["counters"]["extra"]["beams died"])
    assert sum(died) > 0, "over 12 steps some beam should lose all its children"


def test_widget_draws_copies_and_shared_blocks(tiny):
    widget = BlockMap(lambda: BeamSearch(tiny, PROMPT, 4, 8, block_size=4), title="beams")
    widget.step()  # prefill
    widget.step()  # first selection: beams fork off the prompt, extra ones copy its half-filled block
    markup = widget.html.value
    blocks = elements(markup, "kvlab-block")
    assert any(b["data-copied"] == "1" for b in blocks), "the copies of this step are marked"
    assert any(int(b["data-ref-count"] or 0) > 1 for b in blocks), "the shared prompt block carries its ref count"
    assert "copy-on-write copy in the last step" in markup, "the legend explains the red outline"
    assert "beams died" in markup and "forks" in markup
    while widget.can_step():
        widget.step()
    assert widget.done and "finished, score" in widget.html.value


def test_render_marks_a_copied_block():
    snap = {"block_size": 4, "num_blocks": 2, "step": 1, "done": False, "sequences": [],
            "blocks": [{"id": 0, "owner": 0, "owners": [0], "fill": 2, "logical": 0, "ref_count": 1, "copied": True},
                       {"id": 1, "owner": None, "fill": 0, "logical": None, "ref_count": 0}]}
    blocks = elements(render_html(snap), "kvlab-block")
    assert [b["data-copied"] for b in blocks] == ["1", "0"]
    assert "copy-on-write copy made in the last step" in blocks[0]["title"]


def test_stepping_after_done_is_an_error(tiny):
    search = BeamSearch(tiny, PROMPT, 2, 2, block_size=4)
    run_all(search)
    with pytest.raises(RuntimeError, match="finished"):
        search.step()
    with pytest.raises(RuntimeError, match="still running"):
        BeamSearch(tiny, PROMPT, 2, 2).results()
