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

Sliding-window layers: forward takes the layer's sliding_window (None: full attention; W: each query sees
its last W positions, kvlab.kernels.reference states the convention), so one backend serves a hybrid
model's full and windowed layers alike. No backend reads a block wholly before every query's window: the
KV cache manager may have freed it and left a placeholder in the table (vLLM's null block).

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
from kvlab.validation import check_sliding_window

ATTENTION_BACKENDS = ("auto", "reference", "torch", "triton")


def attend_sequence(storage, layer_idx: int, q: torch.Tensor, block_table: list[int], seq_len: int, scaling: float,
                    sliding_window: int | None = None):
    """One sequence's new queries q [H, T_new, D] over its seq_len tokens in storage -> [T_new, H, D].

    The one torch reference for a sequence's paged attention: every torch path computes prefill chunks with it.
    With a sliding_window W the gather starts at the block holding the first query's oldest visible key.
    """
    first_block = 0
    if sliding_window is not None:
        first_block = max(0, seq_len - q.shape[1] - sliding_window + 1) // storage.block_size
    skipped = first_block * storage.block_size
    k, v = storage.gather(layer_idx, block_table[first_block:], seq_len - skipped, q.dtype)
    return causal_attention(q, k, v, scaling, sliding_window)


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
                scaling: float, sliding_window: int | None = None) -> torch.Tensor:
        """Every sequence's new queries (query [1, H, T, D]) over its blocks -> [T, H, D].

        sliding_window: the layer's window W (each query sees its last W positions), or None for full attention.
        """


class ReferenceBackend(AttentionBackend):
    """Chapter 3's path: one gather and one causal attention per sequence of the pass."""

    name = "reference"

    def build_metadata(self, batch, block_size, device) -> AttentionMetadata:
        return AttentionMetadata(batch.query_lens, batch.context_lens, batch.block_tables)

    def forward(self, storage, layer_idx, query, metadata, scaling, sliding_window=None) -> torch.Tensor:
        sliding_window = check_sliding_window(sliding_window)
        outs, start = [], 0
        for q_len, seq_len, table in zip(metadata.query_lens, metadata.context_lens, metadata.block_tables):
            outs.append(attend_sequence(storage, layer_idx, query[0, :, start:start + q_len], table, seq_len, scaling,
                                        sliding_window))
            start += q_len
        return torch.cat(outs, dim=0)


@dataclass(slots=True)
class TorchMetadata(AttentionMetadata):
    """The batched decode's inputs: which rows decode, and each decode's slots padded to the longest."""

    decode_seqs: list[int] = field(default_factory=list)   # sequences with one new token
    decode_rows: torch.Tensor | None = None                 # [B] their rows among the pass's T tokens
    slot_index: torch.Tensor | None = None                  # [B, Lmax] int64: pool slot of each position (0: padding)
    padding_mask: torch.Tensor | None = None                # [B, Lmax] bool: True past each sequence's end
    block_size: int = 0
    # Per sliding window W, built by its first layer: (slot index, mask) [B, min(Lmax, W)] over each decode's
    # last W positions only, so the slots of blocks the window has left are never gathered.
    window_slots: dict = field(default_factory=dict)


def decode_slots(tables: list[list[int]], lens: list[int], block_size: int, sliding_window: int | None = None):
    """Pool slots of each decode's visible positions, padded: (index int64, mask bool) [B, L], mask True at padding.

    Row b covers positions max(0, lens[b] - W) .. lens[b] - 1 (all of them when sliding_window is None);
    padding points at slot 0 and is masked.
    """
    lens_t = torch.tensor(lens)
    first = torch.zeros_like(lens_t) if sliding_window is None else (lens_t - sliding_window).clamp_min(0)
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)   # [B, max blocks]
    positions = first[:, None] + torch.arange(int((lens_t - first).max()))[None, :]          # [B, L]
    mask = positions >= lens_t[:, None]
    positions = positions.masked_fill(mask, 0)
    index = padded.gather(1, positions // block_size) * block_size + positions % block_size
    return index.masked_fill(mask, 0), mask


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
        metadata.block_size = block_size
        if not rows:
            return metadata
        index, mask = decode_slots([batch.block_tables[i] for i in metadata.decode_seqs],
                                   [batch.context_lens[i] for i in metadata.decode_seqs], block_size)
        metadata.decode_rows = torch.tensor(rows, device=device)
        metadata.slot_index = index.to(device)
        metadata.padding_mask = mask.to(device)
        return metadata

    @staticmethod
    def decode_inputs(metadata: TorchMetadata, sliding_window: int | None = None):
        """(slot index, mask) [B, L] of the decodes for a layer with this window, built once per pass and window."""
        if sliding_window is None:
            return metadata.slot_index, metadata.padding_mask
        if sliding_window not in metadata.window_slots:
            index, mask = decode_slots([metadata.block_tables[i] for i in metadata.decode_seqs],
                                       [metadata.context_lens[i] for i in metadata.decode_seqs], metadata.block_size,
                                       sliding_window)
            device = metadata.decode_rows.device
            metadata.window_slots[sliding_window] = index.to(device), mask.to(device)
        return metadata.window_slots[sliding_window]

    def forward(self, storage, layer_idx, query, metadata: TorchMetadata, scaling, sliding_window=None) -> torch.Tensor:
        sliding_window = check_sliding_window(sliding_window)
        q_all = query[0].transpose(0, 1)  # [T, H, D]
        if len(metadata.decode_seqs) == len(metadata.query_lens):  # decodes only: no prefill to attend
            return self.decode(storage, layer_idx, q_all, metadata, scaling, sliding_window)
        out = torch.empty_like(q_all)
        decoding = set(metadata.decode_seqs)
        start = 0
        for i, (q_len, seq_len, table) in enumerate(zip(metadata.query_lens, metadata.context_lens,
                                                         metadata.block_tables)):
            if i not in decoding:
                out[start:start + q_len] = attend_sequence(storage, layer_idx, query[0, :, start:start + q_len], table,
                                                           seq_len, scaling, sliding_window)
            start += q_len
        if decoding:
            out[metadata.decode_rows] = self.decode(storage, layer_idx, q_all[metadata.decode_rows], metadata, scaling,
                                                    sliding_window)
        return out

    def decode(self, storage, layer_idx, q, metadata: TorchMetadata, scaling, sliding_window=None) -> torch.Tensor:
        """q [B, H, D] of the decodes -> [B, H, D]; each sees its last sliding_window positions (None: all)."""
        index, mask = self.decode_inputs(metadata, sliding_window)
        k, v = storage.gather_slots(layer_idx, index.reshape(-1), q.dtype)  # [B * L, Hkv, D] each
        shape = (*index.shape, *k.shape[1:])
        return batched_decode_attention(q, k.view(shape), v.view(shape), mask, scaling)


@dataclass(slots=True)
class TritonMetadata(AttentionMetadata):
    """The unified kernel's inputs, as the kernel reads them, plus what the first layer learns for the others."""

    block_table_tensor: torch.Tensor | None = None  # [num_seqs, max blocks] int32, zero-padded
    query_start_loc: torch.Tensor | None = None     # [num_seqs + 1] int32
    seq_lens: torch.Tensor | None = None            # [num_seqs] int32
    decode_only: bool = False
    max_seq_len: int = 0
    # Settled by the first layer (every layer has the same shapes): the cache write's inputs checked.
    cache_write_checked: bool = False
    # Settled by the first layer of each sliding window (None: full attention): its validated shape and split plan.
    plans: dict = field(default_factory=dict)


@dataclass(slots=True)
class TritonPlan:
    """How a pass's layers of one sliding window launch: the validated shape, and split-KV or not."""

    shape: object
    split_kv: bool = False
    num_splits: int = 1
    workspace: tuple | None = None   # split-KV scratch shared by the layers of this window


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

    def forward(self, storage, layer_idx, query, metadata: TritonMetadata, scaling,
                sliding_window=None) -> torch.Tensor:
        # Imported here: importing kvlab.kernels switches Triton to its interpreter on a machine without CUDA.
        from kvlab import kernels

        sliding_window = check_sliding_window(sliding_window)

        q = query[0].transpose(0, 1)  # [T, H, D], head_dim still contiguous
        k_pool, v_pool, k_scale, v_scale = storage.kernel_inputs(layer_idx)
        tables, seq_lens, starts = metadata.block_table_tensor, metadata.seq_lens, metadata.query_start_loc
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        plan = metadata.plans.get(sliding_window)
        if plan is None:  # the window's first layer: later layers of that window have the same shapes
            num_splits = 1
            if metadata.decode_only:
                attended = metadata.max_seq_len if sliding_window is None else min(metadata.max_seq_len,
                                                                                   sliding_window)
                num_splits = kernels.choose_num_splits(q.shape[0], k_pool.shape[2], attended,
                                                       kernels.num_sms(q.device))
            if num_splits > 1:
                shape = kernels.validate_paged_attention_inputs(q, k_pool, v_pool, tables, seq_lens, None, scaling,
                                                                k_scale, v_scale, sliding_window)
                _, num_splits = kernels.split_plan(kernels.split_kv.attended_len(shape), num_splits)
                workspace = kernels.allocate_split_workspace(shape.num_seqs, shape.num_heads, num_splits,
                                                             shape.head_dim, q.device)
                plan = TritonPlan(shape, True, num_splits, workspace)
            else:
                plan = TritonPlan(kernels.validate_paged_attention_inputs(q, k_pool, v_pool, tables, seq_lens, starts,
                                                                          scaling, k_scale, v_scale, sliding_window))
            metadata.plans[sliding_window] = plan
        if plan.split_kv:
            return kernels.launch_paged_decode_split_kv(plan.shape, q, k_pool, v_pool, tables, seq_lens, out,
                                                        plan.num_splits, workspace=plan.workspace, k_scale=k_scale,
                                                        v_scale=v_scale)
        return kernels.launch_unified_attention(plan.shape, q, k_pool, v_pool, tables, seq_lens, starts, out,
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
