"""Live notebook widgets that draw the KV cache's state as an engine runs.

  Chapter 3  block_map: the physical block pool, each sequence's block table, Step / Play / Reset
"""

from .block_map import FREE_COLOUR, PALETTE, BlockMap, render_html, seq_colour, snapshot

__all__ = ["BlockMap", "snapshot", "render_html", "seq_colour", "PALETTE", "FREE_COLOUR"]
