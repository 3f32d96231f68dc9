"""The Chapter 3 block-map widget: its snapshot and HTML follow the engine; Step, Play and Reset work."""

from html.parser import HTMLParser

import pytest

from conftest import make_tiny_model
from kvlab.decoding.paged_generate import PagedGenerator
from kvlab.widgets import BlockMap, render_html, snapshot

# After three steps: sequence 0 is running, 1 has finished, 2 has not arrived yet.
PROMPTS = [([1, 2, 3, 4, 5], 6, 0), (list(range(10, 20)), 2, 1), ([7, 8], 9, 3)]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


@pytest.fixture
def make_engine(model):
    """A factory for a small engine running PROMPTS; counts its calls."""

    def make(num_blocks=16):
        make.calls += 1
        gen = PagedGenerator(model, num_blocks=num_blocks, block_size=4)
        for prompt, n, arrival in PROMPTS:
            gen.add_request(prompt, n, arrival_step=arrival)
        return gen

    make.calls = 0
    return make


class _Elements(HTMLParser):
    """Collects the attributes of elements carrying a given class."""

    def __init__(self, css_class):
        super().__init__()
        self.css_class, self.found = css_class, []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if self.css_class in (attrs.get("class") or "").split():
            self.found.append(attrs)


def elements(markup: str, css_class: str) -> list[dict]:
    parser = _Elements(css_class)
    parser.feed(markup)
    return parser.found


def test_snapshot_and_html_follow_the_block_manager(make_engine):
    gen = make_engine()
    for _ in range(3):
        gen.step()
    manager = gen.block_manager
    snap = snapshot(gen)
    owners = manager.owners()
    assert snap["counters"]["used_blocks"] == len(owners) == manager.num_blocks - manager.num_free_blocks > 0
    assert snap["counters"]["tokens_stored"] == sum(manager.num_tokens.values())
    assert [b["owner"] for b in snap["blocks"]] == [owners.get(i) for i in range(manager.num_blocks)]
    assert [b["fill"] for b in snap["blocks"]] == [manager.block_fill(i) for i in range(manager.num_blocks)]
    assert {s["id"]: s["status"] for s in snap["sequences"]} == {0: "running", 1: "finished", 2: "waiting"}

    drawn = elements(render_html(snap), "kvlab-block")
    assert [int(b["data-block"]) for b in drawn] == list(range(manager.num_blocks))
    assert [b["data-owner"] for b in drawn] == ["" if owners.get(i) is None else str(owners[i]) for i in range(16)]
    assert [int(b["data-fill"]) for b in drawn] == [manager.block_fill(i) for i in range(16)]
    tables = {int(s["data-seq"]): int(s["data-blocks"]) for s in elements(render_html(snap), "kvlab-seq")}
    assert tables == {i: len(manager.block_tables.get(i, [])) for i in range(3)}


def test_step_changes_the_drawing_and_reset_starts_over(make_engine):
    bm = BlockMap(make_engine)
    assert make_engine.calls == 1
    first = bm.html.value
    assert bm.step() == []
    assert bm.html.value != first
    assert bm.summary() == "kvlab-block-map step=1 used=2 free=14 tokens=5"
    bm.step()
    bm.reset()
    assert make_engine.calls == 2 and bm.engine.step_count == 0
    assert bm.snapshot()["counters"] == snapshot(make_engine())["counters"]
    assert all(b["data-owner"] == "" for b in elements(bm.html.value, "kvlab-block"))
    assert not bm.step_button.disabled and not bm.play.disabled


def test_play_steps_until_the_engine_is_done_then_stops(make_engine):
    bm = BlockMap(make_engine)
    bm.play.playing = True
    for _ in range(100):  # what the browser does: bump the value every interval while playing
        if not bm.play.playing:
            break
        bm.play.value += 1
    assert not bm.play.playing and bm.done
    assert not bm.engine.has_unfinished() and bm.snapshot()["counters"]["used_blocks"] == 0
    assert bm.step_button.disabled and bm.play.disabled
    assert [s.output_ids for s in bm.engine.sequences.values()] == make_engine().run()
    bm.reset()
    assert bm.play.value == 0 and bm.engine.step_count == 0, "the rewind on reset must not run a step"


def test_a_failing_step_is_shown_not_raised_and_reset_recovers(make_engine):
    bm = BlockMap(lambda: make_engine(num_blocks=3))  # three sequences cannot fit in three blocks of 4
    while bm.error is None and bm.step() is not None:
        pass
    assert "MemoryError" in bm.error and "MemoryError" in bm.html.value
    assert bm.step_button.disabled and bm.step() is None
    bm.reset()
    assert bm.error is None and "kvlab-error" not in bm.html.value


def test_decoded_text_is_shown_escaped(make_engine):
    bm = BlockMap(make_engine, decode=lambda ids: "<b>" + "".join(chr(97 + i % 26) for i in ids))
    bm.step()
    assert "&lt;b&gt;bcdef" in bm.html.value and "<b>bcdef" not in bm.html.value


def test_an_engine_can_supply_its_own_snapshot_with_shared_and_cached_blocks():
    class Engine:
        def snapshot(self):
            return {"block_size": 4, "num_blocks": 3, "step": 2, "done": False, "sequences": [], "blocks": [
                {"id": 0, "owner": 1, "owners": [1, 2], "fill": 4, "ref_count": 2},
                {"id": 1, "owner": None, "fill": 3, "cached": True},
                {"id": 2, "owner": None, "fill": 0},
            ]}

    bm = BlockMap(Engine)
    drawn = elements(bm.html.value, "kvlab-block")
    assert [b["data-owners"] for b in drawn] == ["1 2", "", ""]
    assert [b["data-cached"] for b in drawn] == ["0", "1", "0"] and drawn[0]["data-ref-count"] == "2"
    assert elements(bm.html.value, "kvlab-block-map")[0]["data-used"] == "1", "a cached block counts as free"


def test_a_static_view_gets_a_text_and_html_summary(make_engine):
    """nbviewer, GitHub and exported HTML show no live widget: the display bundle carries the state as text."""
    bm = BlockMap(make_engine, title="pool")
    for _ in range(3):
        bm.step()
    bundle = bm._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == bm.model_id, "live frontends: the widget"
    c = bm.snapshot()["counters"]
    head, seqs = bundle["text/plain"].splitlines()
    assert head == (f"pool: step 3, {c['used_blocks']} of 16 blocks used, {c['free_blocks']} free, "
                    f"{c['tokens_stored']} tokens stored")
    assert seqs.startswith("seq 0 running (") and "seq 1 finished" in seqs
    assert "seq 2 waiting (arrives at step 3)" in seqs
    assert "kvlab-block-map step=" not in bundle["text/plain"], "the printed summary() marker stays unique"
    static = elements(bundle["text/html"], "kvlab-block-map")
    assert static[0]["data-step"] == "3" and static[0]["data-used"] == str(c["used_blocks"])
    assert "kvlab-static-summary" in bundle["text/html"]


def test_legend_items_never_wrap_inside():
    snap = {"block_size": 4, "num_blocks": 2, "step": 0, "sequences": [],
            "blocks": [{"id": 0, "owner": None, "fill": 0, "cached": True}, {"id": 1, "owner": None, "fill": 0}]}
    items = elements(render_html(snap), "kvlab-legend-item")
    assert len(items) == 7 and all("white-space:nowrap" in i["style"] for i in items)
