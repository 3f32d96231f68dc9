"""The chapters' own decoding loops: greedy on one cache, several sequences on a paged pool, prefix sharing,
beams, n samples."""
