"""Live notebook widgets that draw the KV cache's state as an engine runs.

  Chapter 3  block_map: the physical block pool, each sequence's block table, Step / Play / Reset
  Chapter 6  timeline: each request's state at every engine step, beside the block map
"""

from .block_map import FREE_COLOUR, PALETTE, BlockMap, render_html, seq_colour, snapshot
from .timeline import Timeline, render_timeline_html

__all__ = ["BlockMap", "Timeline", "snapshot", "render_html", "render_timeline_html", "seq_colour", "PALETTE",
           "FREE_COLOUR"]
