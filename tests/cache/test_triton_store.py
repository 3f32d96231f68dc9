"""The Triton backend's cache write: float pools are stored by Chapter 7's kernel (kvlab.kernels.reshape_and_cache).

Every backend writes a layer's new K/V in do_kv_cache_update before it attends (vLLM's split of the cache
write from the attention). The reference and torch backends write through the storage (a torch index); the
Triton backend launches the store kernel on float pools and keeps the storage's own write for 8-bit ones,
whose scales are decided while writing. On CPU the kernels run in Triton's interpreter: shapes stay tiny.
"""

import pytest
import torch

import kvlab.kernels  # noqa: F401  (on a CPU-only machine this switches Triton to its interpreter)
from conftest import make_tiny_model
from kvlab import SamplingParams
from kvlab.cache.paged_cache import PagedKVCache
from kvlab.cache.ragged_batch import BatchLayout
from kvlab.engine.llm_engine import LLMEngine
from kvlab.kernels import cache_write, reshape_and_cache_reference

DEVICE = torch.device("cpu" if kvlab.kernels.RUNS_IN_INTERPRETER else "cuda")
HEADS, KV_HEADS, DIM, BLOCK, NUM_BLOCKS = 4, 2, 16, 4, 8
# Two passes over three sequences: prefill chunks crossing block boundaries, then a chunk beside two decodes.
TABLES = [[5, 1], [0, 7, 3], [6, 2]]
PASSES = [[3, 6, 2], [1, 3, 1]]


def _slots(done, query_lens):
    return [TABLES[i][p // BLOCK] * BLOCK + p % BLOCK
            for i, (d, n) in enumerate(zip(done, query_lens)) for p in range(d, d + n)]


def _passes(dtype, seed=0):
    """The passes' layouts and random q, k, v ([1, H, T, D], [1, Hkv, T, D] twice), the same for every backend."""
    gen = torch.Generator().manual_seed(seed)
    done, out = [0, 0, 0], []
    for query_lens in PASSES:
        slots = _slots(done, query_lens)
        done = [d + n for d, n in zip(done, query_lens)]
        t = sum(query_lens)
        qkv = [torch.randn(1, h, t, DIM, generator=gen).to(dtype).to(DEVICE) for h in (HEADS, KV_HEADS, KV_HEADS)]
        out.append((BatchLayout(list(query_lens), list(done), [list(t) for t in TABLES],
                                torch.tensor(slots, device=DEVICE)), qkv))
    return out


def _cache(backend, dtype=torch.float32, kv_cache_dtype="auto", num_layers=1):
    return PagedKVCache(num_layers, NUM_BLOCKS, BLOCK, KV_HEADS, DIM, dtype=dtype, device=DEVICE,
                        kv_cache_dtype=kv_cache_dtype, attention_backend=backend)


def _run(cache, passes, layers=(0,)):
    for layout, (q, k, v) in passes:
        cache.set_batch(layout)
        for layer in layers:
            cache.attend(layer, q, k, v, DIM ** -0.5)
        cache.finish_pass()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_backend_stores_exactly_what_the_torch_backend_and_the_reference_store(dtype):
    passes = _passes(dtype)
    triton_cache, torch_cache = _cache("triton", dtype), _cache("torch", dtype)
    expected_k = torch.zeros_like(triton_cache.k_pools[0])
    expected_v = torch.zeros_like(expected_k)
    for n, (layout, (q, k, v)) in enumerate(passes):
        _run(triton_cache, [(layout, (q, k, v))])
        _run(torch_cache, [(layout, (q, k, v))])
        reshape_and_cache_reference(k[0].transpose(0, 1), v[0].transpose(0, 1), expected_k, expected_v,
                                    layout.slot_mapping)
        for name, pools in (("torch backend", torch_cache), ("reshape_and_cache_reference", None)):
            want_k, want_v = (pools.k_pools[0], pools.v_pools[0]) if pools else (expected_k, expected_v)
            assert torch.equal(triton_cache.k_pools[0], want_k) and torch.equal(triton_cache.v_pools[0], want_v), (
                f"after pass {n} ({dtype}) the Triton backend's pools differ from the {name}'s: the store kernel must "
                "put every new token's K and V rows at its slot and change nothing else")


def test_the_triton_write_is_the_store_kernel_not_the_storage(monkeypatch):
    """Per pass the first layer calls reshape_and_cache (checked), the others its launch; the storage never writes."""
    calls = []
    real_checked, real_launch = kvlab.kernels.reshape_and_cache, cache_write.launch_reshape_and_cache

    def checked(key, *args):
        calls.append(("reshape_and_cache", key.shape[0]))
        return real_checked(key, *args)

    def launch(key, *args):
        calls.append(("launch", key.shape[0]))
        return real_launch(key, *args)

    def storage_write(*args, **kwargs):
        raise AssertionError("the Triton backend wrote float pools through KVStorage.write, not the store kernel")

    monkeypatch.setattr(kvlab.kernels, "reshape_and_cache", checked)
    monkeypatch.setattr(cache_write, "launch_reshape_and_cache", launch)
    cache = _cache("triton", num_layers=2)
    monkeypatch.setattr(cache.storage, "write", storage_write)
    _run(cache, _passes(torch.float32), layers=(0, 1))
    # reshape_and_cache is validate + launch_reshape_and_cache, so layer 0 shows both; layer 1 only launches.
    per_pass = [[("reshape_and_cache", n), ("launch", n), ("launch", n)] for n in (11, 5)]
    assert calls == per_pass[0] + per_pass[1], (
        f"expected per pass (2 layers; 11 then 5 tokens) one checked call on layer 0 and a bare launch on layer 1, "
        f"got {calls}")
    calls.clear()
    monkeypatch.undo()
    monkeypatch.setattr(kvlab.kernels, "reshape_and_cache", checked)
    _run(_cache("torch"), _passes(torch.float32))
    assert calls == [], "the torch backend writes through the storage, not the store kernel"


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_8bit_storages_keep_their_own_write_on_the_triton_backend(kv_cache_dtype, monkeypatch):
    """Their scales are decided while writing: the triton backend stores the same bytes and scales as torch's."""
    def refuse(*args):
        raise AssertionError("an 8-bit pool was written by the float store kernel, which knows no scale")

    monkeypatch.setattr(kvlab.kernels, "reshape_and_cache", refuse)
    monkeypatch.setattr(cache_write, "launch_reshape_and_cache", refuse)
    passes = _passes(torch.float32)
    triton_cache, torch_cache = _cache("triton", kv_cache_dtype=kv_cache_dtype), _cache("torch",
                                                                                       kv_cache_dtype=kv_cache_dtype)
    _run(triton_cache, passes)
    _run(torch_cache, passes)
    for tensor, other in zip(triton_cache.storage.block_tensors(), torch_cache.storage.block_tensors()):
        assert torch.equal(tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor,
                           other.view(torch.uint8) if other.element_size() == 1 else other), (
            f"{kv_cache_dtype}: the Triton backend's pools or scales differ from the torch backend's")
    written = torch.cat([layout.slot_mapping for layout, _ in passes]).unique() // BLOCK
    assert bool((triton_cache.k_scales[0][written] > 1e-6).all()), "the written blocks' scales must have grown"


def test_bad_slots_raise_before_the_kernel_stores_anything():
    cache = _cache("triton")
    (layout, (q, k, v)), _ = _passes(torch.float32)
    before = [t.clone() for t in cache.storage.block_tensors()]
    bad = BatchLayout(layout.query_lens, layout.context_lens, layout.block_tables, layout.slot_mapping.clone())
    bad.slot_mapping[4] = NUM_BLOCKS * BLOCK
    with pytest.raises(ValueError, match=f"slot {NUM_BLOCKS * BLOCK} is outside the pool"):
        cache.set_batch(bad)
    # Called directly, without the paged cache's checks, the backend's first write of a pass checks them itself.
    with pytest.raises(ValueError, match="slot_mapping holds -5"):
        cache.attn_backend.do_kv_cache_update(cache.storage, 0, k[0].transpose(0, 1), v[0].transpose(0, 1),
                                              torch.full((k.shape[2],), -5, device=DEVICE))
    after = cache.storage.block_tensors()
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a refused write changed a pool"


def test_engine_on_the_triton_backend_stores_the_torch_engines_pools_and_tokens():
    """Greedy tokens equal; K/V agree to float32 rounding (attention's summation order differs between paths)."""
    model = make_tiny_model("llama").to(DEVICE)
    prompts = [[5, 9, 13, 2, 7, 11], [4, 8, 15]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engines, tokens = {}, {}
    for backend in ("triton", "torch"):
        engine = LLMEngine(model, None, block_size=4, num_blocks=8, max_num_seqs=2, attention_backend=backend)
        for i, prompt in enumerate(prompts):
            engine.add_request(i, prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[backend, out.request_id] = out.outputs[0].token_ids
        engines[backend] = engine
    for i in range(len(prompts)):
        assert tokens["triton", str(i)] == tokens["torch", str(i)], f"request {i}: the two backends' tokens differ"
    for layer in range(model.config.num_hidden_layers):
        for pools in ("k_pools", "v_pools"):
            ours, theirs = getattr(engines["triton"].cache, pools)[layer], getattr(engines["torch"].cache, pools)[layer]
            assert ours.abs().sum() > 0, "the Triton engine stored nothing"
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5,
                                       msg=f"layer {layer} {pools}: the Triton engine stored other K/V than torch's")

