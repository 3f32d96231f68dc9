"""Chapter 3's block-size sweep, the cost side: what one decoded token pays to read its context through a block table.

Small blocks waste little memory (the unfilled end of a sequence's last block), but every block is one
block-table entry to read and one separate piece of K/V to fetch. For a sequence of L tokens at block
size b, one decoded token's attention reads ceil(L / b) table entries per layer and gathers as many
scattered pieces of K and V. This module counts the one and times the other on kvlab's own decode paths,
over pools whose blocks are shuffled so that no sequence's blocks sit in order:

    "gather"      Chapter 3's gather alone (kvlab.cache.paged_cache.gather_kv), K and V of each sequence
    "reference"   Chapter 3's paged attention, sequence by sequence: gather, then causal attention
    "torch"       Chapter 6's batched torch decode (kvlab.cache.attention_backends.TorchBackend):
                  the block tables are turned into one token-level slot index per step (its metadata), then
                  one index_select and one fused attention for the whole batch, per layer

Times are per decoded token and per layer (a step's time divided by the sequences in it), the median of
several repeats, with the block sizes interleaved within each repeat so that a burst of load on a shared
machine touches all of them alike.
"""

import statistics
import time
from dataclasses import dataclass

import torch

from kvlab.cache.attention_backends import TorchBackend
from kvlab.cache.kv_storage import make_kv_storage
from kvlab.cache.paged_cache import gather_kv, paged_attention
from kvlab.cache.ragged_batch import BatchLayout
from kvlab.core.paging import BlockManager, num_blocks_needed

__all__ = ["DECODE_PATHS", "SWEEP_BLOCK_SIZES", "ShuffledBatch", "block_table_reads", "decode_step",
           "shuffled_batch", "time_decode_paths"]

SWEEP_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_PATHS = ("gather", "reference", "torch")


def block_table_reads(context_len: int, block_size: int) -> int:
    """Block-table entries one decoded token's attention reads (per layer) for a sequence of context_len tokens.

    Counted, not computed: a BlockManager grows one sequence to context_len tokens and the length of
    its block table is what a decode step walks (ceil(context_len / block_size)).
    """
    manager = BlockManager(num_blocks=num_blocks_needed(context_len, block_size), block_size=block_size)
    manager.allocate_slots("seq", context_len)
    return len(manager.block_tables["seq"])


@dataclass
class ShuffledBatch:
    """num_seqs sequences of context_len tokens each, their blocks shuffled across one layer's pools."""

    storage: object                 # kvlab.cache.kv_storage.KVStorage with one layer
    block_tables: list[list[int]]
    context_len: int
    block_size: int
    queries: torch.Tensor           # [num_seqs, num_heads, head_dim]: each sequence's one new query

    @property
    def num_seqs(self) -> int:
        return len(self.block_tables)

    def layout(self) -> BatchLayout:
        """The decode step as the cache sees it: one new token per sequence, at the last slot of its context."""
        last = [table[(self.context_len - 1) // self.block_size] * self.block_size
                + (self.context_len - 1) % self.block_size for table in self.block_tables]
        return BatchLayout(query_lens=[1] * self.num_seqs, context_lens=[self.context_len] * self.num_seqs,
                           block_tables=self.block_tables, slot_mapping=torch.tensor(last, dtype=torch.long))


def shuffled_batch(num_seqs: int, context_len: int, block_size: int, num_heads: int = 4, num_kv_heads: int = 4,
                   head_dim: int = 64, seed: int = 0, dtype: torch.dtype = torch.float32) -> ShuffledBatch:
    """Random K/V for num_seqs sequences of context_len tokens, in exactly the blocks they need, in shuffled order."""
    if num_seqs < 1 or context_len < 1:
        raise ValueError(f"need at least one sequence and one token, got {num_seqs} and {context_len}")
    per_seq = num_blocks_needed(context_len, block_size)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_seqs * per_seq, generator=g).tolist()
    tables = [order[i * per_seq:(i + 1) * per_seq] for i in range(num_seqs)]
    storage = make_kv_storage("auto", 1, num_seqs * per_seq, block_size, num_kv_heads, head_dim, dtype, "cpu")
    storage.k_pools[0].copy_(torch.randn(storage.k_pools[0].shape, generator=g))
    storage.v_pools[0].copy_(torch.randn(storage.v_pools[0].shape, generator=g))
    queries = torch.randn(num_seqs, num_heads, head_dim, generator=g).to(dtype)
    return ShuffledBatch(storage, tables, context_len, block_size, queries)


def decode_step(batch: ShuffledBatch, path: str, metadata=None):
    """One layer's decode step of every sequence in batch along path; "gather" returns the K/V, the others [B, H, D].

    metadata: the torch backend's metadata for this batch (built here when None), so that a timing loop can
    build it once per step as the engine does and reuse it.
    """
    pool_k, pool_v = batch.storage.k_pools[0], batch.storage.v_pools[0]
    scaling = batch.queries.shape[-1] ** -0.5
    if path == "gather":
        return [(gather_kv(pool_k, table, batch.context_len), gather_kv(pool_v, table, batch.context_len))
                for table in batch.block_tables]
    if path == "reference":
        return torch.stack([paged_attention(q[:, None], pool_k, pool_v, table, batch.context_len, scaling)[0]
                            for q, table in zip(batch.queries, batch.block_tables)])
    if path == "torch":
        backend = TorchBackend()
        if metadata is None:
            metadata = backend.build_metadata(batch.layout(), batch.block_size, "cpu")
        return backend.decode(batch.storage, 0, batch.queries, metadata, scaling)
    raise ValueError(f"path must be one of {', '.join(DECODE_PATHS)}, got {path!r}")


def time_decode_paths(block_sizes=SWEEP_BLOCK_SIZES, paths=DECODE_PATHS, num_seqs: int = 8, context_len: int = 1024,
                      num_heads: int = 4, num_kv_heads: int = 4, head_dim: int = 64, repeats: int = 5,
                      threads: int | None = 1, seed: int = 0) -> dict[str, dict[int, float]]:
    """Median seconds per decoded token (one layer) of each path at each block size: {path: {block_size: s}}.

    Every block size gets the same tokens' worth of K/V, scattered over shuffled blocks. threads: torch's
    intra-op threads while timing (1 by default: steadier on a shared machine), restored afterwards.
    """
    unknown = [p for p in paths if p not in DECODE_PATHS]
    if unknown or repeats < 1:
        raise ValueError(f"paths must be among {', '.join(DECODE_PATHS)} and repeats >= 1, got {paths}, {repeats}")
    batches = {b: shuffled_batch(num_seqs, context_len, b, num_heads, num_kv_heads, head_dim, seed)
               for b in block_sizes}
    metadata = {b: TorchBackend().build_metadata(batches[b].layout(), b, "cpu") for b in block_sizes}
    samples = {p: {b: [] for b in block_sizes} for p in paths}
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for b in block_sizes:  # warm-up: first calls pay for allocations
                for p in paths:
                    decode_step(batches[b], p, metadata[b])
            for _ in range(repeats):
                for b in block_sizes:
                    for p in paths:
                        start = time.perf_counter()
                        decode_step(batches[b], p, metadata[b])
                        samples[p][b].append((time.perf_counter() - start) / num_seqs)
    finally:
        torch.set_num_threads(previous)
    return {p: {b: statistics.median(samples[p][b]) for b in block_sizes} for p in paths}
