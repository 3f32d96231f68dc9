"""Chapter 6's swap space: a CPU block pool that preempted requests' K/V blocks are copied to and back from.

Swapping keeps the K/V a request already computed, at the price of copying every block twice over the
host link (on a GPU, PCIe); recompute throws the K/V away and runs the tokens through the model again.
Which costs less depends on block size and sequence length (Kwon et al., SOSP 2023, §7.3).

The CPU pool mirrors every tensor the cache's storage indexes by block (kvlab.cache.kv_storage's
block_tensors): the K and V pools in their own dtype, and an 8-bit cache's scales with them, since
int8 or fp8 values mean nothing without the scale of their (block, head). A speculative engine's
draft model keeps its K/V under the same block ids in pools of its own: those are extra_caches,
swapped with the target's blocks in the same calls.

This is the worker's half of swapping, as in vLLM V0 (its CacheEngine.swap_in / swap_out): the tensors
and the copies. Which CPU blocks are free, and which request's K/V sit where, is the scheduler's
bookkeeping (kvlab.engine.scheduler, a BlockPool of CPU block ids); it hands the runner the copies to
make, as (source block, destination block) pairs, in its output for the step.
"""

import math

import torch

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
        self.blocks_swapped_out = 0
        self.blocks_swapped_in = 0

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V, scales included: what one swap of one block moves."""
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in self.blocks)

    def _device_tensors(self) -> list:
        return [t for c in self.caches for t in c.storage.block_tensors()]

    def _check(self, pairs, what: str) -> tuple[list[int], list[int]]:
        pairs = [tuple(p) for p in pairs]
        src = [p[0] for p in pairs]
        dst = [p[1] for p in pairs]
        device_ids, cpu_ids = (src, dst) if what == "out" else (dst, src)
        num_device = self.cache.num_blocks
        bad = [i for i in device_ids if not is_integer(i) or not 0 <= i < num_device]
        if bad:
            raise ValueError(f"swap {what}: device block ids {bad} are outside the pool of {num_device} blocks")
        bad = [i for i in cpu_ids if not is_integer(i) or not 0 <= i < self.num_blocks]
        if bad:
            raise ValueError(f"swap {what}: CPU block ids {bad} are outside the swap space of {self.num_blocks} blocks")
        if len(set(dst)) != len(dst):
            raise ValueError(f"swap {what}: two copies write the same block: {pairs}")
        return src, dst

    def _copy(self, src_tensors, src_ids, dst_tensors, dst_ids) -> None:
        src = torch.tensor(src_ids, dtype=torch.long, device=src_tensors[0].device)
        dst = torch.tensor(dst_ids, dtype=torch.long, device=dst_tensors[0].device)
        for s, d in zip(src_tensors, dst_tensors):
            # Asynchronous only towards the device: a device-to-host copy into pageable memory may still be
            # in flight when the index_put below reads it, so that one waits for its data.
            d[dst] = s[src].to(d.device, non_blocking=d.device.type != "cpu")

    def swap_out(self, pairs) -> None:
        """Copy device blocks to CPU blocks: pairs of (device block id, CPU block id); all checked before any copy."""
        device_ids, cpu_ids = self._check(pairs, "out")
        if cpu_ids:
            self._copy(self._device_tensors(), device_ids, self.blocks, cpu_ids)
        self.blocks_swapped_out += len(cpu_ids)

    def swap_in(self, pairs) -> None:
        """Copy CPU blocks back into device blocks: pairs of (CPU block id, device block id)."""
        cpu_ids, device_ids = self._check(pairs, "in")
        if cpu_ids:
            self._copy(self.blocks, cpu_ids, self._device_tensors(), device_ids)
        self.blocks_swapped_in += len(cpu_ids)
