"""The CPU tier's mover: copy whole KV blocks between the device pools and a host pool by block id.

Host pool layout, block-major:

    host_pool [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]     (index 0 of dim 2 is K, 1 is V)

so one block's K and V for every layer, host_pool[i] of shape [num_layers, 2, block_size, num_kv_heads,
head_dim], is one contiguous run of memory: one copy per block, and exactly the tensor the disk tier writes
to one file. The device side is kvlab.cache.kv_storage's: per layer two pools k_pools[l] and v_pools[l],
each [num_device_blocks, block_size, num_kv_heads, head_dim].

Copies never convert: pools of different dtypes are refused, so a round trip is bit-identical. Copies are
synchronous; vLLM overlaps them with the forward pass on their own CUDA stream, which a connector adds.
"""

from collections.abc import Sequence

import torch

from kvlab.validation import check_block_size, check_int, check_positive_int


def make_host_pool(num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype, pin_memory: bool = False) -> torch.Tensor:
    """Zeros [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]; pin_memory (needs CUDA) speeds copies."""
    shape = (check_positive_int("num_blocks", num_blocks), check_positive_int("num_layers", num_layers), 2,
             check_block_size(block_size), check_positive_int("num_kv_heads", num_kv_heads),
             check_positive_int("head_dim", head_dim))
    return torch.zeros(shape, dtype=dtype, pin_memory=pin_memory)


def _check_ids(name: str, ids: Sequence[int], num_blocks: int, unique: bool) -> torch.Tensor:
    ids = [check_int(f"{name}[{i}]", b, 0) for i, b in enumerate(ids)]
    too_big = [b for b in ids if b >= num_blocks]
    if too_big:
        raise ValueError(f"{name} has id {too_big[0]} but the pool has {num_blocks} blocks (ids 0..{num_blocks - 1})")
    if unique and len(set(ids)) != len(ids):
        raise ValueError(f"{name} repeats an id: two blocks would be written to one place ({ids})")
    return torch.tensor(ids, dtype=torch.long)


def _check_device_pools(k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor],
                        host_pool: torch.Tensor) -> None:
    if host_pool.dim() != 6 or host_pool.shape[2] != 2:
        raise ValueError("host_pool must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(host_pool.shape)}")
    num_layers, block_shape = host_pool.shape[1], tuple(host_pool.shape[3:])
    if len(k_pools) != num_layers or len(v_pools) != num_layers:
        raise ValueError(f"host_pool has {num_layers} layers but k_pools has {len(k_pools)} and v_pools "
                         f"{len(v_pools)}")
    for name, pools in (("k_pools", k_pools), ("v_pools", v_pools)):
        for layer, pool in enumerate(pools):
            if tuple(pool.shape[1:]) != block_shape:
                raise ValueError(f"{name}[{layer}] blocks are {tuple(pool.shape[1:])} but host_pool blocks are "
                                 f"{block_shape} (block_size, num_kv_heads, head_dim)")
            if pool.dtype != host_pool.dtype:
                raise ValueError(f"{name}[{layer}] is {pool.dtype} but host_pool is {host_pool.dtype}: a copy "
                                 "must not convert")


def _check_pairs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source ids but {len(dst_ids)} destination ids: one destination per block")


def swap_out(k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor], device_block_ids: Sequence[int],
             host_pool: torch.Tensor, host_block_ids: Sequence[int]) -> None:
    """Copy device blocks device_block_ids[i] into host block host_block_ids[i], every layer's K and V."""
    _check_device_pools(k_pools, v_pools, host_pool)
    _check_pairs(device_block_ids, host_block_ids)
    src = _check_ids("device_block_ids", device_block_ids, k_pools[0].shape[0], unique=False)
    dst = _check_ids("host_block_ids", host_block_ids, host_pool.shape[0], unique=True)
    for layer, (k_pool, v_pool) in enumerate(zip(k_pools, v_pools)):
        idx = src.to(k_pool.device)
        host_pool[dst, layer, 0] = k_pool[idx].to(host_pool.device)
        host_pool[dst, layer, 1] = v_pool[idx].to(host_pool.device)


def swap_in(host_pool: torch.Tensor, host_block_ids: Sequence[int], k_pools: Sequence[torch.Tensor],
            v_pools: Sequence[torch.Tensor], device_block_ids: Sequence[int]) -> None:
    """Copy host blocks host_block_ids[i] into device block device_block_ids[i], every layer's K and V."""
    _check_device_pools(k_pools, v_pools, host_pool)
    _check_pairs(host_block_ids, device_block_ids)
    src = _check_ids("host_block_ids", host_block_ids, host_pool.shape[0], unique=False)
    dst = _check_ids("device_block_ids", device_block_ids, k_pools[0].shape[0], unique=True)
    blocks = host_pool[src]  # [n, num_layers, 2, block_size, num_kv_heads, head_dim]
    for layer, (k_pool, v_pool) in enumerate(zip(k_pools, v_pools)):
        idx = dst.to(k_pool.device)
        k_pool[idx] = blocks[:, layer, 0].to(k_pool.device)
        v_pool[idx] = blocks[:, layer, 1].to(v_pool.device)


def copy_blocks(src_pool: torch.Tensor, dst_pool: torch.Tensor, src_block_ids: Sequence[int],
                dst_block_ids: Sequence[int]) -> None:
    """dst_pool[dst_block_ids[i]] = src_pool[src_block_ids[i]] for two block-major pools of the same block shape."""
    if tuple(src_pool.shape[1:]) != tuple(dst_pool.shape[1:]):
        raise ValueError(f"src_pool blocks are {tuple(src_pool.shape[1:])} but dst_pool blocks are "
                         f"{tuple(dst_pool.shape[1:])}")
    if src_pool.dtype != dst_pool.dtype:
        raise ValueError(f"src_pool is {src_pool.dtype} but dst_pool is {dst_pool.dtype}: a copy must not convert")
    _check_pairs(src_block_ids, dst_block_ids)
    src = _check_ids("src_block_ids", src_block_ids, src_pool.shape[0], unique=False)
    dst = _check_ids("dst_block_ids", dst_block_ids, dst_pool.shape[0], unique=True)
    dst_pool[dst.to(dst_pool.device)] = src_pool[src.to(src_pool.device)].to(dst_pool.device)
