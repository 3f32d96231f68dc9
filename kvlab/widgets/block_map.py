"""A live map of the paged KV cache: the physical block pool, each sequence's block table, and controls.

The drawing never reads an engine directly. `snapshot(engine)` turns the engine into plain data and
`render_html(snap)` draws that data, so any engine that produces the same dictionary can be shown:

    {
      "block_size": 16, "num_blocks": 32, "step": 3, "done": False,
      "blocks": [                       # one per physical block, in id order
        {"id": 0, "owner": 1, "fill": 12, "logical": 0,
         # optional, for later chapters:
         "owners": [1, 2],              # every sequence whose table holds the block (shared prefix)
         "ref_count": 2,                # drawn as a badge when above 1
         "cached": True,                # free but still holding reusable K/V (drawn hatched)
         "hit": True,                   # a prefix-cache hit in the last step (drawn with a thick outline)
         "copied": True,                # a copy-on-write copy made in the last step (drawn with a red outline)
         "draft": 3,                    # slots of draft tokens waiting to be verified (drawn hatched above the fill)
         "rolled_back": 2,              # slots of drafts rejected in the last step (drawn with a dotted outline)
         "note": "any extra hover text"},
        ...],
      "sequences": [
        {"id": 1, "status": "running",  # "waiting" / "running" / "finished" or an engine's own word
         "block_table": [5, 9], "tokens_stored": 20, "prompt_ids": [...], "output_ids": [...],
         "arrival_step": 0,             # optional
         "num_cached_tokens": 8,        # optional: prompt tokens served from the prefix cache at admission
         "prompt_text": "...", "output_text": "..."},  # optional: else decode(ids) is used
        ...],
      "counters": {...},                # optional: counters_for(blocks, block_size, step) fills it in
    }

An engine with a `snapshot()` method supplies its own; `BlockMap(snapshot_fn=...)` swaps the adapter.
"""

import html
import zlib
from collections.abc import Callable

import ipywidgets as widgets

from kvlab.core.block_views import block_owners, counters_for

# Okabe and Ito's palette: distinguishable with the common colour-vision deficiencies.
PALETTE = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7")
FREE_COLOUR = "#e8e8e8"
FREE_FILL_COLOUR = "#9e9e9e"  # content kept by a cached-but-free block
HIT_OUTLINE = "2px solid #000"  # a block hit by the prefix cache in the last step
COPY_OUTLINE = "2px dashed #D55E00"  # a block that received a copy-on-write copy in the last step
ROLLBACK_OUTLINE = "2px dotted #CC79A7"  # a block where rejected draft tokens were rolled back in the last step
CELL_PX = 36
PLAY_MAX = 10**6  # Play counts up to this; the widget stops it when the engine is done


def seq_colour(seq_id) -> str:
    """The palette colour of a sequence; stable for ids of any type."""
    index = seq_id if isinstance(seq_id, int) else zlib.crc32(str(seq_id).encode())
    return PALETTE[index % len(PALETTE)]


def snapshot(engine) -> dict:
    """The engine's cache state as plain data (see the module docstring); a PagedGenerator or anything alike.

    An engine without a snapshot() of its own needs `block_manager` (read through the queries every
    chapter's block manager shares: block_size, num_blocks, block_tables, num_tokens), `step_count`,
    `has_unfinished()` and `sequence_views(block_tables, num_tokens)`.
    """
    if callable(getattr(engine, "snapshot", None)):
        return engine.snapshot()
    manager = engine.block_manager
    size = manager.block_size
    block_tables, num_tokens = manager.block_tables, manager.num_tokens
    blocks = [{"id": b, "owner": None, "fill": 0, "logical": None} for b in range(manager.num_blocks)]
    for seq_id, table in block_tables.items():
        stored = num_tokens[seq_id]
        for logical, block in enumerate(table):
            blocks[block].update(owner=seq_id, fill=min(size, stored - logical * size), logical=logical)
    sequences = engine.sequence_views(block_tables, num_tokens)
    return {
        "block_size": size,
        "num_blocks": manager.num_blocks,
        "step": engine.step_count,
        "done": not engine.has_unfinished(),
        "blocks": blocks,
        "sequences": sequences,
        "counters": counters_for(blocks, size, engine.step_count),
    }


def _counters(snap: dict) -> dict:
    return snap.get("counters") or counters_for(snap["blocks"], snap["block_size"], snap.get("step", 0))


def _esc(value) -> str:
    return html.escape(str(value), quote=True)


def _attr(value) -> str:
    return "" if value is None else _esc(value)


def _stripes(colours: list[str]) -> str:
    # A shared block shows every owner's colour in diagonal bands.
    band = 6
    stops = ", ".join(f"{c} {i * band}px {(i + 1) * band}px" for i, c in enumerate(colours))
    return f"repeating-linear-gradient(45deg, {stops})"


def _block_html(block: dict, block_size: int) -> str:
    owners = block_owners(block)
    fill = int(block.get("fill", 0))
    cached = bool(block.get("cached")) and not owners
    ref_count = block.get("ref_count")
    if owners:
        colours = [seq_colour(o) for o in owners]
        bar = colours[0] if len(colours) == 1 else _stripes(colours)
        background, border = colours[0] + "33", "1px solid #555"
        who = f"seq {owners[0]}" if len(owners) == 1 else "shared by seqs " + ", ".join(map(str, owners))
        if block.get("logical") is not None and len(owners) == 1:
            who += f", logical block {block['logical']}"
    else:
        bar = FREE_FILL_COLOUR
        background = f"repeating-linear-gradient(45deg, {FREE_COLOUR} 0 4px, #d0d0d0 4px 6px)" if cached \
            else FREE_COLOUR
        border = "1px dashed #777" if cached else "1px solid #c4c4c4"
        who = "free, cached" if cached else "free"
    hover = f"physical block {block['id']}: {who}; {fill}/{block_size} tokens"
    if ref_count is not None:
        hover += f"; ref count {ref_count}"
    if block.get("note"):
        hover += f"; {block['note']}"
    hit = bool(block.get("hit"))
    if hit:
        hover += "; prefix-cache hit in the last step"
    copied = bool(block.get("copied"))
    if copied:
        hover += "; copy-on-write copy made in the last step"
    draft, rolled_back = int(block.get("draft", 0)), int(block.get("rolled_back", 0))
    if draft:
        hover += f"; {draft} tentative slot(s) for draft tokens, verified next step"
    if rolled_back:
        hover += f"; {rolled_back} slot(s) of rejected draft tokens rolled back in the last step"
    style = COPY_OUTLINE if copied else HIT_OUTLINE if hit else ROLLBACK_OUTLINE
    outline = f"outline:{style};outline-offset:1px;" if hit or copied or rolled_back else ""
    height = round(100 * min(fill, block_size) / block_size)
    draft_height = round(100 * min(draft, block_size - min(fill, block_size)) / block_size)
    draft_colour = seq_colour(owners[0]) if owners else FREE_FILL_COLOUR
    draft_bar = (f'<div class="kvlab-draft" style="position:absolute;left:0;right:0;bottom:{height}%;'
                 f'height:{draft_height}%;background:repeating-linear-gradient(45deg, {draft_colour} 0 3px, '
                 f'transparent 3px 6px)"></div>') if draft_height else ""
    # Integer ids read "s3"; engines with named requests ("r3", "0_req") show the name itself.
    first = "" if not owners else (f"s{owners[0]}" if isinstance(owners[0], int) else str(owners[0])[:4])
    owner_label = first + ("+" if len(owners) > 1 else "")
    badge = (f'<span style="position:absolute;right:1px;top:1px;font-size:9px;background:#222;color:#fff;'
             f'border-radius:3px;padding:0 2px">×{_esc(ref_count)}</span>') if ref_count and ref_count > 1 else ""
    label_style = "position:relative;display:block;line-height:12px;background:rgba(255,255,255,.75);padding:0 1px"
    return (
        f'<div class="kvlab-block" data-block="{_attr(block["id"])}"'
        f' data-owner="{_attr(owners[0] if owners else None)}"'
        f' data-owners="{_esc(" ".join(map(str, owners)))}" data-fill="{fill}" data-cached="{int(cached)}"'
        f' data-ref-count="{_attr(ref_count)}" data-hit="{int(hit)}" data-copied="{int(copied)}"'
        f' data-draft="{draft}" data-rolled-back="{rolled_back}" title="{_esc(hover)}"'
        f' style="position:relative;box-sizing:border-box;width:{CELL_PX}px;height:{CELL_PX}px;'
        f'border:{border};{outline}'
        f'border-radius:4px;background:{background};overflow:hidden;font:10px/1.1 monospace;color:#111">'
        f'<div class="kvlab-fill" style="position:absolute;left:0;right:0;bottom:0;height:{height}%;'
        f'background:{bar}"></div>{draft_bar}'
        f'<span style="{label_style};width:max-content">{_esc(block["id"])}</span>'
        f'<span style="{label_style};width:max-content;font-weight:bold">{_esc(owner_label)}</span>{badge}</div>'
    )


def _text(seq: dict, key: str, decode: Callable | None) -> str:
    if seq.get(f"{key}_text") is not None:
        return seq[f"{key}_text"]
    ids = list(seq.get(f"{key}_ids", []))
    if decode is not None:
        try:
            return decode(ids)
        except Exception:  # a bad id must not break the drawing: fall back to the ids
            pass
    return " ".join(map(str, ids))


def _clip(text: str, limit: int, keep_end: bool) -> str:
    if len(text) <= limit:
        return text
    return "…" + text[-limit:] if keep_end else text[:limit] + "…"


def _sequence_html(seq: dict, blocks_by_id: dict, decode: Callable | None) -> str:
    colour = seq_colour(seq["id"])
    status = seq.get("status", "")
    table = seq.get("block_table", [])
    cells = []
    for logical, block_id in enumerate(table):
        shared = len(block_owners(blocks_by_id.get(block_id, {}))) > 1
        hover = f"logical block {logical} → physical block {block_id}" + (" (shared)" if shared else "")
        cells.append(
            f'<span title="{_esc(hover)}" style="display:inline-block;margin:1px;padding:0 3px;border-radius:3px;'
            f'background:{colour}55;border:1px {"dashed" if shared else "solid"} {colour};font:11px monospace">'
            f'{logical}→{_esc(block_id)}</span>'
        )
    if not cells:
        cells.append('<span style="color:#777;font-size:11px">'
                     + ("blocks returned to the pool" if status == "finished" else "no blocks yet") + "</span>")
    detail = f"{seq.get('tokens_stored', 0)} tokens cached"
    num_cached = seq.get("num_cached_tokens")
    if num_cached is not None and status != "waiting":
        detail += f" · prefix-cache hit: {num_cached} of {len(seq.get('prompt_ids', []))} prompt tokens"
    if status == "waiting" and seq.get("arrival_step") is not None:
        detail = f"arrives at step {seq['arrival_step']}"
    prompt = _clip(_text(seq, "prompt", decode), 80, keep_end=True)
    output = _clip(_text(seq, "output", decode), 400, keep_end=True)
    if decode is None and "output_text" not in seq and prompt and output:
        output = " " + output  # token ids: keep the last prompt id and the first new one apart
    return (
        f'<div class="kvlab-seq" data-seq="{_attr(seq["id"])}" data-status="{_esc(status)}"'
        f' data-blocks="{len(table)}" data-cached-tokens="{_attr(num_cached)}"'
        f' style="margin:0 0 6px 0;padding:3px 6px;border-left:6px solid {colour}">'
        f'<div style="font-size:12px"><b>seq {_esc(seq["id"])}</b> · <i>{_esc(status)}</i> · {_esc(detail)}</div>'
        f'<div>{"".join(cells)}</div>'
        f'<div class="kvlab-text" style="font:11px monospace;white-space:pre-wrap;max-width:420px">'
        f'<span style="color:#777">{_esc(prompt)}</span><b>{_esc(output)}</b></div></div>'
    )


def _counters_html(c: dict) -> str:
    text = (f"step {c['step']} · {c['used_blocks']} of {c['num_blocks']} blocks used, {c['free_blocks']} free"
            f" · {c['tokens_stored']} tokens stored · {c['slot_utilization']:.0%} of used block slots hold tokens")
    for label, value in c.get("extra", {}).items():
        text += f" · {label}: {value}"
    return (f'<div class="kvlab-counters" data-step="{c["step"]}" data-used="{c["used_blocks"]}"'
            f' data-free="{c["free_blocks"]}" data-tokens="{c["tokens_stored"]}"'
            f' style="font:12px monospace;margin:4px 0 8px 0">{_esc(text)}</div>')


def _nowrap(*items: str) -> str:
    # Legend items break between each other, never inside one ("hatched = free but | cached").
    return " ".join(f'<span class="kvlab-legend-item" style="white-space:nowrap;display:inline-block;'
                    f'margin-right:8px">{item}</span>' for item in items)


def _legend_html(blocks: list[dict], width_px: int) -> str:
    # Only snapshots that use the sharing fields (Chapter 4 on) get this second legend line.
    if not any(key in b for b in blocks for key in ("ref_count", "cached", "hit", "copied", "draft", "rolled_back")):
        return ""
    swatch = "display:inline-block;width:10px;height:10px;vertical-align:middle;margin:0 2px 0 0;box-sizing:border-box"
    cached = f"repeating-linear-gradient(45deg, {FREE_COLOUR} 0 2px, #a0a0a0 2px 3px)"
    items = _nowrap(
        f'<span style="{swatch};background:{cached};border:1px dashed #777"></span>'
        f'hatched = free but cached (reusable K/V)',
        '<span style="font-size:9px;background:#222;color:#fff;border-radius:3px;padding:0 2px">×2</span>'
        ' = ref count (shared)',
        f'<span style="{swatch};outline:{HIT_OUTLINE};outline-offset:1px;margin-left:2px;margin-right:4px"></span>'
        'outline = prefix-cache hit in the last step',
        f'<span style="{swatch};outline:{COPY_OUTLINE};outline-offset:1px;margin-left:2px;margin-right:4px"></span>'
        'dashed red = copy-on-write copy in the last step',
        *((f'<span style="{swatch};background:repeating-linear-gradient(45deg, #555 0 2px, transparent 2px 4px)">'
           '</span>hatched top = draft slots, verified next step',
           f'<span style="{swatch};outline:{ROLLBACK_OUTLINE};outline-offset:1px;margin-left:2px;margin-right:4px">'
           '</span>dotted = rejected drafts rolled back in the last step')
          if any("draft" in b or "rolled_back" in b for b in blocks) else ()),
    )
    return (f'<div class="kvlab-legend" style="font-size:11px;line-height:16px;color:#555;margin-top:2px;'
            f'max-width:{width_px}px">{items}</div>')


def _seq_phrase(seq: dict) -> str:
    status = seq.get("status", "")
    text = f"seq {seq['id']} {status}"
    if status == "waiting" and seq.get("arrival_step") is not None:
        return text + f" (arrives at step {seq['arrival_step']})"
    table = seq.get("block_table", [])
    if table:
        text += f" ({len(table)} block{'s' if len(table) != 1 else ''}, {seq.get('tokens_stored', 0)} tokens)"
    return text


def summary_text(snap: dict | None, title: str = "", error: str | None = None) -> str:
    """One or two plain lines describing a snapshot: what a static view (no live kernel) shows instead."""
    head = f"{title}: " if title else ""
    if snap is None:
        return f"{head}no engine" + (f" ({error})" if error else "")
    c = _counters(snap)
    lines = [f"{head}step {c['step']}, {c['used_blocks']} of {c['num_blocks']} blocks used, {c['free_blocks']} free,"
             f" {c['tokens_stored']} tokens stored" + (" (done)" if snap.get("done") else "")]
    seqs = snap.get("sequences", [])
    if seqs:
        lines.append("; ".join(_seq_phrase(s) for s in seqs))
    if error:
        lines.append(error.splitlines()[0])
    return "\n".join(lines)


def static_html(body: str, text: str) -> str:
    """A widget's drawing for a static view: the text summary above a snapshot of the HTML."""
    return (f'<div class="kvlab-static"><div class="kvlab-static-summary" style="font:12px monospace;'
            f'white-space:pre-wrap;color:#333;margin-bottom:4px">{_esc(text)}</div>'
            f'<div style="font-size:11px;color:#777;margin-bottom:4px">static snapshot: run the notebook for'
            f' the live widget (Step, Play, Reset)</div>{body}</div>')


def render_html(snap: dict | None, decode: Callable | None = None, title: str = "", error: str | None = None,
                columns: int | None = None) -> str:
    """The HTML of one snapshot: counters, the block grid, the block tables, and an error line if any."""
    parts = [f'<div style="font-weight:bold;font-size:14px">{_esc(title)}</div>'] if title else []
    attrs = ""
    if snap is not None:
        size = snap["block_size"]
        blocks = snap["blocks"]
        counters = _counters(snap)
        attrs = (f' data-step="{counters["step"]}" data-used="{counters["used_blocks"]}"'
                 f' data-free="{counters["free_blocks"]}" data-num-blocks="{len(blocks)}"')
        columns = columns or min(len(blocks), 8 if len(blocks) <= 48 else 16)
        grid = "".join(_block_html(b, size) for b in blocks)
        by_id = {b["id"]: b for b in blocks}
        seqs = "".join(_sequence_html(s, by_id, decode) for s in snap.get("sequences", []))
        parts += [
            _counters_html(counters),
            '<div style="display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start">'
            f'<div><div style="font-size:12px;margin-bottom:3px">'
            f'physical block pool ({size} token slots per block)</div>'
            f'<div class="kvlab-pool" style="display:grid;grid-template-columns:repeat({columns},{CELL_PX}px);gap:3px">'
            f'{grid}</div><div style="font-size:11px;line-height:16px;color:#555;margin-top:3px;'
            f'max-width:{columns * (CELL_PX + 3)}px">'
            f'{_nowrap("bar height = slots holding tokens", "grey = free", "hover a block for details")}</div>'
            f'{_legend_html(blocks, columns * (CELL_PX + 3))}</div>'
            f'<div class="kvlab-seqs" style="min-width:260px"><div style="font-size:12px;margin-bottom:3px">'
            f'block tables (logical → physical)</div>{seqs}</div></div>',
        ]
    if error:
        parts.append(f'<div class="kvlab-error" style="color:#b00020;font:12px monospace;white-space:pre-wrap;'
                     f'margin-top:6px">{_esc(error)}</div>')
    return f'<div class="kvlab-block-map"{attrs} style="font-family:sans-serif">{"".join(parts)}</div>'


class BlockMap(widgets.VBox):
    """A live block map of an engine built by `make_engine`, with Step, Play and Reset."""

    def __init__(self, make_engine: Callable[[], object], decode: Callable | None = None,
                 title: str = "Paged KV cache", snapshot_fn: Callable[[object], dict] = snapshot,
                 interval_ms: int = 400, columns: int | None = None):
        self._make_engine = make_engine
        self.decode = decode
        self.title = title
        self.snapshot_fn = snapshot_fn
        self.columns = columns
        self.engine = None
        self.error: str | None = None
        self.last_snapshot: dict | None = None
        self._resetting = False

        self.step_button = widgets.Button(description="Step", icon="step-forward", tooltip="run one engine step")
        self.play = widgets.Play(value=0, min=0, max=PLAY_MAX, interval=interval_ms, show_repeat=False,
                                 description="Play", tooltip="step until every sequence is done")
        self.speed = widgets.IntSlider(value=interval_ms, min=50, max=2000, step=50, description="ms / step",
                                       continuous_update=False, layout=widgets.Layout(width="260px"))
        self.reset_button = widgets.Button(description="Reset", icon="undo", tooltip="rebuild the engine from scratch")
        self.html = widgets.HTML()
        widgets.link((self.speed, "value"), (self.play, "interval"))
        self.step_button.on_click(lambda _: self.step())
        self.reset_button.on_click(lambda _: self.reset())
        self.play.observe(self._on_play, names="value")

        controls = widgets.HBox([self.step_button, self.play, self.speed, self.reset_button])
        super().__init__([controls, self.html])
        self.add_class("kvlab-block-map-widget")
        self.reset()

    @property
    def done(self) -> bool:
        """Whether the engine has nothing left to run."""
        return self.last_snapshot is None or bool(self.last_snapshot.get("done"))

    def can_step(self) -> bool:
        """Whether Step would run: an engine exists, it has work left, and it has not raised."""
        return self.engine is not None and self.error is None and not self.done

    def snapshot(self) -> dict | None:
        """The snapshot currently drawn."""
        return self.last_snapshot

    def summary(self) -> str:
        """The counters as one line of text, e.g. `kvlab-block-map step=3 used=7 free=25 tokens=98`."""
        if self.last_snapshot is None:
            return f"kvlab-block-map no engine: {self.error}"
        c = _counters(self.last_snapshot)
        return (f"kvlab-block-map step={c['step']} used={c['used_blocks']} free={c['free_blocks']}"
                f" tokens={c['tokens_stored']}")

    def summary_text(self) -> str:
        """The current state in one or two plain lines: step, used and free blocks, each sequence's state."""
        return summary_text(self.last_snapshot, self.title, self.error)

    def static_html(self) -> str:
        """The current drawing with its text summary, for views without a live kernel."""
        return static_html(self.html.value, self.summary_text())

    def _repr_mimebundle_(self, **kwargs):
        # A live frontend draws the widget view; nbviewer, GitHub and exported HTML (no widget state)
        # fall back to these: the state when the widget was displayed, instead of nothing or a repr.
        data = super()._repr_mimebundle_(**kwargs)
        if data is not None:
            data["text/plain"] = self.summary_text()
            data["text/html"] = self.static_html()
        return data

    def step(self) -> list | None:
        """Run one engine step and redraw; returns the finished ids, or None when it did not run."""
        if not self.can_step():
            return None
        try:
            finished = self.engine.step()
        except Exception as exc:
            # The engine may be half-way through a step: freeze it until Reset rather than keep going.
            step = self.last_snapshot.get("step", "?")
            self.error = f"step {step} failed: {type(exc).__name__}: {exc}\nPress Reset to start over."
            finished = None
        self.refresh()
        return finished

    def reset(self) -> None:
        """Stop playing and rebuild the engine with the factory, back at step 0."""
        self._resetting = True
        try:
            self.play.playing = False
            self.play.value = 0
        finally:
            self._resetting = False
        self.error = None
        try:
            self.engine = self._make_engine()
        except Exception as exc:
            self.engine = None
            self.error = f"building the engine failed: {type(exc).__name__}: {exc}"
        self.refresh()

    def refresh(self) -> None:
        """Redraw from the engine's current state and enable only the controls that can act."""
        snap = None
        if self.engine is not None:
            try:
                snap = self.snapshot_fn(self.engine)
            except Exception as exc:
                self.error = self.error or f"reading the engine failed: {type(exc).__name__}: {exc}"
        self.last_snapshot = snap
        self.html.value = render_html(snap, self.decode, self.title, self.error, self.columns)
        runnable = self.can_step()
        self.step_button.disabled = not runnable
        self.play.disabled = not runnable
        if not runnable:
            self.play.playing = False

    def _on_play(self, change) -> None:
        # Play counts up in the browser; each increment is one step. Ignore the rewind done by reset.
        if self._resetting or change["new"] <= change["old"]:
            return
        self.step()
        if not self.can_step():
            self.play.playing = False
