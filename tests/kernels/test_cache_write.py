"""The cache write (vLLM's reshape_and_cache): a step's K/V rows land at their slots, padding rows (-1) nowhere.

In Triton's interpreter on CPU; the kernel is held to the torch write kvlab's engine uses (KVStorage.write),
and that write to the engine's own slot mapping (build_batch) for a ragged step.
"""

import pytest
import torch

from kvlab.cache.kv_storage import KVStorage
from kvlab.cache.ragged_batch import SequenceChunk, build_batch
from kvlab.kernels import reshape_and_cache, reshape_and_cache_reference
from kvlab.kernels.interpreter import RUNS_IN_INTERPRETER

DEVICE = torch.device("cpu" if RUNS_IN_INTERPRETER else "cuda")


def pools(num_blocks=6, block_size=8, num_kv_heads=2, head_dim=32, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    first, second = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    return first.to(dtype).to(DEVICE), second.to(dtype).to(DEVICE)


def rows(num_tokens, num_kv_heads=2, head_dim=32, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_tokens, num_kv_heads, head_dim)
    first, second = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    return first.to(dtype).to(DEVICE), second.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads, head_dim, block_size", [(2, 32, 8), (3, 80, 16), (1, 16, 4)])
def test_kernel_writes_what_the_torch_write_writes(dtype, num_kv_heads, head_dim, block_size):
    k_cache, v_cache = pools(5, block_size, num_kv_heads, head_dim, dtype)
    key, value = rows(7, num_kv_heads, head_dim, dtype)
    # Slots out of order, a block boundary crossed, two padding rows.
    slots = torch.tensor([3 * block_size + block_size - 1, 4 * block_size, -1, 0, block_size + 2, -1, 2 * block_size],
                         dtype=torch.int64, device=DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reshape_and_cache_reference(key, value, expected_k, expected_v, slots)
    key_before, value_before = key.clone(), value.clone()
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v), (
        "the kernel's pools differ from the torch write's: every non-padding row must land at its slot, "
        "nothing else may change")
    assert torch.equal(key, key_before) and torch.equal(value, value_before), "the cache write changed its inputs"


def test_padding_rows_write_nothing_and_every_other_slot_keeps_its_value():
    k_cache, v_cache = pools()
    key, value = rows(4)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    reshape_and_cache(key, value, k_cache, v_cache, torch.full((4,), -1, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v), "a slot of -1 must write nothing"


def test_the_engine_step_written_by_the_kernel_equals_the_engine_write():
    """A ragged step (prefix hit + chunk, a decode, a fresh prompt), the engine's slots, padded with -1 as vLLM does."""
    block_size, num_kv_heads, head_dim = 4, 2, 16
    chunks = [SequenceChunk([1] * 3, start=5, block_table=[4, 0]),    # prefix hit of 5, chunk of 3 across a boundary
              SequenceChunk([1], start=12, block_table=[1, 6, 2, 5]),  # a decode
              SequenceChunk([1] * 4, start=0, block_table=[3])]        # a fresh prompt filling one block
    slots = build_batch(chunks, block_size).layout.slot_mapping
    assert slots.tolist() == [1, 2, 3, 20, 12, 13, 14, 15], "the engine's slot mapping for this step changed"
    storage = KVStorage(1, 7, block_size, num_kv_heads, head_dim, device=DEVICE)
    key, value = rows(len(slots), num_kv_heads, head_dim)
    storage.write(0, key, value, slots)
    k_cache, v_cache = torch.zeros_like(storage.k_pools[0]), torch.zeros_like(storage.v_pools[0])
    padded = torch.cat([slots, torch.full((3,), -1, dtype=torch.int64)]).to(DEVICE)
    pad_rows = torch.full((3, num_kv_heads, head_dim), float("nan"), device=DEVICE)
    reshape_and_cache(torch.cat([key, pad_rows]), torch.cat([value, pad_rows]), k_cache, v_cache, padded)
    assert torch.equal(k_cache, storage.k_pools[0]) and torch.equal(v_cache, storage.v_pools[0]), (
        "the kernel must write exactly what the engine's KVStorage.write writes (padding rows hold NaN: none may land)")


@pytest.mark.parametrize("change, message", [
    (dict(slots=torch.tensor([0, 48], dtype=torch.int64)), "slot_mapping holds 48"),
    (dict(slots=torch.tensor([0, -2], dtype=torch.int64)), "slot_mapping holds -2"),
    (dict(slots=torch.tensor([0, 1], dtype=torch.int32)), "must be int64"),
    (dict(slots=torch.tensor([0], dtype=torch.int64)), "must be int64 \\[2\\]"),
    (dict(key=torch.zeros(2, 3, 32)), "must have the same shape"),
    (dict(key=torch.zeros(2, 2, 32, dtype=torch.float64), value=torch.zeros(2, 2, 32, dtype=torch.float64)),
     "takes float32"),
])
def test_bad_input_is_refused_with_what_was_wrong(change, message):
    k_cache, v_cache = pools()
    key, value = rows(2)
    args = dict(key=key, value=value, slots=torch.tensor([0, 1], dtype=torch.int64))
    args.update({name: t.to(DEVICE) for name, t in change.items()})
    with pytest.raises(ValueError, match=message):
        reshape_and_cache(args["key"], args["value"], k_cache, v_cache, args["slots"])
