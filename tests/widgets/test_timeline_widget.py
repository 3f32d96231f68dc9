"""Chapter 6's timeline widget: requests' states per step and pool occupancy, next to the engine's block map."""

import pytest
from test_block_map_widget import elements

from kvlab import SamplingParams
from kvlab.engine.llm_engine import LLMEngine
from kvlab.widgets import PALETTE, Timeline, render_timeline_html, snapshot
from kvlab.widgets.timeline import MAX_STEPS_SHOWN, STATE_COLOURS, cell_size, step_state

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


def test_axis_cells_colours_and_legend(embedded):
    engine = make_engine(*embedded)
    while engine.has_unfinished_requests():
        engine.step()
    history = engine.history
    assert len(history) > 40, "a long run, so the axis has to skip steps"
    for shown in (history[:6], history):
        markup = render_timeline_html(shown)
        steps = [e.step for e in shown]
        ticks = [int(t["data-tick"]) for t in elements(markup, "kvlab-tick")]
        assert ticks[0] == steps[0] and ticks[-1] == steps[-1], "the first and the last step are numbered"
        assert ticks == sorted(set(ticks)) and len(ticks) >= 2
        every = int(elements(markup, "kvlab-axis")[0]["data-every"])
        assert all(t % every == 0 for t in ticks[1:-1])
        width, height = cell_size(len(shown))
        assert all(f"width:{width}px;height:{height}px" in c["style"] for c in elements(markup, "kvlab-cell"))
        items = elements(markup, "kvlab-legend-item")
        assert {i["data-state"] for i in items} == set(STATE_COLOURS)
        assert all("white-space:nowrap" in i["style"] for i in items), "a legend item never wraps inside"
    assert cell_size(6) > (7, 14) and cell_size(6)[0] >= 12, "few steps: readable cells with a letter"
    assert cell_size(MAX_STEPS_SHOWN)[0] * MAX_STEPS_SHOWN <= 800, "many steps: the timeline stays bounded"
    assert len(ticks) < len(history) // 2, "a long run numbers only some steps"
    assert not {c.upper() for c in STATE_COLOURS.values()} & {c.upper() for c in PALETTE}, (
        "state colours are not the block map's sequence colours")


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
    bundle = widget._repr_mimebundle_()
    last = widget.engine.history[-1]
    lines = bundle["text/plain"].splitlines()
    assert lines[0].startswith(f"continuous batching: step {last.step}, ") and "of 10 blocks used" in lines[0]
    assert lines[1] == "; ".join(f"{rid} {step_state(last, rid)}" for rid in last.status)
    assert lines[2].startswith(f"KV block pool: step {last.step}, 0 of 10 blocks used, 10 free")
    assert elements(bundle["text/html"], "kvlab-timeline")[0]["data-step"] == str(last.step)
    assert elements(bundle["text/html"], "kvlab-block-map")[0]["data-step"] == str(last.step)
    widget.reset()
    assert widget.engine.step_count == 0 and "no step yet" in widget.timeline_html.value
