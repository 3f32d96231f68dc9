"""Chapter 6's timeline widget: requests' states per step and pool occupancy, next to the engine's block map."""

import pytest
from test_block_map_widget import elements

from kvlab import SamplingParams
from kvlab.engine.llm_engine import LLMEngine
from kvlab.widgets import Timeline, render_timeline_html, snapshot
from kvlab.widgets.timeline import step_state

PROMPTS = ["OTHELLO.\n", "HAMLET.\nTo be, or not", "KING LEAR.\nNothing will come of nothing.\n", "ROMEO.\n"]


def make_engine(model, tokenizer, mode="recompute"):
    engine = LLMEngine(model, tokenizer, block_size=8, num_blocks=10, max_num_seqs=4, max_num_batched_tokens=24,
                       preemption_mode=mode)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    return engine


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_states_follow_the_scheduler(embedded, mode):
    engine = make_engine(*embedded, mode)
    seen = set()
    while engine.has_unfinished_requests():
        engine.step()
        entry = engine.history[-1]
        for rid in entry.status:
            state = step_state(entry, rid)
            seen.add(state)
            if rid in entry.tokens:
                assert state in ("prefill", "decode")
        assert sum(entry.tokens.values()) == entry.batched_tokens <= 24
    expected_out = "swapped" if mode == "swap" else "preempted"
    assert {"prefill", "decode", "waiting", expected_out, "finished"} <= seen, (
        f"a 10-block pool for four 30-token requests should show every state, saw {sorted(seen)}")
    assert engine.history[0].prefill and not any(engine.history[-1].prefill)


def test_render_rows_cells_and_occupancy(embedded):
    engine = make_engine(*embedded)
    for _ in range(6):
        engine.step()
    markup = render_timeline_html(engine.history, "t")
    rows = elements(markup, "kvlab-row")
    assert [r["data-request"] for r in rows] == ["r0", "r1", "r2", "r3"]
    cells = elements(markup, "kvlab-cell")
    assert len(cells) == 4 * 6, "one cell per request per step"
    assert cells[0]["data-state"] == "prefill", "r0 prefills in step 1"
    timeline = elements(markup, "kvlab-timeline")[0]
    assert timeline["data-used"] == str(engine.history[-1].used_blocks)
    assert render_timeline_html([]).count("no step yet") == 1


def test_widget_steps_both_views(embedded):
    widget = Timeline(lambda: make_engine(*embedded), title="continuous batching")
    assert "no step yet" in widget.timeline_html.value
    for _ in range(3):
        widget.step()
    assert elements(widget.timeline_html.value, "kvlab-timeline")[0]["data-step"] == "3"
    assert elements(widget.html.value, "kvlab-block-map")[0]["data-step"] == "3", "the block map steps with it"
    used = snapshot(widget.engine)["counters"]["used_blocks"]
    assert f"used={used}" in widget.summary() and "decode=" in widget.summary()
    while widget.can_step():
        widget.step()
    assert widget.done and "finished=" in widget.summary()
    widget.reset()
    assert widget.engine.step_count == 0 and "no step yet" in widget.timeline_html.value
