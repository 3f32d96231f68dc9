"""Chapter 6's engine cache: Chapter 3's paged KV pools, with every decode of a step attended in one batch.

Chapter 3's `PagedKVCache.attend` loops over the sequences of a pass, gathering each one's blocks
and running attention on its own: clear, but a step of 16 decodes costs 16 small gathers and 16
small attentions per layer. Here the decodes (one new query each) are gathered together through
one index of their slots, padded to the longest sequence and masked, and attended in one batched
computation; prefill chunks keep Chapter 3's per-sequence path. On a CUDA device with Triton the
decodes go to Chapter 7's paged decode kernel instead, which reads the blocks in place.
"""

import os

import torch

from kvlab.cache.paged_cache import PagedKVCache, paged_attention

BACKENDS = ("auto", "torch", "triton")


class BatchedPagedKVCache(PagedKVCache):
    """PagedKVCache whose decodes are attended in one batch; decode_backend picks torch or the Triton kernel."""

    def __init__(self, *args, decode_backend: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self._init_backend(decode_backend)

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int, decode_backend: str = "auto"):
        """Pools sized for a transformers model, with the decode backend chosen for its device."""
        cache = super().for_model(model, num_blocks, block_size)  # cls(...) with the "auto" backend
        cache._init_backend(decode_backend)
        return cache

    def _init_backend(self, decode_backend: str) -> None:
        if decode_backend not in BACKENDS:
            raise ValueError(f"decode_backend must be one of {', '.join(BACKENDS)}, got {decode_backend!r}")
        device = self.k_pools[0].device
        if decode_backend == "auto":
            decode_backend = "triton" if device.type == "cuda" and _triton_available() else "torch"
        if decode_backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("decode_backend='triton' runs on a CUDA device, or on CPU in Triton's interpreter "
                             f"(TRITON_INTERPRET=1 before kvlab.kernels is imported); the pools are on {device.type}")
        self.decode_backend = decode_backend
        self._plan = None

    def set_batch(self, batch) -> None:
        super().set_batch(batch)
        self._plan = None  # built on the first layer's attend, reused by every other layer

    def _decode_plan(self):
        """Which sequences decode, their query rows, and their padded slot index [B, Lmax] with its mask."""
        batch, device = self.batch, self.k_pools[0].device
        rows, seqs, start = [], [], 0
        for i, q_len in enumerate(batch.query_lens):
            if q_len == 1:
                rows.append(start)
                seqs.append(i)
            start += q_len
        if not seqs:
            return None
        lens = [batch.context_lens[i] for i in seqs]
        size = self.block_size
        if self.decode_backend == "triton":
            width = max(len(batch.block_tables[i]) for i in seqs)
            tables = torch.zeros(len(seqs), width, dtype=torch.int32)
            for r, i in enumerate(seqs):
                tables[r, :len(batch.block_tables[i])] = torch.tensor(batch.block_tables[i], dtype=torch.int32)
            return {"rows": torch.tensor(rows, device=device), "seqs": seqs,
                    "block_tables": tables.to(device), "seq_lens": torch.tensor(lens, dtype=torch.int32, device=device)}
        longest = max(lens)
        positions = torch.arange(longest)
        index = torch.zeros(len(seqs), longest, dtype=torch.long)
        for r, i in enumerate(seqs):
            table = torch.tensor(batch.block_tables[i], dtype=torch.long)
            n = lens[r]
            index[r, :n] = table[positions[:n] // size] * size + positions[:n] % size
        mask = positions[None, :] >= torch.tensor(lens)[:, None]  # [B, Lmax]: padding past each sequence's end
        return {"rows": torch.tensor(rows, device=device), "seqs": seqs, "index": index.to(device),
                "mask": mask.to(device)}

    def attend(self, layer_idx, query, key, value, scaling):
        """The runner hook: write K/V by slot, attend decodes in one batch and prefill chunks one by one ([1, T, H, D])."""
        batch = self.batch
        if batch is None:
            raise RuntimeError("call set_batch(...) before running the model on a PagedKVCache")
        self.write(layer_idx, key[0].transpose(0, 1), value[0].transpose(0, 1), batch.slot_mapping)
        if self._plan is None:
            self._plan = self._decode_plan() or {}
        plan = self._plan
        k_pool, v_pool = self.k_pools[layer_idx], self.v_pools[layer_idx]
        q_all = query[0].transpose(0, 1)  # [T, H, D]
        out = torch.empty_like(q_all)
        decoding = set(plan.get("seqs", ()))
        start = 0
        for i, (q_len, seq_len, table) in enumerate(zip(batch.query_lens, batch.context_lens, batch.block_tables)):
            if i not in decoding:
                out[start:start + q_len] = paged_attention(query[0, :, start:start + q_len], k_pool, v_pool, table,
                                                           seq_len, scaling)
            start += q_len
        if plan:
            q = q_all[plan["rows"]]  # [B, H, D]
            if self.decode_backend == "triton":
                from kvlab.kernels import paged_attention_decode

                out[plan["rows"]] = paged_attention_decode(q, k_pool, v_pool, plan["block_tables"], plan["seq_lens"], scaling)
            else:
                out[plan["rows"]] = batched_decode_attention(q, k_pool, v_pool, plan["index"], plan["mask"], scaling)
        return out[None]


def batched_decode_attention(q, k_pool, v_pool, index, mask, scaling):
    """One query per sequence over its gathered slots: q [B, H, D], index/mask [B, L] -> [B, H, D].

    The pools are [num_blocks, block_size, Hkv, D]. One index_select per pool gathers every
    sequence's slots (padded to the longest, the padding masked), then torch's fused attention runs
    all sequences and heads at once, sharing each KV head between its query heads (GQA) without copies.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, length = k_pool.shape[2], index.shape[1]
    flat = index.reshape(-1)
    k = k_pool.view(-1, num_kv_heads, head_dim).index_select(0, flat).view(num_seqs, length, num_kv_heads, head_dim)
    v = v_pool.view(-1, num_kv_heads, head_dim).index_select(0, flat).view(num_seqs, length, num_kv_heads, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), attn_mask=~mask[:, None, None, :], scale=scaling,
        enable_gqa=num_heads != num_kv_heads)
    return out[:, :, 0]


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
