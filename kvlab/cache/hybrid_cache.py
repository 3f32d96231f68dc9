"""A hybrid model's paged KV cache: every layer's pool is addressed through the block table of its KV-cache group.

With a HybridKVCacheCoordinator (kvlab.core.kv_cache_coordinator) a request has one block table per group: a
sliding-window group's table holds the null block (id 0) where it gave blocks back, a full-attention group's
every block. A forward pass therefore has one layout per group (its block tables and the slot of each new token
in that group's blocks), and each layer reads and writes through its group's layout, masked by its own window:

    cache = HybridPagedCache.for_model(model, groups, num_blocks)
    cache.set_batch([layout_of_group_0, layout_of_group_1, ...])
    forward(model, input_ids, positions, cache)       # layer i: group g(i)'s slots and tables, window W(i)

As in vLLM, a block id names the same place in every layer of its group; kvlab gives each layer a pool of
num_blocks blocks (vLLM shares one tensor between one layer of each group, since no block id is in two groups at
once: the memory arithmetic of benchmarks/hybrid_memory.py counts that layout).
"""

from collections.abc import Sequence

import torch

from kvlab.cache.paged_cache import PagedKVCache
from kvlab.cache.ragged_batch import BatchLayout
from kvlab.core.kv_cache_interface import KVCacheGroupSpec, SlidingWindowSpec


class HybridPagedCache(PagedKVCache):
    """PagedKVCache whose layers read and write through their group's layout (set_batch takes one per group)."""

    def __init__(self, kv_cache_groups: Sequence[KVCacheGroupSpec], num_layers, num_blocks, num_kv_heads, head_dim,
                 dtype=torch.float32, device="cpu", attention_backend: str = "reference"):
        groups = list(kv_cache_groups)
        if not groups:
            raise ValueError("kv_cache_groups is empty: every layer needs a group")
        sizes = {g.kv_cache_spec.block_size for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"the groups' block sizes differ ({sorted(sizes)}): kvlab's pools take one block size")
        self.layer_group: dict[int, int] = {}
        self.layer_window: dict[int, int | None] = {}
        for g, group in enumerate(groups):
            spec = group.kv_cache_spec
            for layer in group.layer_ids:
                if layer in self.layer_group:
                    raise ValueError(f"layer {layer} is in groups {self.layer_group[layer]} and {g}")
                if not 0 <= layer < num_layers:
                    raise ValueError(f"group {g} names layer {layer}, but the model has {num_layers} layers")
                self.layer_group[layer] = g
                self.layer_window[layer] = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        if len(self.layer_group) != num_layers:
            missing = sorted(set(range(num_layers)) - set(self.layer_group))
            raise ValueError(f"layers {missing} are in no group")
        super().__init__(num_layers, num_blocks, sizes.pop(), num_kv_heads, head_dim, dtype, device,
                         attention_backend=attention_backend)
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
        self.attn_backend.do_kv_cache_update(self.storage, layer_idx, key[0].transpose(0, 1), value[0].transpose(0, 1),
                                             slots, metadata)
        return self.attn_backend.forward(self.storage, layer_idx, query, metadata, scaling,
                                         sliding_window=sliding_window)[None]
