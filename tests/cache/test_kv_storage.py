"""The paged cache as storage x attention backend: every storage format read by every backend, swapped and copied.

Storage formats (kvlab.cache.kv_storage): "auto" (the model's dtype), "int8", "fp8_e4m3" (alias "fp8").
Attention backends (kvlab.cache.attention_backends): "reference" (Chapter 3), "torch" (batched), "triton"
(the kernel, in Triton's interpreter on CPU). Tolerances were measured on this test's data, 5 seeds:

  same storage, another backend      max |diff| 4.8e-7 (fp32 summation order); tolerance 1e-5
  8-bit storage vs the fp32 cache    int8 at most 0.044, fp8 at most 0.122 (q, k, v ~ N(0, 1),
                                     head dim 32, three passes with prefill chunks and decodes);
                                     tolerances 0.08 and 0.25, about twice that
"""

import pytest
import torch

import kvlab.kernels  # noqa: F401  (on a CPU-only machine this switches Triton to its interpreter)
from kvlab.analysis.kv_size import kv_shape
from kvlab.cache.kv_storage import KV_CACHE_DTYPES, block_bytes, resolve_kv_cache_dtype
from kvlab.cache.paged_cache import PagedKVCache, copy_blocks
from kvlab.cache.ragged_batch import BatchLayout
from kvlab.cache.swap import SwapSpace

STORAGES = ["auto", "int8", "fp8"]
BACKENDS = ["reference", "torch", "triton"]
TOL_VS_FP32 = {"auto": 1e-5, "int8": 0.08, "fp8": 0.25}
TOL_BACKENDS = 1e-5
HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 32, 8
NUM_BLOCKS = 14
# Three sequences; each pass gives each some new tokens (1 = a decode). Pass 2 mixes a prefill chunk with decodes.
PASSES = [[3, 10, 17], [1, 8, 1], [1, 1, 1]]


def _tables(seed):
    """Shuffled block tables covering every sequence's final length."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    totals = [sum(p[i] for p in PASSES) for i in range(3)]
    tables, used = [], 0
    for n in totals:
        k = -(-n // BLOCK)
        tables.append(perm[used:used + k])
        used += k
    return tables


def _run(kv_cache_dtype, attention_backend, seed):
    """Every pass's attention output [T, H, D] on a one-layer cache, the same random q, k, v for every combination."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, NUM_BLOCKS, BLOCK, KV_HEADS, DIM, kv_cache_dtype=kv_cache_dtype,
                         attention_backend=attention_backend)
    tables = _tables(seed)
    done = [0, 0, 0]
    outs = []
    for query_lens in PASSES:
        slots = [t[p // BLOCK] * BLOCK + p % BLOCK
                 for t, d, n in zip(tables, done, query_lens) for p in range(d, d + n)]
        done = [d + n for d, n in zip(done, query_lens)]
        cache.set_batch(BatchLayout(list(query_lens), list(done), tables, torch.tensor(slots)))
        t = sum(query_lens)
        q = torch.randn(1, HEADS, t, DIM, generator=g)
        k, v = torch.randn(1, KV_HEADS, t, DIM, generator=g), torch.randn(1, KV_HEADS, t, DIM, generator=g)
        outs.append(cache.attend(0, q, k, v, DIM ** -0.5)[0])
    return cache, outs


def _max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kv_cache_dtype", STORAGES)
def test_every_backend_reads_every_storage_like_the_fp32_reference(kv_cache_dtype, seed):
    """Shuffled block tables, prefill chunks and decodes: all three backends agree, and stay near the fp32 cache."""
    _, reference = _run("auto", "reference", seed)
    outs = {b: _run(kv_cache_dtype, b, seed)[1] for b in BACKENDS}
    for backend in BACKENDS:
        assert [o.shape for o in outs[backend]] == [(sum(p), HEADS, DIM) for p in PASSES]
        between = _max_diff(outs[backend], outs["reference"])
        assert between < TOL_BACKENDS, f"{kv_cache_dtype}: {backend} is {between:.2e} from the reference backend"
        vs_fp32 = _max_diff(outs[backend], reference)
        assert vs_fp32 < TOL_VS_FP32[kv_cache_dtype], (
            f"{kv_cache_dtype} x {backend}: {vs_fp32:.3f} from the fp32 cache, expected < "
            f"{TOL_VS_FP32[kv_cache_dtype]}")


def test_half_precision_storage_in_the_model_dtype():
    """'auto' with a bfloat16 model keeps bfloat16 pools; the torch backend equals the reference to bf16 rounding."""
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(12, KV_HEADS, DIM, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(1, HEADS, 1, DIM, generator=g).bfloat16()
    outs = []
    for backend in ("reference", "torch"):
        cache = PagedKVCache(1, 4, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16, attention_backend=backend)
        assert cache.k_pools[0].dtype == torch.bfloat16 and cache.kv_cache_dtype == "auto" and cache.k_scales == []
        cache.write(0, k[:11], v[:11], torch.arange(11))
        cache.set_batch(BatchLayout([1], [12], [[0, 1]], torch.tensor([11])))  # the 12th token decodes
        outs.append(cache.attend(0, q, k[11:].transpose(0, 1)[None], v[11:].transpose(0, 1)[None], DIM ** -0.5))
    assert outs[1].dtype == torch.bfloat16
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=2e-2, rtol=2e-2)


# --- bytes: one formula, and the pools obey it ------------------------------------------------

@pytest.mark.parametrize("kv_cache_dtype, stored", [("auto", "float32"), ("int8", "int8"), ("fp8", "fp8_e4m3")])
def test_nbytes_is_block_bytes_times_blocks(embedded, kv_cache_dtype, stored):
    """The cache's own bytes (pools and scales) equal block_bytes, the formula the engine sizes its pool with."""
    model, _ = embedded
    cache = PagedKVCache.for_model(model, 6, 16, kv_cache_dtype=kv_cache_dtype)
    assert cache.nbytes == 6 * block_bytes(model.config, stored, 16)
    shape = kv_shape(model.config)
    per_head = 16 * shape["head_dim"] * (4 if stored == "float32" else 1) + (0 if stored == "float32" else 4)
    assert block_bytes(model.config, stored, 16) == 2 * shape["num_layers"] * shape["num_kv_heads"] * per_head


# --- copy-on-write and swap move the scales with the values -----------------------------------

def _filled(kv_cache_dtype, attention_backend="reference", seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(2, 6, 4, KV_HEADS, DIM, kv_cache_dtype=kv_cache_dtype, attention_backend=attention_backend)
    for layer in range(2):
        x = torch.randn(16, KV_HEADS, DIM, generator=g) * torch.tensor([0.5, 4.0])[None, :, None]
        cache.write(layer, x, -2 * x, torch.arange(16))  # blocks 0-3 full, each with its own scales
    return cache


@pytest.mark.parametrize("kv_cache_dtype", STORAGES)
def test_copy_blocks_carries_the_scales(kv_cache_dtype):
    cache = _filled(kv_cache_dtype)
    copy_blocks(cache, [(1, 4), (3, 5)])
    for layer in range(2):
        k, v = cache.dequantized(layer)
        assert torch.equal(k[4], k[1]) and torch.equal(v[5], v[3])
    for scales in cache.k_scales + cache.v_scales:
        assert torch.equal(scales[4], scales[1]) and torch.equal(scales[5], scales[3])


@pytest.mark.parametrize("kv_cache_dtype", STORAGES)
def test_swap_out_and_in_restores_values_and_scales(kv_cache_dtype):
    """Blocks swapped out, overwritten on the device, swapped back into other blocks: the same real values."""
    cache = _filled(kv_cache_dtype)
    before = [[t.clone() for t in cache.dequantized(layer)] for layer in range(2)]
    swap = SwapSpace(cache, 3)
    assert swap.block_bytes == cache.nbytes // cache.num_blocks, "a CPU block costs what a device block does"
    assert len(swap.blocks) == len(cache.storage.block_tensors()) == (4 if kv_cache_dtype == "auto" else 8)
    swap.swap_out([(2, 1), (0, 2)])
    for layer in range(2):  # the device blocks are reused by someone else meanwhile
        cache.write(layer, 9 * torch.ones(8, KV_HEADS, DIM), torch.ones(8, KV_HEADS, DIM), torch.arange(8))
    swap.swap_in([(1, 5), (2, 4)])
    for layer in range(2):
        k, v = cache.dequantized(layer)
        assert torch.equal(k[5], before[layer][0][2]) and torch.equal(v[4], before[layer][1][0])
    assert swap.blocks_swapped_out == swap.blocks_swapped_in == 2


# --- names and bad input ----------------------------------------------------------------------

def test_kv_cache_dtype_names():
    assert KV_CACHE_DTYPES == ("auto", "int8", "fp8_e4m3", "int8_per_token_head", "fp8_per_token_head")
    names = ("auto", "int8", "fp8", "fp8_e4m3", "int8_per_token_head", "fp8_per_token_head")
    assert [resolve_kv_cache_dtype(n) for n in names] == ["auto", "int8", "fp8_e4m3", "fp8_e4m3",
                                                          "int8_per_token_head", "fp8_per_token_head"]
    assert PagedKVCache(1, 2, 4, 1, 16, kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    assert PagedKVCache(1, 2, 4, 1, 16, kv_cache_dtype="fp8").k_pools[0].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("bad", ["float16", "fp16", "int4", "fp8_e5m2", "", None, torch.int8, ["int8"]])
def test_bad_kv_cache_dtype_names_the_choices(bad):
    with pytest.raises(ValueError, match="one of auto, int8, fp8, fp8_e4m3"):
        PagedKVCache(1, 2, 4, 1, 16, kv_cache_dtype=bad)


def test_bad_attention_backend_names_the_choices():
    with pytest.raises(ValueError, match="attention_backend must be one of auto, reference, torch, triton"):
        PagedKVCache(1, 2, 4, 1, 16, attention_backend="cuda")


def test_the_old_decode_backend_keyword_still_works_and_names_the_new_one():
    with pytest.warns(DeprecationWarning, match="decode_backend is now called attention_backend"):
        cache = PagedKVCache(1, 2, 4, 1, 16, decode_backend="torch")
    assert cache.attention_backend == "torch"


def test_one_cache_class_takes_both_knobs():
    """The composed cache: any storage format with any backend; 'auto' is the kernel on CUDA, batched torch here."""
    cache = PagedKVCache(1, 2, 4, 1, 16, kv_cache_dtype="int8", attention_backend="auto")
    assert cache.attention_backend == ("triton" if torch.cuda.is_available() else "torch")
    assert cache.kv_cache_dtype == "int8" and cache.k_scales[0].shape == (2, 1)
    assert PagedKVCache(1, 2, 4, 1, 16).attention_backend == "reference", "Chapter 3's cache: the per-sequence path"
