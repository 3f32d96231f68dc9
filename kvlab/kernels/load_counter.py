"""Count, in Triton's interpreter, the bytes a kernel's loads request from each tensor: the cost model of Chapter 7.

On a GPU a decode step is bound by the bytes it moves from memory. In the interpreter every masked
load passes through one method; counting the lanes it lets through, per tensor, gives the bytes a
kernel requests, repeats included. Divided by the bytes the pool holds for the batch's tokens, that
is how many times each cached byte is read: 1.0 is the ideal a GPU kernel aims for.
"""

import contextlib

import numpy as np
import torch


@contextlib.contextmanager
def count_requested_bytes(**tensors: torch.Tensor):
    """Within the block, the bytes interpreted loads request from each named tensor: {name: bytes, "elsewhere": n}.

    Only interpreted kernels are counted (TRITON_INTERPRET=1); "elsewhere" counts lanes outside every tensor.
    """
    from triton.runtime.interpreter import InterpreterBuilder

    spans = [(name, t.data_ptr(), t.element_size(), t.numel()) for name, t in tensors.items()]
    counts = {name: 0 for name in tensors} | {"elsewhere": 0}
    original = InterpreterBuilder.create_masked_load

    def create_masked_load(self, ptrs, mask, other, *args):
        addresses = np.broadcast_to(ptrs.data, mask.data.shape)[mask.data].astype(np.int64)
        known = np.zeros(addresses.shape, dtype=bool)
        for name, start, size, numel in spans:
            inside = (addresses >= start) & (addresses < start + size * numel)
            counts[name] += int(inside.sum()) * size
            known |= inside
        counts["elsewhere"] += int((~known).sum())
        return original(self, ptrs, mask, other, *args)

    InterpreterBuilder.create_masked_load = create_masked_load
    try:
        yield counts
    finally:
        InterpreterBuilder.create_masked_load = original


def kv_bytes_held(k_cache: torch.Tensor, seq_lens) -> int:
    """Bytes one pool [num_blocks, block_size, num_kv_heads, head_dim] holds for sequences of these lengths."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    return int(sum(int(n) for n in seq_lens)) * num_kv_heads * head_dim * k_cache.element_size()
