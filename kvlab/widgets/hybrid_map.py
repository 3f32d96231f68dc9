"""Chapter 11's block map of a hybrid model: every KV-cache group's block tables side by side over one shared pool.

A HybridKVCacheCoordinator (kvlab.core.kv_cache_coordinator) gives each request one block table per group. A
sliding-window group puts the pool's null block (block 0) in the entries its window has left, so its row
shows holes where the full-attention row still holds blocks. `hybrid_snapshot(coordinator)` turns the
coordinator into plain data and `render_hybrid_html(snap)` draws it as static HTML (colours per request, as
in Chapter 3's block map), which a saved notebook shows without a kernel:

    {"step": 2, "num_blocks": 24, "null_block": 0,
     "groups": [{"id": 0, "kind": "full", "block_size": 4, "window": None, "layers": [0, 1]}, ...],
     "requests": [{"id": "a", "num_tokens": 21, "tables": [[3, 4, ...], [0, 0, 9, ...]]}, ...],
     "blocks": [{"id": 3, "owners": [["a", 0]], "ref_count": 1, "cached": False}, ...],   # every pool block
     "counters": {"used_blocks": 12, "free_blocks": 11, "freed_entries": 4}}

A block id in an entry is a page in every layer of that entry's group; `owners` lists (request, group) pairs.
"""

import html

from kvlab.widgets.block_map import FREE_COLOUR, seq_colour

NULL_COLOUR = "#444"
CELL_PX = 30


def _kind(spec) -> tuple[str, int | None]:
    # Read by field, not by class: widgets import nothing of the package but the block views (kvlab.core's specs
    # name their window sliding_window and their chunk attention_chunk_size).
    if getattr(spec, "sliding_window", None):
        return "sliding", spec.sliding_window
    if getattr(spec, "attention_chunk_size", None):
        return "chunked", spec.attention_chunk_size
    return "full", None


def hybrid_snapshot(coordinator, step: int = 0) -> dict:
    """The coordinator's groups, each running request's table per group and every pool block, as plain data."""
    for field in ("kv_cache_groups", "managers", "block_pool", "null_block", "num_tokens"):
        if not hasattr(coordinator, field):
            raise TypeError(f"hybrid_snapshot needs a HybridKVCacheCoordinator; {type(coordinator).__name__} has "
                            f"no {field!r}")
    null_id = coordinator.null_block.block_id
    groups = []
    for i, group in enumerate(coordinator.kv_cache_groups):
        kind, window = _kind(group.kv_cache_spec)
        groups.append({"id": i, "kind": kind, "block_size": group.kv_cache_spec.block_size, "window": window,
                       "layers": list(group.layer_ids)})
    pool = coordinator.block_pool
    owners: dict[int, list] = {}
    requests = []
    for rid, num_tokens in coordinator.num_tokens.items():
        tables = [list(t) for t in coordinator.get_block_ids(rid)]
        for g, table in enumerate(tables):
            for block_id in table:
                if block_id != null_id:
                    owners.setdefault(block_id, []).append([rid, g])
        requests.append({"id": rid, "num_tokens": num_tokens, "tables": tables})
    blocks = [{"id": b.block_id, "owners": owners.get(b.block_id, []), "ref_count": b.ref_cnt,
               "cached": b.block_hash is not None} for b in pool.blocks]
    freed = sum(t.count(null_id) for r in requests for t in r["tables"])
    return {"step": int(step), "num_blocks": pool.num_blocks, "null_block": null_id, "groups": groups,
            "requests": requests, "blocks": blocks,
            "counters": {"used_blocks": pool.num_used_blocks - 1, "free_blocks": pool.num_free_blocks,
                         "freed_entries": freed}}


def _esc(value) -> str:
    return html.escape(str(value), quote=True)


def _group_label(group: dict) -> str:
    extra = f", window {group['window']}" if group["kind"] == "sliding" else \
        f", chunk {group['window']}" if group["kind"] == "chunked" else ""
    return f"group {group['id']}: {group['kind']}{extra}, layers {group['layers']}"


def _entry_html(rid, group_id: int, logical: int, block_id: int, null_id: int) -> str:
    base = (f"display:inline-block;box-sizing:border-box;width:{CELL_PX}px;height:18px;margin:1px;"
            f"border-radius:3px;font:10px/16px monospace;text-align:center;")
    if block_id == null_id:
        hover = f"logical block {logical}: freed (left the window); the table holds the null block {null_id}"
        return (f'<span class="kvlab-entry" data-req="{_esc(rid)}" data-group="{group_id}" data-logical="{logical}" '
                f'data-block="{block_id}" data-freed="1" title="{_esc(hover)}" style="{base}color:#999;'
                f'border:1px dashed #999;background:{FREE_COLOUR}">·</span>')
    colour = seq_colour(rid)
    hover = f"logical block {logical} → physical block {block_id} (group {group_id})"
    return (f'<span class="kvlab-entry" data-req="{_esc(rid)}" data-group="{group_id}" data-logical="{logical}" '
            f'data-block="{block_id}" data-freed="0" title="{_esc(hover)}" style="{base}'
            f'border:1px solid {colour};background:{colour}66">{block_id}</span>')


def _pool_block_html(block: dict, null_id: int) -> str:
    base = (f"display:inline-block;box-sizing:border-box;width:{CELL_PX}px;height:{CELL_PX}px;margin:1px;"
            f"border-radius:4px;font:10px/1.2 monospace;text-align:center;vertical-align:top;")
    owners = block["owners"]
    if block["id"] == null_id:
        style, label, hover = f"background:{NULL_COLOUR};color:#fff;", "null", "the null block: never handed out"
    elif owners:
        colours = [seq_colour(rid) for rid, _ in owners]
        background = colours[0] if len(set(colours)) == 1 else \
            "linear-gradient(90deg, " + ", ".join(colours) + ")"
        style = f"background:{background};border:1px solid #555;"
        label = f"g{owners[0][1]}" + ("+" if len(owners) > 1 else "")
        hover = "held by " + ", ".join(f"request {rid} in group {g}" for rid, g in owners)
    else:
        cached = block["cached"]
        style = (f"background:repeating-linear-gradient(45deg, {FREE_COLOUR} 0 4px, #d0d0d0 4px 6px);"
                 f"border:1px dashed #777;" if cached else f"background:{FREE_COLOUR};border:1px solid #c4c4c4;")
        label, hover = "", "free, cached (findable by hash)" if cached else "free"
    hover = f"physical block {block['id']}: {hover}; ref count {block['ref_count']}"
    owner_ids = " ".join(f"{rid}:{g}" for rid, g in owners)
    return (f'<span class="kvlab-pool-block" data-block="{block["id"]}" data-owners="{_esc(owner_ids)}" '
            f'data-cached="{int(bool(block["cached"]))}" title="{_esc(hover)}" style="{base}{style}">'
            f'{block["id"]}<br>{_esc(label)}</span>')


def render_hybrid_html(snap: dict, title: str | None = None) -> str:
    """Static HTML of a hybrid_snapshot: one row per request with a column per group, then the shared pool."""
    for field in ("groups", "requests", "blocks", "null_block"):
        if field not in snap:
            raise ValueError(f"snap has no {field!r}: pass the dictionary hybrid_snapshot returns")
    null_id = snap["null_block"]
    groups = snap["groups"]
    head = "".join(f'<th class="kvlab-group" data-group="{g["id"]}" style="text-align:left;padding:2px 8px">'
                   f'{_esc(_group_label(g))}</th>' for g in groups)
    rows = []
    for request in snap["requests"]:
        colour = seq_colour(request["id"])
        cells = "".join(
            '<td style="padding:2px 8px;vertical-align:top">'
            + "".join(_entry_html(request["id"], g, i, b, null_id) for i, b in enumerate(table)) + "</td>"
            for g, table in enumerate(request["tables"]))
        rows.append(f'<tr class="kvlab-hybrid-req" data-req="{_esc(request["id"])}">'
                    f'<td style="padding:2px 8px;white-space:nowrap"><span style="display:inline-block;width:10px;'
                    f'height:10px;background:{colour};border-radius:2px"></span> {_esc(request["id"])} '
                    f'({request["num_tokens"]} tokens)</td>{cells}</tr>')
    counters = snap.get("counters", {})
    summary = (f"step {snap.get('step', 0)}: {counters.get('used_blocks', '?')} blocks in use, "
               f"{counters.get('free_blocks', '?')} free, {counters.get('freed_entries', '?')} table entries freed "
               f"by a window (null block {null_id})")
    pool = "".join(_pool_block_html(b, null_id) for b in snap["blocks"])
    heading = f'<div style="font-weight:bold">{_esc(title)}</div>' if title else ""
    return (f'<div class="kvlab-hybrid-map" style="font:12px sans-serif">{heading}'
            f'<div class="kvlab-hybrid-summary">{_esc(summary)}</div>'
            f'<table style="border-collapse:collapse;margin:4px 0"><tr><th style="text-align:left;padding:2px 8px">'
            f'request</th>{head}</tr>{"".join(rows)}</table>'
            f'<div style="margin-top:4px">shared pool (gN: held by group N; · in a table: freed, the null block):'
            f'</div><div class="kvlab-hybrid-pool" style="max-width:{34 * CELL_PX}px">{pool}</div></div>')
