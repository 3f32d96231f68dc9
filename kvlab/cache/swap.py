"""Chapter 6's swap space: a CPU block pool that preempted requests' K/V blocks are copied to and back from.

Swapping keeps the K/V a request already computed, at the price of copying every block twice over the
host link (on a GPU, PCIe); recompute throws the K/V away and runs the tokens through the model again.
Which costs less depends on block size and sequence length (Kwon et al., SOSP 2023, §7.3).
"""

from collections import deque

import torch

from kvlab.validation import check_int


class SwapSpace:
    """num_cpu_blocks blocks per layer, each [block_size, num_kv_heads, head_dim], on the host."""

    def __init__(self, cache, num_cpu_blocks: int):
        check_int("num_cpu_blocks", num_cpu_blocks, minimum=0)
        self.cache = cache
        shape = (num_cpu_blocks, *cache.k_pools[0].shape[1:])
        pin = cache.k_pools[0].is_cuda  # pinned host memory makes the copies asynchronous-capable and faster
        dtype = cache.k_pools[0].dtype
        self.k_pools = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in cache.k_pools]
        self.v_pools = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in cache.v_pools]
        self.num_blocks = num_cpu_blocks
        self.free_block_ids = deque(range(num_cpu_blocks))
        self.blocks_swapped_out = 0
        self.blocks_swapped_in = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        pool = self.k_pools[0] if self.k_pools else None
        return 0 if pool is None else 2 * len(self.k_pools) * pool[0].numel() * pool.element_size()

    def _copy(self, src_pools, src_ids, dst_pools, dst_ids) -> None:
        src = torch.tensor(src_ids, dtype=torch.long, device=src_pools[0].device)
        dst = torch.tensor(dst_ids, dtype=torch.long, device=dst_pools[0].device)
        for s, d in zip(src_pools, dst_pools):
            d[dst] = s[src].to(d.device, non_blocking=True)

    def swap_out(self, gpu_block_ids: list[int]) -> list[int] | None:
        """Copy these device blocks to free CPU blocks; returns the CPU block ids, or None when they do not fit."""
        if len(gpu_block_ids) > self.num_free_blocks:
            return None
        cpu_ids = [self.free_block_ids.popleft() for _ in gpu_block_ids]
        if cpu_ids:
            self._copy(self.cache.k_pools, gpu_block_ids, self.k_pools, cpu_ids)
            self._copy(self.cache.v_pools, gpu_block_ids, self.v_pools, cpu_ids)
        self.blocks_swapped_out += len(cpu_ids)
        return cpu_ids

    def swap_in(self, cpu_block_ids: list[int], gpu_block_ids: list[int]) -> None:
        """Copy CPU blocks back into device blocks (pairwise)."""
        if len(cpu_block_ids) != len(gpu_block_ids):
            raise ValueError(f"{len(cpu_block_ids)} CPU blocks for {len(gpu_block_ids)} device blocks")
        if cpu_block_ids:
            self._copy(self.k_pools, cpu_block_ids, self.cache.k_pools, gpu_block_ids)
            self._copy(self.v_pools, cpu_block_ids, self.cache.v_pools, gpu_block_ids)
        self.blocks_swapped_in += len(cpu_block_ids)

    def free(self, cpu_block_ids: list[int]) -> None:
        self.free_block_ids.extend(cpu_block_ids)
