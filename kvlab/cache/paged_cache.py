"""Chapter 3's paged KV store: per layer a K pool and a V pool of fixed-size blocks, written by slot.

As the runner hook it serves a ragged batch: the T tokens of one forward pass belong to several
sequences (one prefill chunk or one decode token each). Before the pass, `set_batch` says which
sequence owns which tokens; `attend` writes every token's K/V through the slot mapping, then each
sequence's queries attend over its blocks, gathered through its block table.
"""

import torch

from kvlab.cache.attention import causal_attention
from kvlab.cache.ragged_batch import BatchLayout


def gather_kv(pool: torch.Tensor, block_table: list[int], seq_len: int) -> torch.Tensor:
    """One sequence's keys (or values) from its blocks: pool [num_blocks, block_size, Hkv, D] -> [Hkv, seq_len, D]."""
    blocks = pool[torch.as_tensor(block_table, dtype=torch.long, device=pool.device)]  # [n, block_size, Hkv, D]
    return blocks.flatten(0, 1)[:seq_len].transpose(0, 1)


def paged_attention(q, k_pool, v_pool, block_table, seq_len, scaling):
    """Reference paged attention: gather the sequence through its block table, then causal attention.

    q: [H, T_new, D] for the last T_new positions of a sequence of seq_len tokens. Returns [T_new, H, D].
    """
    return causal_attention(q, gather_kv(k_pool, block_table, seq_len), gather_kv(v_pool, block_table, seq_len), scaling)


class PagedKVCache:
    """K and V pools for every layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32, device="cpu"):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.batch: BatchLayout | None = None

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int):
        """Pools sized for a transformers model's layers, KV heads, head dim, dtype and device."""
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, head_dim,
                   dtype=model.dtype, device=model.device)

    @property
    def num_slots(self) -> int:
        """Token slots in each pool."""
        return self.num_blocks * self.block_size

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store new k, v [T, Hkv, D] at their slots of layer layer_idx's pools."""
        slot_mapping = torch.as_tensor(slot_mapping, dtype=torch.long, device=k.device)
        if slot_mapping.shape != (k.shape[0],):
            raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}; expected ({k.shape[0]},), one slot per token")
        if slot_mapping.numel() and (int(slot_mapping.min()) < 0 or int(slot_mapping.max()) >= self.num_slots):
            bad = slot_mapping[(slot_mapping < 0) | (slot_mapping >= self.num_slots)][0]
            raise ValueError(f"slot {int(bad)} is outside the pool of {self.num_slots} slots ({self.num_blocks} blocks of {self.block_size})")
        self.k_pools[layer_idx].view(self.num_slots, *k.shape[1:])[slot_mapping] = k
        self.v_pools[layer_idx].view(self.num_slots, *v.shape[1:])[slot_mapping] = v

    def set_batch(self, batch: BatchLayout) -> None:
        """Describe the next forward pass's tokens (checked against the pool before anything is written)."""
        if sum(batch.query_lens) != len(batch.slot_mapping):
            raise ValueError(f"{sum(batch.query_lens)} new tokens but {len(batch.slot_mapping)} slots")
        for table, length in zip(batch.block_tables, batch.context_lens):
            if len(table) * self.block_size < length:
                raise ValueError(f"a block table of {len(table)} blocks cannot hold {length} tokens")
            if any(not 0 <= b < self.num_blocks for b in table):
                raise ValueError(f"block table {table} names a block outside the pool of {self.num_blocks}")
        self.batch = batch

    def attend(self, layer_idx, query, key, value, scaling):
        """The runner hook: write this pass's K/V by slot, then each sequence attends over its blocks ([1, T, H, D])."""
        batch = self.batch
        if batch is None:
            raise RuntimeError("call set_batch(...) before running the model on a PagedKVCache")
        self.write(layer_idx, key[0].transpose(0, 1), value[0].transpose(0, 1), batch.slot_mapping)
        outs, start = [], 0
        for q_len, seq_len, table in zip(batch.query_lens, batch.context_lens, batch.block_tables):
            q = query[0, :, start:start + q_len]
            outs.append(paged_attention(q, self.k_pools[layer_idx], self.v_pools[layer_idx], table, seq_len, scaling))
            start += q_len
        return torch.cat(outs, dim=0)[None]


def copy_blocks(cache, copies) -> None:
    """Copy the K and V of block src into block dst, for every (src, dst) in copies and every layer of `cache`."""
    copies = [(int(s), int(d)) for s, d in copies]
    if not copies:
        return
    for s, d in copies:
        if not (0 <= s < cache.num_blocks and 0 <= d < cache.num_blocks):
            raise ValueError(f"copy {s} -> {d} names a block outside the pool of {cache.num_blocks}")
        if s == d:
            raise ValueError(f"copy {s} -> {d}: a block cannot be copied onto itself")
    dsts = [d for _, d in copies]
    if len(set(dsts)) != len(dsts):
        raise ValueError(f"two copies write the same block: {copies}")
    if set(dsts) & {s for s, _ in copies}:
        raise ValueError(f"a block is both copied from and written in {copies}")
    device = cache.k_pools[0].device
    src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
    dst = torch.tensor(dsts, dtype=torch.long, device=device)
    # A quantized cache keeps a scale per (block, head) beside each pool: the copy must carry it too.
    for pools in (cache.k_pools, cache.v_pools, getattr(cache, "k_scales", []), getattr(cache, "v_scales", [])):
        for pool in pools:
            pool[dst] = pool[src]
