"""Chapter 6's engine cache: Chapter 3's paged KV pools, with every decode of a step attended in one batch.

Chapter 3's `PagedKVCache.attend` loops over the sequences of a pass, gathering each one's blocks
and running attention on its own: clear, but a step of 16 decodes costs 16 small gathers and 16
small attentions per layer. Here the decodes (one new query each) are gathered together through
one index of their slots, padded to the longest sequence and masked, and attended in one batched
computation; prefill chunks keep Chapter 3's per-sequence path. On a CUDA device with Triton the
whole step goes to Chapter 7's unified paged-attention kernel instead, prefill chunks and decodes in
one launch per layer, reading the blocks in place.

The backends themselves are in kvlab.cache.attention_backends and read any storage format, so
BatchedPagedKVCache(..., kv_cache_dtype="int8") decodes 8-bit pools the same two ways.
"""

from kvlab.cache.attention_backends import batched_decode_attention
from kvlab.cache.paged_cache import PagedKVCache

__all__ = ["BACKENDS", "BatchedPagedKVCache", "batched_decode_attention"]

BACKENDS = ("auto", "torch", "triton")


class BatchedPagedKVCache(PagedKVCache):
    """PagedKVCache whose decodes are attended in one batch; decode_backend picks torch or the Triton kernel."""

    def __init__(self, *args, decode_backend: str = "auto", **kwargs):
        if decode_backend not in BACKENDS:
            raise ValueError(f"decode_backend must be one of {', '.join(BACKENDS)}, got {decode_backend!r}")
        super().__init__(*args, decode_backend=decode_backend, **kwargs)

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int, decode_backend: str = "auto", **kwargs):
        """Pools sized for a transformers model, the decode backend chosen for its device (kwargs: kv_cache_dtype)."""
        return super().for_model(model, num_blocks, block_size, decode_backend=decode_backend, **kwargs)
