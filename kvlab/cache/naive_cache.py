"""Chapter 1's KV cache: one sequence, one contiguous K and V tensor per layer, grown by concatenation."""

import torch

from kvlab.cache.attention import causal_attention


class NaiveKVCache:
    """Per-layer K and V of one sequence: k[layer], v[layer] are [Hkv, T, D]."""

    def __init__(self, num_layers: int):
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """Append new K/V [Hkv, T_new, D] for one layer; return that layer's whole K and V [Hkv, T, D]."""
        if self.k[layer_idx] is None:
            self.k[layer_idx], self.v[layer_idx] = k, v
        else:
            # torch.cat copies the whole history each step: fine for teaching, and the reason
            # real systems preallocate (Chapter 2) and page (Chapter 3).
            self.k[layer_idx] = torch.cat([self.k[layer_idx], k], dim=1)
            self.v[layer_idx] = torch.cat([self.v[layer_idx], v], dim=1)
        return self.k[layer_idx], self.v[layer_idx]

    def attend(self, layer_idx, query, key, value, scaling):
        """The runner hook: store this step's K/V, then attend over all of them ([1, T, H, D])."""
        k_all, v_all = self.update(layer_idx, key[0], value[0])
        return causal_attention(query[0], k_all, v_all, scaling)[None]

    @property
    def num_tokens(self) -> int:
        """Tokens cached so far (taken from layer 0)."""
        return 0 if self.k[0] is None else self.k[0].shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held by K and V across all layers."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)


class RecomputeCache:
    """No cache at all: attends only within the tokens of the current forward pass."""

    def attend(self, layer_idx, query, key, value, scaling):
        """Attention over this forward pass's own tokens ([1, T, H, D])."""
        return causal_attention(query[0], key[0], value[0], scaling)[None]
