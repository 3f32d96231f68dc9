"""The block map drawing a speculating engine: tentative draft slots, and the slots rolled back after verification."""

from test_block_map_widget import elements

from conftest import make_tiny_model
from kvlab.engine.llm_engine import LLMEngine
from kvlab.engine.sampling_params import SamplingParams
from kvlab.widgets import render_html


def test_draft_slots_and_rollbacks_are_drawn():
    target = make_tiny_model("llama")
    draft = make_tiny_model("llama", seed=1)  # a different random model: most drafts are rejected
    engine = LLMEngine(target, None, block_size=4, num_blocks=16,
                       speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 4})
    engine.add_request("a", [5, 6, 7, 8, 9, 10], SamplingParams(temperature=0, max_tokens=20))
    saw_draft = saw_rollback = False
    while engine.has_unfinished_requests():
        engine.step()
        snap = engine.snapshot()
        req = engine.requests["a"]
        drafts = sum(b.get("draft", 0) for b in snap["blocks"])
        assert drafts <= len(req.spec_token_ids), "no more tentative slots than pending drafts"
        seq = next(s for s in snap["sequences"] if s["id"] == "a")
        assert seq["spec_token_ids"] == req.spec_token_ids
        rolled = engine.last_rollbacks.get("a")
        if rolled:
            marked = [b for b in snap["blocks"] if b.get("rolled_back")]
            assert marked, "a step that rolled back drafts must mark their blocks"
            assert set(rolled[2]) <= {b["id"] for b in marked}, "blocks given back whole are marked too"
            saw_rollback = True
            markup = render_html(snap)
            outlined = [e for e in elements(markup, "kvlab-block") if e["data-rolled-back"] != "0"]
            assert outlined and "rolled back" in outlined[0]["title"]
        if drafts:
            saw_draft = True
            markup = render_html(snap)
            assert 'class="kvlab-draft"' in markup and "tentative slot" in markup
            assert "hatched top = draft slots" in markup, "the legend explains the hatching"
    assert saw_draft and saw_rollback, "the run should show both tentative and rolled-back slots"
