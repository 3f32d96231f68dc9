"""Chapter 6's timeline: each request's state at every engine step, beside the block map of the same engine.

Rows are requests, columns are steps. A cell shows what the request did in that step: waiting,
prefilling (prompt or recompute tokens), decoding one token, preempted (blocks freed), swapped out
to the CPU pool, or finished. Under the rows, a bar per step shows how full the block pool was.
It reads only the engine's `history` (one kvlab.engine.stats.StepRecord per step, plain data), so it
can be drawn from a finished run too: `render_timeline_html(engine.history)`.
"""

import html

import ipywidgets as widgets

from .block_map import BlockMap, snapshot, static_html

# Paul Tol's muted scheme (colour-blind safe), kept apart from the Okabe-Ito colours the block map gives
# sequences: a state is never mistaken for a request. Preempted and swapped cells are hatched too, and
# cells wide enough carry a letter, so no state is told by colour alone.
STATE_COLOURS = {
    "waiting": "#DDDDDD",
    "prefill": "#332288",     # prompt (or recompute) tokens
    "decode": "#999933",      # one new token
    "running": "#DDDDAA",     # admitted but not scheduled in this step (the token budget ran out)
    "preempted": "#882255",   # blocks freed, to be recomputed
    "swapped": "#DDCC77",     # blocks moved to the CPU pool
    "finished": "#ffffff",
}
STATE_PATTERNS = {
    "preempted": "repeating-linear-gradient(45deg, #882255 0 3px, #c27a9c 3px 5px)",
    "swapped": "repeating-linear-gradient(-45deg, #DDCC77 0 3px, #9a8a3c 3px 4px)",
}
STATE_LETTERS = {"waiting": "w", "prefill": "P", "decode": "D", "running": "r", "preempted": "X", "swapped": "S",
                 "finished": ""}
STATE_TEXT = {"prefill": "#fff", "preempted": "#fff"}
STATE_LABELS = {
    "waiting": "waiting",
    "prefill": "prefill (prompt or recompute)",
    "decode": "decode (one token)",
    "running": "running, not scheduled",
    "preempted": "preempted (blocks freed)",
    "swapped": "swapped out to CPU",
    "finished": "finished",
}
MAX_CELL_W, MIN_CELL_W = 22, 5  # few steps get wide, readable cells; many steps stay within TIMELINE_PX
TIMELINE_PX = 660
LETTER_MIN_W = 12
LABEL_W = 70
MAX_STEPS_SHOWN = 150
# The old fixed cell size, kept for code that reads it.
CELL_W, CELL_H = MIN_CELL_W, 14


def cell_size(num_steps: int) -> tuple[int, int]:
    """The (width, height) in px of one cell when num_steps steps are shown."""
    width = max(MIN_CELL_W, min(MAX_CELL_W, TIMELINE_PX // max(num_steps, 1)))
    return width, (20 if width >= LETTER_MIN_W else 14)


def _tick_gap(last_step: int) -> int:
    # The least room between two numbered steps: a 10px monospace digit is about 6px wide.
    return 6 * len(str(last_step)) + 10


def tick_every(cell_w: int, last_step: int = 999) -> int:
    """The step interval between numbered ticks: the smallest of 1, 2, 5, 10, ... whose labels do not touch."""
    for every in (1, 2, 5, 10, 20, 25, 50, 100, 200, 500):
        if every * cell_w >= _tick_gap(last_step):
            return every
    return 1000


def _background(state: str) -> str:
    return STATE_PATTERNS.get(state, STATE_COLOURS.get(state, "transparent"))


def _axis_html(steps: list[int], cell_w: int) -> str:
    """Tick labels every tick_every() steps; the first and the last step are always numbered."""
    last = len(steps) - 1
    every = tick_every(cell_w, steps[-1])
    near_end = _tick_gap(steps[-1]) / cell_w
    marks = [i for i, s in enumerate(steps) if s % every == 0 and i - 0 >= near_end and last - i >= near_end]
    marks = sorted({0, last, *marks})
    ticks = "".join(
        f'<span class="kvlab-tick" data-tick="{steps[i]}" style="position:absolute;left:{i * cell_w}px;'
        f'width:{cell_w}px;bottom:0;height:5px;border-left:1px solid #888;box-sizing:border-box"></span>'
        f'<span class="kvlab-tick-label" style="position:absolute;left:{i * cell_w + cell_w / 2:g}px;top:0;'
        f'transform:translateX(-50%);font:10px/12px monospace;color:#333">{steps[i]}</span>'
        for i in marks)
    return (f'<div class="kvlab-axis" data-every="{every}" style="display:flex;white-space:nowrap">'
            f'<span style="display:inline-block;width:{LABEL_W}px;flex:none;font:11px/18px monospace;color:#555">'
            f'step</span><span style="position:relative;display:inline-block;flex:none;width:{len(steps) * cell_w}px;'
            f'height:18px">{ticks}</span></div>')


def _legend_item(state: str) -> str:
    letter = STATE_LETTERS[state]
    return (f'<span class="kvlab-legend-item" data-state="{state}" style="white-space:nowrap;display:inline-block;'
            f'margin:0 10px 2px 0"><span style="display:inline-block;box-sizing:border-box;width:14px;height:14px;'
            f'background:{_background(state)};border:1px solid #999;vertical-align:middle;text-align:center;'
            f'font:bold 10px/12px monospace;color:{STATE_TEXT.get(state, "#111")}">{letter}</span> '
            f'{html.escape(STATE_LABELS[state])}</span>')


def step_state(entry, request_id: str) -> str:
    """What request_id did in one StepRecord: a key of STATE_COLOURS, or "" before it arrived."""
    status = entry.status.get(request_id)
    if status is None:
        return ""
    if request_id in entry.preempted:
        return "swapped" if status == "swapped" else "preempted"
    if request_id in entry.tokens:
        return "prefill" if request_id in entry.prefill else "decode"
    if status.startswith("finished"):
        return "finished"
    if status in ("preempted", "waiting"):
        return "waiting" if status == "waiting" else "preempted"
    return status if status in STATE_COLOURS else "waiting"


def _state_counts(entry, ids) -> dict:
    counts = {}
    for rid in ids:
        state = step_state(entry, rid)
        counts[state] = counts.get(state, 0) + 1
    return counts


def timeline_summary(history: list, title: str = "") -> str:
    """The last step of a history in one or two plain lines: what a static view shows instead of the widget."""
    head = f"{title}: " if title else ""
    if not history:
        return head + "no step yet"
    last = history[-1]
    ids = list(last.status)
    counts = _state_counts(last, ids)
    tokens = f"{last.batched_tokens} token{'' if last.batched_tokens == 1 else 's'}"
    line = (f"{head}step {last.step}, {tokens} in the batch, {last.used_blocks} of "
            f"{last.num_blocks} blocks used; " + ", ".join(f"{n} {s}" for s, n in counts.items() if s))
    states = "; ".join(f"{rid} {step_state(last, rid)}" for rid in ids if step_state(last, rid))
    return line + ("\n" + states if states else "")


def render_timeline_html(history: list, title: str = "") -> str:
    """The HTML of the timeline for a list of StepRecords (the last MAX_STEPS_SHOWN steps)."""
    shown = history[-MAX_STEPS_SHOWN:]
    ids = list(dict.fromkeys(rid for entry in shown for rid in entry.status))
    parts = [f'<div style="font-weight:bold;font-size:14px">{html.escape(title)}</div>'] if title else []
    if not shown:
        parts.append('<div class="kvlab-timeline" data-steps="0" style="font:12px sans-serif;color:#777">'
                     'no step yet: press Step</div>')
        return "".join(parts)
    cell_w, cell_h = cell_size(len(shown))
    letters = cell_w >= LETTER_MIN_W
    first = shown[0].step
    label = (f'display:inline-block;width:{LABEL_W}px;font:11px/{cell_h}px monospace;overflow:hidden;'
             f'text-overflow:ellipsis;vertical-align:top')
    rows = []
    for rid in ids:
        cells = []
        for entry in shown:
            state = step_state(entry, rid)
            tip = f"{rid}, step {entry.step}: {state or 'not yet arrived'}"
            if rid in entry.tokens:
                tip += f" ({entry.tokens[rid]} tokens)"
            border = "1px solid #fff" if state and state != "finished" else "1px solid transparent"
            letter = STATE_LETTERS.get(state, "") if letters else ""
            cells.append(f'<span class="kvlab-cell" data-state="{state}" title="{html.escape(tip)}"'
                         f' style="display:inline-block;box-sizing:border-box;width:{cell_w}px;height:{cell_h}px;'
                         f'vertical-align:top;background:{_background(state)};border:{border};text-align:center;'
                         f'font:bold 10px/{cell_h - 2}px monospace;color:{STATE_TEXT.get(state, "#111")}">'
                         f'{letter}</span>')
        last = step_state(shown[-1], rid)
        rows.append(f'<div class="kvlab-row" data-request="{html.escape(str(rid))}" data-state="{last}"'
                    f' style="white-space:nowrap;line-height:0">'
                    f'<span style="{label}" title="{html.escape(str(rid))}">{html.escape(str(rid))}</span>'
                    f'{"".join(cells)}</div>')
    bars = []
    for entry in shown:
        share = entry.used_blocks / entry.num_blocks if entry.num_blocks else 0.0
        height = round(30 * share)
        bars.append(f'<span title="step {entry.step}: {entry.used_blocks} of {entry.num_blocks} blocks used, '
                    f'{entry.batched_tokens} tokens in the batch"'
                    f' style="display:inline-block;width:{cell_w}px;height:30px;vertical-align:bottom;'
                    f'box-sizing:border-box;border-right:1px solid #fff;'
                    f'background:linear-gradient(to top,#555 {height}px,#f0f0f0 {height}px)"></span>')
    last = shown[-1]
    summary = timeline_summary(shown).splitlines()[0]
    legend = " ".join(_legend_item(s) for s in STATE_COLOURS)
    parts.append(
        f'<div class="kvlab-timeline" data-steps="{len(shown)}" data-step="{last.step}" data-used="{last.used_blocks}"'
        f' data-cell-width="{cell_w}" style="font-family:sans-serif">'
        f'<div class="kvlab-timeline-summary" style="font:12px/16px monospace;margin:2px 0 6px 0">'
        f'{html.escape(summary)}</div>'
        f'<div style="font-size:11px;line-height:16px;color:#555">steps {first}-{last.step} →'
        f'{" (hover a cell for details)" if not letters else ""}</div>'
        f'{_axis_html([e.step for e in shown], cell_w)}'
        f'{"".join(rows)}<div style="white-space:nowrap;margin-top:4px;line-height:0">'
        f'<span style="display:inline-block;width:{LABEL_W}px;font:11px monospace;line-height:14px;'
        f'vertical-align:bottom">pool use</span>{"".join(bars)}'
        f'</div><div class="kvlab-legend" style="font-size:11px;line-height:16px;color:#333;margin-top:6px;max-width:'
        f'{max(360, LABEL_W + len(shown) * cell_w)}px">{legend}</div></div>')
    return "".join(parts)


class Timeline(BlockMap):
    """The engine timeline next to its block map, with the block map's Step, Play and Reset."""

    def __init__(self, make_engine, decode=None, title: str = "Continuous batching", **kwargs):
        self.timeline_html = widgets.HTML(layout=widgets.Layout(min_width="360px", margin="0 24px 0 0"))
        super().__init__(make_engine, decode=decode, title="KV block pool", **kwargs)
        self.timeline_title = title
        controls = self.children[0]
        self.children = [controls, widgets.HBox([self.timeline_html, self.html],
                                                layout=widgets.Layout(align_items="flex-start"))]
        self.add_class("kvlab-timeline-widget")
        self.refresh()

    def refresh(self) -> None:
        super().refresh()
        history = getattr(self.engine, "history", []) if self.engine is not None else []
        self.timeline_html.value = render_timeline_html(history, getattr(self, "timeline_title", ""))

    def summary_text(self) -> str:
        """The timeline's last step and the block pool, as plain lines for views without a live kernel."""
        history = getattr(self.engine, "history", []) if self.engine is not None else []
        return timeline_summary(history, getattr(self, "timeline_title", "")) + "\n" + super().summary_text()

    def static_html(self) -> str:
        body = (f'<div style="display:flex;flex-wrap:wrap;gap:24px;align-items:flex-start">'
                f'<div>{self.timeline_html.value}</div><div>{self.html.value}</div></div>')
        return static_html(body, self.summary_text())

    def summary(self) -> str:
        """The block map's counters plus the timeline's last step, as one line of text."""
        history = getattr(self.engine, "history", []) if self.engine is not None else []
        states = {}
        if history:
            for rid in history[-1].status:
                state = step_state(history[-1], rid)
                states[state] = states.get(state, 0) + 1
        return super().summary() + " " + " ".join(f"{s}={n}" for s, n in sorted(states.items()) if s)


__all__ = ["Timeline", "render_timeline_html", "timeline_summary", "step_state", "cell_size", "snapshot",
           "STATE_COLOURS"]
