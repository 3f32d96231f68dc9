"""Live notebook widgets that draw the KV cache's state as an engine runs.

  Chapter 3  block_map: the physical block pool, each sequence's block table, Step / Play / Reset
  Chapter 6  timeline: each request's state at every engine step, beside the block map
  Chapter 11 hybrid_map: a hybrid model's block tables, one per KV-cache group, over one shared pool
  Chapter 12 tiered_map: which block hashes the GPU pool, the CPU tier and the disk tier hold
"""

from .block_map import FREE_COLOUR, PALETTE, BlockMap, render_html, seq_colour, snapshot
from .hybrid_map import hybrid_snapshot, render_hybrid_html
from .tiered_map import render_tiered_html, tiered_snapshot
from .timeline import Timeline, render_timeline_html

__all__ = ["BlockMap", "Timeline", "snapshot", "render_html", "render_timeline_html", "seq_colour", "PALETTE",
           "FREE_COLOUR", "hybrid_snapshot", "render_hybrid_html", "tiered_snapshot", "render_tiered_html"]
