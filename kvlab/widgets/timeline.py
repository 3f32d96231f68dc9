"""Chapter 6's timeline: each request's state at every engine step, beside the block map of the same engine.

Rows are requests, columns are steps. A cell shows what the request did in that step: waiting,
prefilling (prompt or recompute tokens), decoding one token, preempted (blocks freed), swapped out
to the CPU pool, or finished. Under the rows, a bar per step shows how full the block pool was.
It reads only the engine's `history` (one kvlab.engine.stats.StepRecord per step, plain data), so it
can be drawn from a finished run too: `render_timeline_html(engine.history)`.
"""

import html

import ipywidgets as widgets

from .block_map import BlockMap, snapshot

STATE_COLOURS = {  # Okabe and Ito's palette, as the block map
    "waiting": "#e8e8e8",
    "prefill": "#56B4E9",
    "decode": "#009E73",
    "running": "#9fd8c5",     # admitted but not scheduled in this step (the token budget ran out)
    "preempted": "#D55E00",
    "swapped": "#CC79A7",
    "finished": "#ffffff",
}
CELL_W, CELL_H = 7, 14
MAX_STEPS_SHOWN = 150


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


def render_timeline_html(history: list, title: str = "") -> str:
    """The HTML of the timeline for a list of StepRecords (the last MAX_STEPS_SHOWN steps)."""
    shown = history[-MAX_STEPS_SHOWN:]
    ids = list(dict.fromkeys(rid for entry in shown for rid in entry.status))
    parts = [f'<div style="font-weight:bold;font-size:14px">{html.escape(title)}</div>'] if title else []
    if not shown:
        parts.append('<div class="kvlab-timeline" data-steps="0" style="font:12px sans-serif;color:#777">'
                     'no step yet: press Step</div>')
        return "".join(parts)
    first = shown[0].step
    rows = []
    for rid in ids:
        cells = []
        for entry in shown:
            state = step_state(entry, rid)
            colour = STATE_COLOURS.get(state, "transparent")
            tip = f"{rid}, step {entry.step}: {state or 'not yet arrived'}"
            if rid in entry.tokens:
                tip += f" ({entry.tokens[rid]} tokens)"
            border = "1px solid #bbb" if state and state != "finished" else "1px solid transparent"
            cells.append(f'<span class="kvlab-cell" data-state="{state}" title="{html.escape(tip)}"'
                         f' style="display:inline-block;box-sizing:border-box;width:{CELL_W}px;height:{CELL_H}px;'
                         f'background:{colour};border:{border}"></span>')
        last = step_state(shown[-1], rid)
        rows.append(f'<div class="kvlab-row" data-request="{html.escape(str(rid))}" data-state="{last}"'
                    f' style="white-space:nowrap;line-height:0">'
                    f'<span style="display:inline-block;width:70px;font:11px/14px monospace;overflow:hidden;'
                    f'vertical-align:top">{html.escape(str(rid))}</span>{"".join(cells)}</div>')
    bars = []
    for entry in shown:
        share = entry.used_blocks / entry.num_blocks if entry.num_blocks else 0.0
        height = round(30 * share)
        bars.append(f'<span title="step {entry.step}: {entry.used_blocks} of {entry.num_blocks} blocks used, '
                    f'{entry.batched_tokens} tokens in the batch"'
                    f' style="display:inline-block;width:{CELL_W}px;height:30px;vertical-align:bottom;'
                    f'background:linear-gradient(to top,#0072B2 {height}px,#f4f4f4 {height}px)"></span>')
    last = shown[-1]
    counts = {}
    for rid in ids:
        state = step_state(last, rid)
        counts[state] = counts.get(state, 0) + 1
    summary = (f"step {last.step} · {last.batched_tokens} tokens in the batch · {last.used_blocks} of "
               f"{last.num_blocks} blocks used · " + ", ".join(f"{n} {s}" for s, n in counts.items() if s))
    legend = " ".join(f'<span style="display:inline-block;width:10px;height:10px;background:{c};border:1px solid #bbb;'
                      f'vertical-align:middle"></span> {s}' for s, c in STATE_COLOURS.items())
    parts.append(
        f'<div class="kvlab-timeline" data-steps="{len(shown)}" data-step="{last.step}" data-used="{last.used_blocks}"'
        f' style="font-family:sans-serif">'
        f'<div class="kvlab-timeline-summary" style="font:12px monospace;margin:2px 0 6px 0">'
        f'{html.escape(summary)}</div><div style="font-size:11px;color:#555">steps {first}-{last.step} →</div>'
        f'{"".join(rows)}<div style="white-space:nowrap;margin-top:4px"><span style="display:inline-block;width:70px;'
        f'font:11px monospace;vertical-align:bottom">pool use</span>{"".join(bars)}</div>'
        f'<div style="font-size:11px;color:#555;margin-top:4px">{legend}</div></div>')
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

    def summary(self) -> str:
        """The block map's counters plus the timeline's last step, as one line of text."""
        history = getattr(self.engine, "history", []) if self.engine is not None else []
        states = {}
        if history:
            for rid in history[-1].status:
                state = step_state(history[-1], rid)
                states[state] = states.get(state, 0) + 1
        return super().summary() + " " + " ".join(f"{s}={n}" for s, n in sorted(states.items()) if s)


__all__ = ["Timeline", "render_timeline_html", "step_state", "snapshot"]
