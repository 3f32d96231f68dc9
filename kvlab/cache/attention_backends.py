"""How a paged cache's queries attend over its storage: the attention backends, any of which reads any storage format.

    "reference"   Chapter 3: each sequence of the pass gathers its blocks through its block table
                  and runs causal attention on its own
    "torch"       Chapter 6: the decodes of a pass (one new query each) are gathered together through
                  one index of their slots, padded to the longest and masked, and attended in one
                  batched computation; prefill chunks take the reference path
    "triton"      Chapter 7: the whole pass (prefill chunks, prefix hits and decodes) goes to the unified
                  Triton paged-attention kernel in one launch per layer, which reads the blocks in place
                  (8-bit pools with their k_scale / v_scale): no gather at all
    "auto"        "triton" on a CUDA device with Triton installed, "torch" elsewhere

Every backend has vLLM's three parts: build_metadata, once per forward pass, turns the pass's BatchLayout
into what this backend's computation reads (its own typed metadata: slot indices and masks for torch,
int32 tables and offsets for the kernel); then, once per layer, do_kv_cache_update stores the layer's new
K/V at the pass's slot_mapping and forward attends. A backend reads K/V only through the storage
(kvlab.cache.kv_storage): real numbers for the torch paths, the raw pools and scales for the kernel.

The cache write is the backend's: the reference and torch backends hand it to the storage (KVStorage.write,
a torch index), and the Triton backend stores float pools with Chapter 7's store kernel,
kvlab.kernels.reshape_and_cache (vLLM's reshape_and_cache_flash: one program per token, slot -1 skipped).
8-bit storages keep their own write on every backend (TritonBackend.do_kv_cache_update says why).

vLLM V1 has the same split (vllm/v1/attention/backends/: a builder per backend makes the metadata, the
backend's implementation reads it); its default on NVIDIA GPUs is FlashAttention, and the Triton unified
kernel is its portable backend. Its cache write used to sit at the top of each implementation's forward;
it is now a step of its own: the attention layer (vllm/model_executor/layers/attention/attention.py,
unified_kv_cache_update) calls the implementation's do_kv_cache_update(layer, key, value, kv_cache,
slot_mapping) before its forward, for every backend whose forward_includes_kv_cache_update is False
(TritonAttentionImpl.do_kv_cache_update calls triton_reshape_and_cache_flash). kvlab's backends keep K/V
in a storage object rather than one kv_cache tensor, so they take the storage and the layer index instead.
"""

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from kvlab.cache.attention import causal_attention

ATTENTION_BACKENDS = ("auto", "reference", "torch", "triton")


def attend_sequence(storage, layer_idx: int, q: torch.Tensor, block_table: list[int], seq_len: int, scaling: float):
    """One sequence's new queries q [H, T_new, D] over its seq_len tokens in storage -> [T_new, H, D].

    The one torch reference for a sequence's paged attention: every torch path computes prefill chunks with it.
    """
    k, v = storage.gather(layer_idx, block_table, seq_len, q.dtype)
    return causal_attention(q, k, v, scaling)


@dataclass(slots=True)
class AttentionMetadata:
    """What every backend knows of a pass: per sequence its new tokens, its length after them and its blocks."""

    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]


class AttentionBackend(ABC):
    """One way to attend: build_metadata once per pass; do_kv_cache_update, then forward, once per layer."""

    name = ""

    @abstractmethod
    def build_metadata(self, batch, block_size: int, device) -> AttentionMetadata:
        """This backend's metadata for one forward pass (batch: kvlab.cache.ragged_batch.BatchLayout)."""

    def do_kv_cache_update(self, storage, layer_idx: int, key: torch.Tensor, value: torch.Tensor,
                           slot_mapping: torch.Tensor, metadata: AttentionMetadata | None = None) -> None:
        """Store the pass's new key, value [T, Hkv, D] at slot_mapping [T] of layer layer_idx, before forward reads.

        slot_mapping: int64 on the pools' device, its slots already checked against the pool on the host (once per
        pass, by the paged cache's set_batch), so no layer reads it back. Here the storage writes (a torch index,
        or quantisation for an 8-bit storage).
        """
        storage.write(layer_idx, key, value, slot_mapping, checked=True)

    @abstractmethod
    def forward(self, storage, layer_idx: int, query: torch.Tensor, metadata: AttentionMetadata,
                scaling: float) -> torch.Tensor:
        """Every sequence's new queries (query [1, H, T, D]) over its blocks -> [T, H, D]."""


class ReferenceBackend(AttentionBackend):
    """Chapter 3's path: one gather and one causal attention per sequence of the pass."""

    name = "reference"

    def build_metadata(self, batch, block_size, device) -> AttentionMetadata:
        return AttentionMetadata(batch.query_lens, batch.context_lens, batch.block_tables)

    def forward(self, storage, layer_idx, query, metadata, scaling) -> torch.Tensor:
        outs, start = [], 0
        for q_len, seq_len, table in zip(metadata.query_lens, metadata.context_lens, metadata.block_tables):
            outs.append(attend_sequence(storage, layer_idx, query[0, :, start:start + q_len], table, seq_len, scaling))
            start += q_len
        return torch.cat(outs, dim=0)


@dataclass(slots=True)
class TorchMetadata(AttentionMetadata):
    """The batched decode's inputs: which rows decode, and each decode's slots padded to the longest."""

    decode_seqs: list[int] = field(default_factory=list)   # sequences with one new token
    decode_rows: torch.Tensor | None = None                 # [B] their rows among the pass's T tokens
    slot_index: torch.Tensor | None = None                  # [B, Lmax] int64: pool slot of each position (0: padding)
    padding_mask: torch.Tensor | None = None                # [B, Lmax] bool: True past each sequence's end


class TorchBackend(AttentionBackend):
    """Chapter 6's batched torch decode: one slot gather for all decodes, then fused attention over them."""

    name = "torch"

    def build_metadata(self, batch, block_size, device) -> TorchMetadata:
        metadata = TorchMetadata(batch.query_lens, batch.context_lens, batch.block_tables)
        rows, start = [], 0
        for i, q_len in enumerate(batch.query_lens):
            if q_len == 1:
                rows.append(start)
                metadata.decode_seqs.append(i)
            start += q_len
        if not rows:
            return metadata
        lens = torch.tensor([batch.context_lens[i] for i in metadata.decode_seqs])
        tables = [batch.block_tables[i] for i in metadata.decode_seqs]
        width = max(map(len, tables))
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)   # [B, max blocks]
        positions = torch.arange(int(lens.max()))
        mask = positions[None, :] >= lens[:, None]                                             # [B, Lmax]
        index = padded[:, positions // block_size] * block_size + positions % block_size
        metadata.decode_rows = torch.tensor(rows, device=device)
        metadata.slot_index = index.masked_fill(mask, 0).to(device)
        metadata.padding_mask = mask.to(device)
        return metadata

    def forward(self, storage, layer_idx, query, metadata: TorchMetadata, scaling) -> torch.Tensor:
        q_all = query[0].transpose(0, 1)  # [T, H, D]
        if len(metadata.decode_seqs) == len(metadata.query_lens):  # decodes only: no prefill to attend
            return self.decode(storage, layer_idx, q_all, metadata, scaling)
        out = torch.empty_like(q_all)
        decoding = set(metadata.decode_seqs)
        start = 0
        for i, (q_len, seq_len, table) in enumerate(zip(metadata.query_lens, metadata.context_lens,
                                                         metadata.block_tables)):
            if i not in decoding:
                out[start:start + q_len] = attend_sequence(storage, layer_idx, query[0, :, start:start + q_len], table,
                                                           seq_len, scaling)
            start += q_len
        if decoding:
            out[metadata.decode_rows] = self.decode(storage, layer_idx, q_all[metadata.decode_rows], metadata, scaling)
        return out

    def decode(self, storage, layer_idx, q, metadata: TorchMetadata, scaling) -> torch.Tensor:
        """q [B, H, D] of the decodes -> [B, H, D]."""
        index = metadata.slot_index
        k, v = storage.gather_slots(layer_idx, index.reshape(-1), q.dtype)  # [B * Lmax, Hkv, D] each
        shape = (*index.shape, *k.shape[1:])
        return batched_decode_attention(q, k.view(shape), v.view(shape), metadata.padding_mask, scaling)


@dataclass(slots=True)
class TritonMetadata(AttentionMetadata):
    """The unified kernel's inputs, as the kernel reads them, plus what the first layer learns for the others."""

    block_table_tensor: torch.Tensor | None = None  # [num_seqs, max blocks] int32, zero-padded
    query_start_loc: torch.Tensor | None = None     # [num_seqs + 1] int32
    seq_lens: torch.Tensor | None = None            # [num_seqs] int32
    decode_only: bool = False
    max_seq_len: int = 0
    # Settled by the first layer (every layer has the same shapes): the cache write's inputs checked, the
    # validated attention shape and the split-KV plan.
    cache_write_checked: bool = False
    shape: object = None
    split_kv: bool = False
    num_splits: int = 1
    workspace: tuple | None = None


class TritonBackend(AttentionBackend):
    """Chapter 7's unified kernel for the whole pass: chunks, prefix hits and decodes read the pools in place.

    A decode-only step with few sequences and long contexts goes to split-KV instead, when one program per
    (sequence, KV head) would leave most of the GPU's SMs idle (kvlab.kernels.choose_num_splits).
    """

    name = "triton"

    def build_metadata(self, batch, block_size, device) -> TritonMetadata:
        width = max(1, max(map(len, batch.block_tables), default=1))
        tables = torch.tensor([t + [0] * (width - len(t)) for t in batch.block_tables], dtype=torch.int32)
        starts = torch.zeros(len(batch.query_lens) + 1, dtype=torch.int32)
        starts[1:] = torch.tensor(batch.query_lens, dtype=torch.int32).cumsum(0)
        return TritonMetadata(batch.query_lens, batch.context_lens, batch.block_tables,
                              block_table_tensor=tables.to(device), query_start_loc=starts.to(device),
                              seq_lens=torch.tensor(batch.context_lens, dtype=torch.int32, device=device),
                              decode_only=all(n == 1 for n in batch.query_lens),
                              max_seq_len=max(batch.context_lens, default=0))

    def do_kv_cache_update(self, storage, layer_idx, key, value, slot_mapping, metadata=None) -> None:
        """Float pools (float32, float16, bfloat16): Chapter 7's store kernel, kvlab.kernels.reshape_and_cache,
        one program per token; 8-bit pools: the storage's own write. key, value [T, Hkv, D]; slot_mapping [T] int64.
        """
        if storage.scale_granularity is not None:
            # An 8-bit storage decides its scales while it writes: a (block, KV head) scale grows with the values
            # that fill the block and requantises what the block already holds, a (token, KV head) scale comes from
            # the token's own values. The store kernel copies float rows and knows no scale. (vLLM's store kernel
            # is handed the layer's k_scale / v_scale and quantises with them: TritonAttentionImpl passes them.)
            return super().do_kv_cache_update(storage, layer_idx, key, value, slot_mapping, metadata)
        from kvlab import kernels  # here: importing kvlab.kernels switches Triton to its interpreter without CUDA

        k_pool, v_pool, _, _ = storage.kernel_inputs(layer_idx)
        if metadata is None or not metadata.cache_write_checked:
            # Every layer has the same shapes: the first layer of a pass checks them (and the slots, once more,
            # before anything of the pass is stored); the others launch without reading the slots back.
            kernels.reshape_and_cache(key, value, k_pool, v_pool, slot_mapping)
            if metadata is not None:
                metadata.cache_write_checked = True
            return
        kernels.cache_write.launch_reshape_and_cache(key, value, k_pool, v_pool, slot_mapping)

    def forward(self, storage, layer_idx, query, metadata: TritonMetadata, scaling) -> torch.Tensor:
        # Imported here: importing kvlab.kernels switches Triton to its interpreter on a machine without CUDA.
        from kvlab import kernels

        q = query[0].transpose(0, 1)  # [T, H, D], head_dim still contiguous
        k_pool, v_pool, k_scale, v_scale = storage.kernel_inputs(layer_idx)
        tables, seq_lens, starts = metadata.block_table_tensor, metadata.seq_lens, metadata.query_start_loc
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if metadata.shape is None:  # the first layer: later layers have the same shapes and skip the checks
            num_splits = 1
            if metadata.decode_only:
                num_splits = kernels.choose_num_splits(q.shape[0], k_pool.shape[2], metadata.max_seq_len,
                                                       kernels.num_sms(q.device))
            metadata.split_kv = num_splits > 1
            if metadata.split_kv:
                metadata.shape = kernels.validate_paged_attention_inputs(q, k_pool, v_pool, tables, seq_lens, None,
                                                                         scaling, k_scale, v_scale)
                _, metadata.num_splits = kernels.split_plan(metadata.shape.max_seq_len, num_splits)
                # Scratch shared by the step's layers.
                metadata.workspace = kernels.allocate_split_workspace(
                    metadata.shape.num_seqs, metadata.shape.num_heads, metadata.num_splits, metadata.shape.head_dim,
                    q.device)
            else:
                metadata.shape = kernels.validate_paged_attention_inputs(q, k_pool, v_pool, tables, seq_lens, starts,
                                                                         scaling, k_scale, v_scale)
        if metadata.split_kv:
            return kernels.launch_paged_decode_split_kv(metadata.shape, q, k_pool, v_pool, tables, seq_lens, out,
                                                        metadata.num_splits, workspace=metadata.workspace,
                                                        k_scale=k_scale, v_scale=v_scale)
        return kernels.launch_unified_attention(metadata.shape, q, k_pool, v_pool, tables, seq_lens, starts, out,
                                                k_scale=k_scale, v_scale=v_scale)


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


BACKEND_CLASSES = {"reference": ReferenceBackend, "torch": TorchBackend, "triton": TritonBackend}


def get_attn_backend(attention_backend: str, device) -> AttentionBackend:
    """The backend named attention_backend for pools on `device` ("auto": the kernel on CUDA, batched torch
    elsewhere)."""
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                         f"got {attention_backend!r}")
    device = torch.device(device)
    if attention_backend == "auto":
        attention_backend = "triton" if device.type == "cuda" and _triton_available() else "torch"
    if attention_backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend='triton' runs on a CUDA device, or on CPU in Triton's interpreter "
                         f"(TRITON_INTERPRET=1 before kvlab.kernels is imported); the pools are on {device.type}")
    return BACKEND_CLASSES[attention_backend]()
