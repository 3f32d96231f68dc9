"""Block bookkeeping in plain Python, no tensors (vLLM's v1/core): block tables, the block pool, prefix hashing, fork."""
