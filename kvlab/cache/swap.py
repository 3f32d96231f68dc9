"""Chapter 6's swap space: a CPU block pool that preempted requests' K/V blocks are copied to and back from.

Swapping keeps the K/V a request already computed, at the price of copying every block twice over the
host link (on a GPU, PCIe); recompute throws the K/V away and runs the tokens through the model again.
Which costs less depends on block size and sequence length (Kwon et al., SOSP 2023, §7.3).

The CPU pool mirrors every tensor the cache's storage indexes by block (kvlab.cache.kv_storage's
block_tensors): the K and V pools in their own dtype, and an 8-bit cache's scales with them, since
int8 or fp8 values mean nothing without the scale of their (block, head). A speculative engine's
draft model keeps its K/V under the same block ids in pools of its own: those are extra_caches,
swapped with the target's blocks in the same calls.
"""

import math

import torch

from kvlab.core.block_pool import BlockPool
from kvlab.validation import check_int, is_integer


class SwapSpace:
    """num_cpu_blocks host blocks per layer, each [block_size, num_kv_heads, head_dim] (plus [num_kv_heads] scales)."""

    def __init__(self, cache, num_cpu_blocks: int, extra_caches=()):
        check_int("num_cpu_blocks", num_cpu_blocks, minimum=0)
        self.cache = cache
        self.caches = [cache, *extra_caches]
        device_tensors = self._device_tensors()
        pin = device_tensors[0].is_cuda  # pinned host memory makes the copies asynchronous-capable and faster
        # self.blocks[i] is the host twin of device_tensors[i]: the same shape past the block dim, the same dtype.
        self.blocks = [torch.zeros((num_cpu_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
                       for t in device_tensors]
        self.num_blocks = num_cpu_blocks
        # Which CPU blocks are free is Chapter 4's BlockPool (without prefix caching), not a second free list:
        # blocks come from the front of its queue, and freed ones (never hashed) go back to the front.
        self.block_pool = BlockPool(num_cpu_blocks, enable_prefix_caching=False) if num_cpu_blocks else None
        self.blocks_swapped_out = 0
        self.blocks_swapped_in = 0

    @property
    def num_free_blocks(self) -> int:
        """CPU blocks a swap-out can still take."""
        return self.block_pool.num_free_blocks if self.block_pool is not None else 0

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V, scales included: what one swap of one block moves."""
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in self.blocks)

    def _device_tensors(self) -> list:
        return [t for c in self.caches for t in c.storage.block_tensors()]

    def _copy(self, src_tensors, src_ids, dst_tensors, dst_ids) -> None:
        src = torch.tensor(src_ids, dtype=torch.long, device=src_tensors[0].device)
        dst = torch.tensor(dst_ids, dtype=torch.long, device=dst_tensors[0].device)
        for s, d in zip(src_tensors, dst_tensors):
            # Asynchronous only towards the device: a device-to-host copy into pageable memory may still be
            # in flight when the index_put below reads it, so that one waits for its data.
            d[dst] = s[src].to(d.device, non_blocking=d.device.type != "cpu")

    def swap_out(self, gpu_block_ids: list[int]) -> list[int] | None:
        """Copy these device blocks to free CPU blocks; returns the CPU block ids, or None when they do not fit."""
        if len(gpu_block_ids) > self.num_free_blocks:
            return None
        cpu_ids = [b.block_id for b in self.block_pool.get_new_blocks(len(gpu_block_ids))] if gpu_block_ids else []
        if cpu_ids:
            self._copy(self._device_tensors(), gpu_block_ids, self.blocks, cpu_ids)
        self.blocks_swapped_out += len(cpu_ids)
        return cpu_ids

    def swap_in(self, cpu_block_ids: list[int], gpu_block_ids: list[int]) -> None:
        """Copy CPU blocks back into device blocks (pairwise)."""
        if len(cpu_block_ids) != len(gpu_block_ids):
            raise ValueError(f"{len(cpu_block_ids)} CPU blocks for {len(gpu_block_ids)} device blocks")
        if cpu_block_ids:
            self._copy(self.blocks, cpu_block_ids, self._device_tensors(), gpu_block_ids)
        self.blocks_swapped_in += len(cpu_block_ids)

    def free(self, cpu_block_ids: list[int]) -> None:
        """Return CPU blocks to the pool; an unknown or already free block is a ValueError and frees nothing."""
        cpu_block_ids = list(cpu_block_ids)
        bad = [i for i in cpu_block_ids
               if not is_integer(i) or not 0 <= i < self.num_blocks]
        if bad:
            raise ValueError(f"CPU block ids {bad} are outside the swap space of {self.num_blocks} blocks")
        if cpu_block_ids:
            self.block_pool.free_blocks([self.block_pool.blocks[i] for i in cpu_block_ids])
