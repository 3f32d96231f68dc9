"""Chapters 3-6: the block map's plain data, computed from block views without drawing anything.

A block view is a dict per physical block (`id`, `owner` or `owners`, `fill`, ...; the format is
documented in kvlab.widgets.block_map). Engines build views and counters here; widgets only draw them.
"""


def pool_block_view(block, block_size: int, hit_blocks=frozenset()) -> dict:
    """A pool block's view before its owners are filled in: a free block with a hash is cached and shown full."""
    cached = block.block_hash is not None and block.ref_cnt == 0
    view = {"id": block.block_id, "owner": None, "owners": [], "fill": block_size if cached else 0,
            "logical": None, "ref_count": block.ref_cnt, "cached": cached}
    if block.block_id in hit_blocks:
        view["hit"] = True
    return view


def block_owners(block: dict) -> list:
    """Every sequence whose block table holds this block view (one `owner` or a shared `owners` list)."""
    owners = block.get("owners")
    if owners:
        return list(owners)
    return [] if block.get("owner") is None else [block["owner"]]


def counters_for(blocks: list[dict], block_size: int, step: int) -> dict:
    """The counters line for a list of block views: used/free blocks, tokens, slot use."""
    used = [b for b in blocks if block_owners(b)]
    tokens = sum(b.get("fill", 0) for b in used)
    slots = len(used) * block_size
    return {
        "step": step,
        "num_blocks": len(blocks),
        "used_blocks": len(used),
        "free_blocks": len(blocks) - len(used),
        "tokens_stored": tokens,
        "slot_utilization": tokens / slots if slots else 0.0,
    }
