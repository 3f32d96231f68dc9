"""The cache write: a step's new keys and values stored into the paged pools at their slots (vLLM's reshape_and_cache).

Before attention reads a step's tokens, each new token's K and V, computed by the model as rows of
key, value [num_tokens, num_kv_heads, head_dim], are written to the pools
[num_blocks, block_size, num_kv_heads, head_dim] at the token's slot:

    slot = block_table[pos // block_size] * block_size + pos % block_size     (slot_mapping[t], int64)

so the pool's block `slot // block_size` gets the row in its slot `slot % block_size`. A slot of -1
marks a padding row (vLLM pads a step's tokens up to a CUDA-graph size and gives the padding slot -1):
it is skipped. One program per token copies its num_kv_heads x head_dim values, as vLLM's
`reshape_and_cache_flash` kernels do (csrc/cache_kernels.cu, and the Triton one in
vllm/v1/attention/ops/triton_reshape_and_cache_flash.py). kvlab's engine stores float pools with this kernel
when it attends with the Triton backend (TritonBackend.do_kv_cache_update in kvlab.cache.attention_backends,
as vLLM's TritonAttentionImpl.do_kv_cache_update calls triton_reshape_and_cache_flash); its other backends
write with a torch index (`KVStorage.write`). `reshape_and_cache_reference` is that torch write, and the tests
hold the kernel to it.
"""

import torch

from kvlab.kernels.interpreter import RUNS_IN_INTERPRETER, check_mode, triton, triton_language_as
from kvlab.kernels.reference import reshape_and_cache_reference  # noqa: F401  (re-exported: the kernel's spec)
from kvlab.kernels.validation import SUPPORTED_DTYPES, dtype_name

tl = triton.language

PAD_SLOT_ID = -1  # vLLM's value for a padding row's slot: nothing is written


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,              # [num_tokens, num_kv_heads, head_dim] the step's new keys
    value_ptr,            # [num_tokens, num_kv_heads, head_dim] and values
    k_cache_ptr,          # [num_blocks, block_size, num_kv_heads, head_dim] written here
    v_cache_ptr,          # the value pool, same shape and strides
    slot_mapping_ptr,     # [num_tokens] int64: each token's slot, -1 for a padding row
    stride_key_tok, stride_key_head, stride_value_tok, stride_value_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, NUM_KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One program per token: its [num_kv_heads, head_dim] K and V rows copied to its slot, unless the slot is -1."""
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok)
    if slot >= 0:
        heads = tl.arange(0, NUM_KV_HEADS_PAD)
        dims = tl.arange(0, HEAD_DIM_PAD)
        mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
        # int64 addressing: block * stride_cache_block passes 2**31 in a pool of several GiB.
        dst = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot
        dst = dst + heads[:, None] * stride_cache_head + dims[None, :]
        k = tl.load(key_ptr + tok.to(tl.int64) * stride_key_tok + heads[:, None] * stride_key_head + dims[None, :],
                    mask=mask)
        v = tl.load(value_ptr + tok.to(tl.int64) * stride_value_tok + heads[:, None] * stride_value_head
                    + dims[None, :], mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def validate_cache_write_inputs(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Raise ValueError naming what is wrong: shapes that agree, one dtype, int64 slots in [-1, num_slots)."""
    for name, t, dims in (("key", key, 3), ("value", value, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4),
                          ("slot_mapping", slot_mapping, 1)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            raise ValueError(f"{name} must be a {dims}-D tensor; got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have the same "
                         "shape and strides")
    num_tokens, num_kv_heads, head_dim = key.shape
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"key rows are [{num_kv_heads}, {head_dim}] but the pools hold "
                         f"[{k_cache.shape[2]}, {k_cache.shape[3]}] per slot")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} is {dtype_name(t.dtype)}; the cache write takes float32, float16 or bfloat16 "
                             "(an 8-bit cache quantises on the way in: kvlab.cache's storage does that)")
    if key.dtype != value.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError("key and value must share a dtype, and so must k_cache and v_cache")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping must be int64 [{num_tokens}] (one slot per row of key); got "
                         f"{dtype_name(slot_mapping.dtype)} {tuple(slot_mapping.shape)}")
    if k_cache.stride(3) != 1 or key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("head_dim must be contiguous in key, value and the pools")
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if num_tokens:
        low, high = int(slot_mapping.min()), int(slot_mapping.max())
        if low < PAD_SLOT_ID or high >= num_slots:
            bad = low if low < PAD_SLOT_ID else high
            raise ValueError(f"slot_mapping holds {bad}: slots are -1 (a padding row, skipped) or in "
                             f"[0, {num_slots}) for a pool of {k_cache.shape[0]} blocks of {k_cache.shape[1]}")
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(str(d) for d in devices)}")


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write key, value [num_tokens, num_kv_heads, head_dim] into the pools at slot_mapping [num_tokens]; -1 skips.

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], changed in place.
    """
    validate_cache_write_inputs(key, value, k_cache, v_cache, slot_mapping)
    launch_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def launch_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """reshape_and_cache's launch alone, for inputs that validate_cache_write_inputs already passed.

    The engine checks a pass's first layer and launches the others directly: they have the same shapes, and the
    slot check would read slot_mapping back from the GPU once per layer.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    check_mode(key.device)
    slot_mapping = slot_mapping.contiguous()
    with triton_language_as(interpreted=RUNS_IN_INTERPRETER):
        reshape_and_cache_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0),
            value.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads, NUM_KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1])
