"""A hybrid model's paged KV cache: every layer's pool is addressed through the block table of its KV-cache group.

With a HybridKVCacheCoordinator (kvlab.core.kv_cache_coordinator) a request has one block table per group: a
sliding-window group's table holds the null block (id 0) where it gave blocks back, a full-attention group's
every block. A forward pass therefore has one layout per group (its block tables and the slot of each new token
in that group's blocks), and each layer reads and writes through its group's layout, masked by its own window:

    cache = HybridPagedCache.for_model(model, groups, num_blocks)
    cache.set_batch([layout_of_group_0, layout_of_group_1, ...])
    forward(model, input_ids, positions, cache)       # layer i: group g(i)'s slots and tables, window W(i)

The memory is laid out as vLLM lays it out (vllm/v1/worker/gpu_model_runner.py, which gives one tensor to one
layer of each group): a block id names the same place in every layer of its group, and since the pool lends a
block to one group at a time, the i-th layer of every group shares one pool tensor. A model with groups of G layers
therefore holds G pools, not one per layer: a pool of num_blocks blocks costs G / num_layers of what an all-full
cache of as many blocks costs, which is what lets the same bytes hold more blocks.

    cache.num_layers     # G: the pool tensors (the largest group's layers)
    cache.pool_index     # model layer -> its pool tensor
"""

from collections.abc import Sequence

import torch

from kvlab.cache.paged_cache import PagedKVCache
from kvlab.cache.ragged_batch import BatchLayout
from kvlab.core.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    group_layers,
    specs_from_layer_types,
)


class HybridPagedCache(PagedKVCache):
    """PagedKVCache whose layers read and write through their group's layout (set_batch takes one per group)."""

    def __init__(self, kv_cache_groups: Sequence[KVCacheGroupSpec], num_layers, num_blocks, num_kv_heads, head_dim,
                 dtype=torch.float32, device="cpu", attention_backend: str = "reference", kv_cache_dtype: str = "auto"):
        groups = list(kv_cache_groups)
        if not groups:
            raise ValueError("kv_cache_groups is empty: every layer needs a group")
        sizes = {g.kv_cache_spec.block_size for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"the groups' block sizes differ ({sorted(sizes)}): kvlab's pools take one block size")
        self.layer_group: dict[int, int] = {}
        self.layer_window: dict[int, int | None] = {}
        self.pool_index: dict[int, int] = {}
        for g, group in enumerate(groups):
            spec = group.kv_cache_spec
            for position, layer in enumerate(group.layer_ids):
                self.pool_index[layer] = position
                if layer in self.layer_group:
                    raise ValueError(f"layer {layer} is in groups {self.layer_group[layer]} and {g}")
                if not 0 <= layer < num_layers:
                    raise ValueError(f"group {g} names layer {layer}, but the model has {num_layers} layers")
                self.layer_group[layer] = g
                self.layer_window[layer] = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        if len(self.layer_group) != num_layers:
            missing = sorted(set(range(num_layers)) - set(self.layer_group))
            raise ValueError(f"layers {missing} are in no group")
        super().__init__(max(len(g.layer_ids) for g in groups), num_blocks, sizes.pop(), num_kv_heads, head_dim,
                         dtype, device, kv_cache_dtype=kv_cache_dtype, attention_backend=attention_backend)
        self.kv_cache_groups = groups
        self.batches: list[BatchLayout] | None = None

    @classmethod
    def for_model(cls, model, kv_cache_groups: Sequence[KVCacheGroupSpec], num_blocks: int, **kwargs):
        """Pools for a transformers model's layers, KV heads, head dim, dtype and device, grouped as given."""
        from kvlab.analysis.kv_size import kv_shape

        shape = kv_shape(model.config)
        return cls(kv_cache_groups, shape["num_layers"], num_blocks, shape["num_kv_heads"], shape["head_dim"],
                   dtype=model.dtype, device=model.device, **kwargs)

    def set_batch(self, batches: Sequence[BatchLayout]) -> None:
        """Describe the next pass once per group: the same tokens, each group's tables and slots."""
        batches = list(batches)
        if len(batches) != len(self.kv_cache_groups):
            raise ValueError(f"{len(batches)} layouts for {len(self.kv_cache_groups)} groups: give one per group")
        if len({tuple(b.query_lens) for b in batches}) != 1 or len({tuple(b.context_lens) for b in batches}) != 1:
            raise ValueError("every group's layout must describe the same tokens (query_lens and context_lens)")
        self._per_group = []
        for batch in batches:
            super().set_batch(batch)
            self._per_group.append((self._slots, self._metadata))
        self.batches = batches

    def attend(self, layer_idx, query, key, value, scaling, sliding_window=None):
        """Layer layer_idx writes and reads through its group's layout, masked by its group's window."""
        if self.batches is None:
            raise RuntimeError("call set_batch([...one layout per group]) before running the model")
        expected = self.layer_window[layer_idx]
        # A windowed group gives back blocks by its window: the model's must be the same. A full group keeps every
        # block, so any window the model masks is safe (vLLM's --disable-hybrid-kv-cache-manager keeps all layers so).
        if expected is not None and sliding_window != expected:
            raise ValueError(f"layer {layer_idx}: the model attends with sliding_window={sliding_window}, but its "
                             f"KV-cache group gives blocks back by a window of {expected}; build the groups from this "
                             f"model's config")
        slots, metadata = self._per_group[self.layer_group[layer_idx]]
        pool = self.pool_index[layer_idx]
        self.attn_backend.do_kv_cache_update(self.storage, pool, key[0].transpose(0, 1), value[0].transpose(0, 1),
                                             slots, metadata)
        return self.attn_backend.forward(self.storage, pool, query, metadata, scaling,
                                         sliding_window=sliding_window)[None]


def hybrid_groups(model, block_size: int, disable_hybrid_kv_cache_manager: bool = False) -> list[KVCacheGroupSpec]:
    """A transformers model's KV-cache groups, from its config's layer pattern (kvlab.analysis.hybrid.layer_pattern);
    with disable_hybrid_kv_cache_manager (vLLM's flag) every layer is kept as full attention, in one group."""
    from kvlab.analysis.hybrid import FULL, LINEAR, layer_pattern
    from kvlab.analysis.kv_size import kv_shape

    pattern = layer_pattern(model.config)
    if LINEAR in pattern.layer_types:
        raise ValueError(f"{type(model).__name__} has linear-attention (Mamba-like) layers, whose state kvlab's "
                         f"caches do not hold; kvlab.analysis.hybrid does their arithmetic")
    shape = kv_shape(model.config)
    types = list(pattern.layer_types)
    if disable_hybrid_kv_cache_manager:
        types = [FULL] * len(types)
    specs = specs_from_layer_types(types, shape["num_layers"], block_size, shape["num_kv_heads"], shape["head_dim"],
                                   sliding_window=pattern.sliding_window,
                                   dtype_bytes=torch.finfo(model.dtype).bits // 8)
    return group_layers(specs)


def is_hybrid(kv_cache_groups: Sequence[KVCacheGroupSpec]) -> bool:
    """Whether any group gives blocks back (sliding window or chunked local attention), so the engine needs the
    hybrid KV cache manager; all-full-attention models keep Chapter 4's."""
    return any(type(g.kv_cache_spec) is not FullAttentionSpec for g in kv_cache_groups)
