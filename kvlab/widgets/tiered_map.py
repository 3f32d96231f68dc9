"""Chapter 12's tier map: which block hashes live in the GPU pool, the CPU tier and the disk tier.

The GPU prefix cache (kvlab.core.block_pool) and every offloading tier (kvlab.kv_offload's managers) name a full
block by the same chained hash, so one hash can live in several tiers at once: computed on the GPU, copied to
CPU memory, later evicted from the GPU pool and still findable in the CPU tier. `tiered_snapshot` reads the tiers
as plain data and `render_tiered_html` draws each prompt's block-hash chain as a row of cells, one letter per
tier that holds the block (G, C, D), as static HTML that a saved notebook shows without a kernel:

    {"step": 3,
     "tiers": [{"name": "GPU", "capacity": 8, "blocks": [{"hash": "9f3a...", "block_id": 5, "ref_count": 1,
                                                          "ready": True}, ...]},
               {"name": "CPU", "capacity": 64, "blocks": [...]}, ...],
     "chains": [{"label": "a", "hashes": ["9f3a...", ...]}, ...]}

Hashes are hex strings. A GPU block is listed while it is cached (held or free-but-findable); a tier's block while
its manager holds it (ready, being stored, or pinned by a load).
"""

import html

from kvlab.widgets.block_map import FREE_COLOUR

TIER_COLOURS = {"GPU": "#009E73", "CPU": "#0072B2", "disk": "#D55E00"}
LETTERS = {"GPU": "G", "CPU": "C", "disk": "D"}
CELL_PX = 34


def _hex(block_hash) -> str:
    return block_hash.hex() if isinstance(block_hash, (bytes, bytearray)) else str(block_hash)


def _gpu_tier(pool) -> dict:
    if not hasattr(pool, "blocks") or not hasattr(pool, "num_blocks"):
        raise TypeError(f"tiered_snapshot's gpu_pool must be a kvlab BlockPool (blocks, num_blocks); got "
                        f"{type(pool).__name__}")
    blocks = [{"hash": _hex(b.block_hash), "block_id": b.block_id, "ref_count": b.ref_cnt, "ready": True}
              for b in pool.blocks if b.block_hash is not None]
    return {"name": "GPU", "capacity": pool.num_blocks, "blocks": blocks}


def _offload_tier(name: str, manager) -> dict:
    if not hasattr(manager, "held_blocks"):
        raise TypeError(f"tiered_snapshot's {name} tier must be an offloading manager with held_blocks() "
                        f"(kvlab.kv_offload's LRU or ARC); got {type(manager).__name__}")
    blocks = [{"hash": _hex(h), "block_id": s.block_id, "ref_count": s.ref_cnt, "ready": bool(s.is_ready)}
              for h, s in manager.held_blocks()]
    backend = getattr(manager, "backend", None)
    return {"name": name, "capacity": getattr(backend, "num_blocks", None), "blocks": blocks}


def tiered_snapshot(gpu_pool, cpu=None, disk=None, chains: dict | None = None, step: int = 0) -> dict:
    """The tiers' held block hashes, and each named chain of block hashes (a prompt's, first block first)."""
    tiers = [_gpu_tier(gpu_pool)]
    for name, manager in (("CPU", cpu), ("disk", disk)):
        if manager is not None:
            tiers.append(_offload_tier(name, manager))
    rows = []
    for label, hashes in (chains or {}).items():
        if isinstance(hashes, (str, bytes)) or not hasattr(hashes, "__iter__"):
            raise ValueError(f"chains[{label!r}] must be a list of block hashes, got {type(hashes).__name__}")
        rows.append({"label": str(label), "hashes": [_hex(h) for h in hashes]})
    return {"step": int(step), "tiers": tiers, "chains": rows}


def _esc(value) -> str:
    return html.escape(str(value), quote=True)


def _cell_html(label: str, index: int, holders: list[tuple[str, dict]]) -> str:
    base = (f"display:inline-block;box-sizing:border-box;width:{CELL_PX}px;height:22px;margin:1px;"
            f"border-radius:3px;font:10px/20px monospace;text-align:center;vertical-align:top;")
    names = [name for name, _ in holders]
    if not holders:
        style, text, hover = f"background:{FREE_COLOUR};color:#999;border:1px dashed #aaa;", "–", "in no tier: " \
            "a request with this prefix recomputes it"
    else:
        colours = [TIER_COLOURS.get(n, "#777") for n in names]
        background = colours[0] if len(colours) == 1 else \
            "linear-gradient(180deg, " + ", ".join(f"{c}99 {i * 100 // len(colours)}% {(i + 1) * 100 // len(colours)}%"
                                                   for i, c in enumerate(colours)) + ")"
        pending = [n for n, b in holders if not b["ready"]]
        pinned = [n for n, b in holders if n != "GPU" and b["ref_count"] > 0]
        border = "2px dotted #333" if pending else "2px solid #333" if pinned else "1px solid #555"
        style = f"background:{background};border:{border};color:#000;"
        text = "".join(LETTERS.get(n, n[0].upper()) for n in names)
        hover = "; ".join(f"{n} block {b['block_id']}" + ("" if b["ready"] else " (being stored)")
                          + (f", ref count {b['ref_count']}" if b["ref_count"] else "") for n, b in holders)
    hover = f"block {index} of {label}: {hover}"
    return (f'<span class="kvlab-tier-cell" data-chain="{_esc(label)}" data-index="{index}" '
            f'data-tiers="{_esc(" ".join(names))}" title="{_esc(hover)}" style="{base}{style}">{_esc(text)}</span>')


def render_tiered_html(snap: dict, title: str | None = None) -> str:
    """Static HTML of a tiered_snapshot: a row per chain, each block lettered by the tiers that hold it."""
    for field in ("tiers", "chains"):
        if field not in snap:
            raise ValueError(f"snap has no {field!r}: pass the dictionary tiered_snapshot returns")
    by_hash: dict[str, list[tuple[str, dict]]] = {}
    for tier in snap["tiers"]:
        for block in tier["blocks"]:
            by_hash.setdefault(block["hash"], []).append((tier["name"], block))
    in_chains = {h for chain in snap["chains"] for h in chain["hashes"]}
    rows = []
    for chain in snap["chains"]:
        cells = "".join(_cell_html(chain["label"], i, by_hash.get(h, [])) for i, h in enumerate(chain["hashes"]))
        rows.append(f'<tr class="kvlab-tier-chain" data-chain="{_esc(chain["label"])}"><td style="padding:2px 8px;'
                    f'white-space:nowrap">{_esc(chain["label"])}</td><td style="padding:2px 8px">{cells}</td></tr>')
    summary = []
    for tier in snap["tiers"]:
        held, outside = len(tier["blocks"]), sum(b["hash"] not in in_chains for b in tier["blocks"])
        capacity = f" of {tier['capacity']}" if tier["capacity"] is not None else ""
        colour = TIER_COLOURS.get(tier["name"], "#777")
        summary.append(f'<span class="kvlab-tier" data-tier="{_esc(tier["name"])}" data-held="{held}" '
                       f'style="margin-right:14px"><span style="display:inline-block;width:10px;height:10px;'
                       f'background:{colour}99;border:1px solid #555"></span> '
                       f'{_esc(LETTERS.get(tier["name"], tier["name"][0]))} = {_esc(tier["name"])}: {held}'
                       f'{_esc(capacity)} blocks hold a hash ({outside} outside these rows)</span>')
    heading = f'<div style="font-weight:bold">{_esc(title)}</div>' if title else ""
    legend = ("a cell is one full block of the row's prompt, lettered by every tier that holds its hash; – : in no "
              "tier; dotted border: still being stored; thick border: pinned by a load in flight")
    return (f'<div class="kvlab-tier-map" style="font:12px sans-serif">{heading}'
            f'<div class="kvlab-tier-summary">step {snap.get("step", 0)}: {"".join(summary)}</div>'
            f'<table style="border-collapse:collapse;margin:4px 0">{"".join(rows)}</table>'
            f'<div style="color:#555">{_esc(legend)}</div></div>')
