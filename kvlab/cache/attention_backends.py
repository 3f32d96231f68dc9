"""How a paged cache's queries attend over its storage: the decode backends, any of which reads any storage format.

    "reference"   Chapter 3: each sequence of the pass gathers its blocks through its block table
                  and runs causal attention on its own
    "torch"       Chapter 6: the decodes of a pass (one new query each) are gathered together through
                  one index of their slots, padded to the longest and masked, and attended in one
                  batched computation; prefill chunks take the reference path
    "triton"      Chapter 7: the whole pass (prefill chunks, prefix hits and decodes) goes to the unified
                  Triton paged-attention kernel in one launch per layer, which reads the blocks in place
                  (8-bit pools with their k_scale / v_scale): no gather at all
    "auto"        "triton" on a CUDA device with Triton installed, "torch" elsewhere

A backend reads K/V only through the storage (kvlab.cache.kv_storage): real numbers for the torch
paths, the raw pools and scales for the kernel. `plan` is built once per forward pass, from its
BatchLayout, and reused by every layer.
"""

import os

import torch

from kvlab.cache.attention import causal_attention

DECODE_BACKENDS = ("auto", "reference", "torch", "triton")


def attend_sequence(storage, layer_idx: int, q: torch.Tensor, block_table: list[int], seq_len: int, scaling: float):
    """One sequence's new queries q [H, T_new, D] over its seq_len tokens in storage -> [T_new, H, D]."""
    k, v = storage.gather(layer_idx, block_table, seq_len, q.dtype)
    return causal_attention(q, k, v, scaling)


class ReferenceBackend:
    """Chapter 3's path: one gather and one causal attention per sequence of the pass."""

    name = "reference"

    def plan(self, batch, block_size: int, device):
        return None

    def attend(self, storage, layer_idx, query, batch, plan, scaling) -> torch.Tensor:
        """Every sequence's queries (query [1, H, T, D]) over its blocks -> [T, H, D]."""
        outs, start = [], 0
        for q_len, seq_len, table in zip(batch.query_lens, batch.context_lens, batch.block_tables):
            outs.append(attend_sequence(storage, layer_idx, query[0, :, start:start + q_len], table, seq_len, scaling))
            start += q_len
        return torch.cat(outs, dim=0)


class _BatchedDecodeBackend:
    """Decodes (one new query) attended together by `decode`; prefill chunks one by one, as the reference does."""

    name = ""

    def plan(self, batch, block_size: int, device):
        """Which sequences decode and their query rows, plus what `decode` needs; None when none decodes."""
        rows, seqs, start = [], [], 0
        for i, q_len in enumerate(batch.query_lens):
            if q_len == 1:
                rows.append(start)
                seqs.append(i)
            start += q_len
        if not seqs:
            return None
        return {"rows": torch.tensor(rows, device=device), "seqs": seqs,
                **self._decode_plan(batch, seqs, block_size, device)}

    def attend(self, storage, layer_idx, query, batch, plan, scaling) -> torch.Tensor:
        """Every sequence's queries (query [1, H, T, D]) over its blocks -> [T, H, D]."""
        q_all = query[0].transpose(0, 1)  # [T, H, D]
        out = torch.empty_like(q_all)
        decoding = set(plan["seqs"]) if plan else set()
        start = 0
        for i, (q_len, seq_len, table) in enumerate(zip(batch.query_lens, batch.context_lens, batch.block_tables)):
            if i not in decoding:
                out[start:start + q_len] = attend_sequence(storage, layer_idx, query[0, :, start:start + q_len], table,
                                                           seq_len, scaling)
            start += q_len
        if plan:
            out[plan["rows"]] = self.decode(storage, layer_idx, q_all[plan["rows"]], plan, scaling)
        return out

    def _decode_plan(self, batch, seqs: list[int], block_size: int, device) -> dict:
        raise NotImplementedError

    def decode(self, storage, layer_idx, q, plan, scaling) -> torch.Tensor:
        raise NotImplementedError


class TorchBatchedBackend(_BatchedDecodeBackend):
    """Chapter 6's batched torch decode: one slot gather for all decodes, then fused attention over them."""

    name = "torch"

    def _decode_plan(self, batch, seqs, block_size, device) -> dict:
        """Each decode's slots, padded to the longest: index [B, Lmax] and its padding mask."""
        lens = [batch.context_lens[i] for i in seqs]
        positions = torch.arange(max(lens))
        index = torch.zeros(len(seqs), len(positions), dtype=torch.long)
        for r, i in enumerate(seqs):
            table = torch.tensor(batch.block_tables[i], dtype=torch.long)
            n = lens[r]
            index[r, :n] = table[positions[:n] // block_size] * block_size + positions[:n] % block_size
        mask = positions[None, :] >= torch.tensor(lens)[:, None]  # [B, Lmax]: padding past each sequence's end
        return {"index": index.to(device), "mask": mask.to(device)}

    def decode(self, storage, layer_idx, q, plan, scaling) -> torch.Tensor:
        """q [B, H, D] of the decodes -> [B, H, D]."""
        index = plan["index"]
        k, v = storage.gather_slots(layer_idx, index.reshape(-1), q.dtype)  # [B * Lmax, Hkv, D] each
        shape = (*index.shape, *k.shape[1:])
        return batched_decode_attention(q, k.view(shape), v.view(shape), plan["mask"], scaling)


class TritonBackend:
    """Chapter 7's unified kernel for the whole pass: chunks, prefix hits and decodes read the pools in place.

    A decode-only step with few sequences and long contexts goes to split-KV instead, when one program per
    (sequence, KV head) would leave most of the GPU's SMs idle (kvlab.kernels.choose_num_splits).
    """

    name = "triton"

    def plan(self, batch, block_size: int, device):
        """Every sequence's block table (int32, zero-padded), length and query offsets, as the kernel reads them."""
        tables = torch.zeros(len(batch.block_tables), max(1, max(map(len, batch.block_tables), default=1)),
                             dtype=torch.int32)
        for i, table in enumerate(batch.block_tables):
            tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
        starts = torch.zeros(len(batch.query_lens) + 1, dtype=torch.int32)
        starts[1:] = torch.tensor(batch.query_lens, dtype=torch.int32).cumsum(0)
        return {"block_tables": tables.to(device), "query_start_loc": starts.to(device),
                "seq_lens": torch.tensor(batch.context_lens, dtype=torch.int32, device=device), "shape": None,
                "decode_only": all(n == 1 for n in batch.query_lens), "max_seq_len": max(batch.context_lens,
                                                                                          default=0)}

    def attend(self, storage, layer_idx, query, batch, plan, scaling) -> torch.Tensor:
        """Every sequence's queries (query [1, H, T, D]) over its blocks, in one launch -> [T, H, D]."""
        # Imported here: importing kvlab.kernels switches Triton to its interpreter on a machine without CUDA.
        from kvlab import kernels

        q = query[0].transpose(0, 1)  # [T, H, D], head_dim still contiguous
        k_pool, v_pool, k_scale, v_scale = storage.kernel_inputs(layer_idx)
        tables, seq_lens, starts = plan["block_tables"], plan["seq_lens"], plan["query_start_loc"]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if plan["shape"] is None:  # once per step: every layer has the same shapes, so later layers skip the checks
            plan["num_splits"] = self._num_splits(plan, q.shape[0], k_pool.shape[2], q.device)
            plan["split_kv"] = plan["num_splits"] > 1
            if plan["split_kv"]:
                shape = kernels.validate_paged_decode_inputs(q, k_pool, v_pool, tables, seq_lens, scaling, k_scale,
                                                             v_scale)
                _, plan["num_splits"] = kernels.split_plan(shape.max_seq_len, plan["num_splits"])
                # Scratch shared by the step's layers.
                plan["workspace"] = kernels.allocate_split_workspace(shape.num_seqs, shape.num_heads,
                                                                     plan["num_splits"], shape.head_dim, q.device)
                plan["shape"] = shape
            else:
                plan["shape"] = kernels.validate_paged_attention_inputs(q, k_pool, v_pool, tables, seq_lens, starts,
                                                                        scaling, k_scale, v_scale)
        if plan["split_kv"]:
            return kernels.launch_paged_decode_split_kv(plan["shape"], q, k_pool, v_pool, tables, seq_lens, out,
                                                        plan["num_splits"], workspace=plan["workspace"],
                                                        k_scale=k_scale, v_scale=v_scale)
        return kernels.launch_paged_attention(plan["shape"], q, k_pool, v_pool, tables, seq_lens, starts, out,
                                              k_scale=k_scale, v_scale=v_scale)

    @staticmethod
    def _num_splits(plan, num_seqs: int, num_kv_heads: int, device) -> int:
        """Split-KV ranges for this step: 1 unless it is decode-only and the one-pass grid is too small."""
        from kvlab.kernels import choose_num_splits, num_sms

        if not plan["decode_only"]:
            return 1
        return choose_num_splits(num_seqs, num_kv_heads, plan["max_seq_len"], num_sms(device))


def batched_decode_attention(q, k, v, mask, scaling):
    """One query per sequence over its gathered K/V: q [B, H, D], k, v [B, L, Hkv, D], mask [B, L] -> [B, H, D].

    mask is True at padding, past each sequence's end.

    torch's fused attention runs all sequences and heads at once, sharing each KV head between its
    query heads (GQA) without copies.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[2]
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


def get_attn_backend(decode_backend: str, device) -> ReferenceBackend | _BatchedDecodeBackend | TritonBackend:
    """The backend named decode_backend for pools on `device` ("auto": the kernel on CUDA, batched torch elsewhere)."""
    if decode_backend not in DECODE_BACKENDS:
        raise ValueError(f"decode_backend must be one of {', '.join(DECODE_BACKENDS)}, got {decode_backend!r}")
    device = torch.device(device)
    if decode_backend == "auto":
        decode_backend = "triton" if device.type == "cuda" and _triton_available() else "torch"
    if decode_backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("decode_backend='triton' runs on a CUDA device, or on CPU in Triton's interpreter "
                         f"(TRITON_INTERPRET=1 before kvlab.kernels is imported); the pools are on {device.type}")
    return {"reference": ReferenceBackend, "torch": TorchBatchedBackend, "triton": TritonBackend}[decode_backend]()
