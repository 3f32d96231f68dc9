"""Chapter 3's paged KV store: per layer a K pool and a V pool of fixed-size blocks, written by slot.

As the runner hook it serves a ragged batch: the T tokens of one forward pass belong to several
sequences (one prefill chunk or one decode token each). Before the pass, `set_batch` says which
sequence owns which tokens; `attend` has the attention backend write every token's K/V through the slot
mapping (do_kv_cache_update), then each sequence's queries attend over its blocks.

A PagedKVCache is composed of two parts, so that any pair works:

    storage       how K/V are kept (kvlab.cache.kv_storage): the model's dtype ("auto"), or int8 /
                  fp8 e4m3 with a scale per (block, KV head) or per (token, KV head), as vLLM's kv_cache_dtype
    attn_backend  how the queries read them (kvlab.cache.attention_backends): Chapter 3's
                  per-sequence reference, Chapter 6's batched torch decode, or Chapter 7's Triton kernel

    PagedKVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim)              # Chapter 3
    PagedKVCache.for_model(model, num_blocks, block_size, attention_backend="auto")       # the engine's
    PagedKVCache.for_model(model, num_blocks, block_size, kv_cache_dtype="int8")          # Chapter 14's 8 bits
"""

import warnings

import torch

from kvlab.analysis.kv_size import kv_shape
from kvlab.cache.attention import causal_attention
from kvlab.cache.attention_backends import get_attn_backend
from kvlab.cache.kv_storage import gather_dequantized, gather_kv, make_kv_storage
from kvlab.cache.ragged_batch import BatchLayout
from kvlab.quantization import PER_TOKEN_HEAD_KV_CACHE_DTYPES

__all__ = ["PagedKVCache", "copy_blocks", "gather_kv", "paged_attention"]


def paged_attention(q, k_pool, v_pool, block_table, seq_len, scaling, k_scales=None, v_scales=None):
    """Reference paged attention: gather the sequence through its block table, then causal attention.

    q: [H, T_new, D] for the last T_new positions of a sequence of seq_len tokens. Returns [T_new, H, D].
    8-bit pools (int8, fp8) come with their scales [num_blocks, Hkv] and are dequantised after the gather.
    """
    if (k_scales is None) != (v_scales is None):
        raise ValueError("give both k_scales and v_scales (8-bit pools) or neither")
    if k_scales is None:
        k, v = gather_kv(k_pool, block_table, seq_len), gather_kv(v_pool, block_table, seq_len)
    else:
        k = gather_dequantized(k_pool, k_scales, block_table, seq_len, q.dtype)
        v = gather_dequantized(v_pool, v_scales, block_table, seq_len, q.dtype)
    return causal_attention(q, k, v, scaling)


class PagedKVCache:
    """K and V pools for every layer, each [num_blocks, block_size, num_kv_heads, head_dim], in any storage format.

    kv_cache_dtype: "auto" (the model's dtype), "int8", "fp8" / "fp8_e4m3"; attention_backend: "reference"
    (Chapter 3, the default), "torch", "triton" or "auto" (kvlab.cache.attention_backends).
    """

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32, device="cpu",
                 kv_cache_dtype: str = "auto", attention_backend: str = "reference", decode_backend: str | None = None):
        if decode_backend is not None:
            warnings.warn("decode_backend is now called attention_backend: the backend runs prefills too",
                          DeprecationWarning, stacklevel=2)
            attention_backend = decode_backend
        if attention_backend == "auto" and kv_cache_dtype in PER_TOKEN_HEAD_KV_CACHE_DTYPES:
            attention_backend = "torch"  # the Triton kernels read one scale per (block, KV head), not per token
        self.attn_backend = get_attn_backend(attention_backend, device)  # checked before any pool is allocated
        self.storage = make_kv_storage(kv_cache_dtype, num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                                       dtype, device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.batch: BatchLayout | None = None
        self._metadata = None

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int, **kwargs):
        """Pools sized for a transformers model's layers, KV heads, head dim, dtype and device (kwargs: the rest)."""
        shape = kv_shape(model.config)
        return cls(shape["num_layers"], num_blocks, block_size, shape["num_kv_heads"], shape["head_dim"],
                   dtype=model.dtype, device=model.device, **kwargs)

    # ----- what the storage holds -----
    @property
    def k_pools(self) -> list[torch.Tensor]:
        """K pool per layer, [num_blocks, block_size, Hkv, D] in the storage dtype."""
        return self.storage.k_pools

    @property
    def v_pools(self) -> list[torch.Tensor]:
        """V pool per layer, [num_blocks, block_size, Hkv, D]."""
        return self.storage.v_pools

    @property
    def k_scales(self) -> list[torch.Tensor]:
        """K's scales per layer: [num_blocks, Hkv] float32, or per token [num_blocks, block_size, Hkv]."""
        return self.storage.k_scales

    @property
    def v_scales(self) -> list[torch.Tensor]:
        """V's scale per layer, shaped as k_scales; empty unless the storage is 8-bit."""
        return self.storage.v_scales

    @property
    def kv_cache_dtype(self) -> str:
        """The storage format: 'auto', 'int8', 'fp8_e4m3', 'int8_per_token_head' or 'fp8_per_token_head'."""
        return self.storage.kv_cache_dtype

    @property
    def dtype(self) -> torch.dtype:
        """What attention computes in: the model's dtype."""
        return self.storage.dtype

    @property
    def attention_backend(self) -> str:
        """The backend's name: 'reference', 'torch' or 'triton' ('auto' resolved)."""
        return self.attn_backend.name

    @property
    def num_layers(self) -> int:
        """Layers with a pool."""
        return self.storage.num_layers

    @property
    def num_slots(self) -> int:
        """Token slots in each pool."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of every pool and every scale."""
        return self.storage.nbytes

    def bytes_per_token(self) -> float:
        """Bytes one token slot costs across all layers, K and V, its share of the block scales included."""
        return self.nbytes / self.num_slots

    def dequantized(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer layer_idx's K and V pools as real numbers: two [num_blocks, block_size, Hkv, D] tensors."""
        return self.storage.dequantized(layer_idx)

    # ----- the runner hook -----
    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store new k, v [T, Hkv, D] at their slots of layer layer_idx's pools (all checks before any change)."""
        self.storage.write(layer_idx, k, v, slot_mapping)

    def set_batch(self, batch: BatchLayout) -> None:
        """Describe the next forward pass's tokens (checked against the pool before anything is written)."""
        if sum(batch.query_lens) != len(batch.slot_mapping):
            raise ValueError(f"{sum(batch.query_lens)} new tokens but {len(batch.slot_mapping)} slots")
        for table, length in zip(batch.block_tables, batch.context_lens):
            if len(table) * self.block_size < length:
                raise ValueError(f"a block table of {len(table)} blocks cannot hold {length} tokens")
            if any(not 0 <= b < self.num_blocks for b in table):
                raise ValueError(f"block table {table} names a block outside the pool of {self.num_blocks}")
        # The slots are checked here, once per pass and on the host, then moved to the pools' device once:
        # the layers write with them without reading anything back from the device.
        slots = torch.as_tensor(batch.slot_mapping, dtype=torch.long).cpu()
        self.storage.check_slots(slots, len(slots))
        self.storage.prepare_pass(slots)
        self._slots = slots.to(self.storage.device, non_blocking=True)
        self.batch = batch
        self._metadata = self.attn_backend.build_metadata(batch, self.block_size, self.storage.device)

    # Each backend masks a layer's window (kvlab.cache.attention_backends); this cache keeps every block, so a
    # windowed layer computes the right attention without saving memory (HybridPagedCache saves it).
    supports_sliding_window = True

    def attend(self, layer_idx, query, key, value, scaling, sliding_window=None):
        """The runner hook: the backend stores this pass's K/V by slot, then each sequence attends ([1, T, H, D]);
        sliding_window: the layer's window, None for full attention."""
        batch = self.batch
        if batch is None:
            raise RuntimeError(f"call set_batch(...) before running the model on a {type(self).__name__}")
        self.attn_backend.do_kv_cache_update(self.storage, layer_idx, key[0].transpose(0, 1), value[0].transpose(0, 1),
                                             self._slots, self._metadata)
        return self.attn_backend.forward(self.storage, layer_idx, query, self._metadata, scaling,
                                         sliding_window=sliding_window)[None]

    def finish_pass(self) -> None:
        """After the model ran on set_batch's tokens: raise what the writes found wrong (8-bit pools: NaN or inf)."""
        self.storage.finish_pass()

    def copy_blocks(self, copies) -> None:
        """Copy block src's K/V (and scales) into block dst for every (src, dst) and layer (copy-on-write)."""
        copy_blocks(self, copies)


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
    device = cache.storage.device
    src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
    dst = torch.tensor(dsts, dtype=torch.long, device=device)
    # An 8-bit storage keeps a scale per (block, head) beside each pool: the copy carries it too.
    for tensor in cache.storage.block_tensors():
        tensor[dst] = tensor[src]
