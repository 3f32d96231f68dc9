"""Chapter 14: vLLM's 8-bit KV formats with a scale per (token, KV head), beside kvlab's per-(block, KV head) ones.

vLLM spells them int8_per_token_head and fp8_per_token_head (vllm/config/cache.py); the scale of each
token and KV head is found from that token's values when it is written, so nothing is rounded twice.
"""

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.analysis.kv_size import load_model_config
from kvlab.cache.kv_storage import PerTokenHeadKVStorage, block_bytes, make_kv_storage
from kvlab.cache.paged_cache import PagedKVCache, copy_blocks
from kvlab.cache.ragged_batch import BatchLayout
from kvlab.quantization import FP8_E4M3_MAX, INT8_MAX, SCALE_BYTES, SCALE_FLOOR, scale_granularity

FORMATS = ["int8_per_token_head", "fp8_per_token_head"]


def _written(kv_cache_dtype, num_tokens=10, seed=0, num_blocks=4, block_size=4, heads=2, dim=8):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, num_blocks, block_size, heads, dim, kv_cache_dtype=kv_cache_dtype)
    k, v = torch.randn(num_tokens, heads, dim, generator=g), torch.randn(num_tokens, heads, dim, generator=g)
    cache.write(0, k, v, torch.arange(num_tokens))
    return cache, k, v


# --- the bit layout ---------------------------------------------------------------------------

def test_int8_scale_is_each_tokens_head_amax_over_127_and_values_round_to_nearest():
    """Scales [num_blocks, block_size, Hkv]; stored = round(x / scale), so every element is within scale / 2."""
    cache, k, _ = _written("int8_per_token_head")
    assert isinstance(cache.storage, PerTokenHeadKVStorage) and cache.storage.scale_granularity == "token"
    assert cache.k_pools[0].dtype == torch.int8 and cache.k_scales[0].dtype == torch.float32
    assert cache.k_scales[0].shape == (4, 4, 2), "one scale per (block, slot, KV head)"
    scales = cache.k_scales[0].view(16, 2)[:10]                       # slot order = token order here
    torch.testing.assert_close(scales, k.abs().amax(dim=-1) / INT8_MAX)
    stored = cache.k_pools[0].view(16, 2, 8)[:10]
    assert torch.equal(stored, torch.round(k / scales[..., None]).to(torch.int8)), "int8 rounds to nearest"
    assert int(stored.abs().amax(dim=-1).min()) == INT8_MAX, "each token's largest |value| lands on 127"
    error = (cache.dequantized(0)[0].view(16, 2, 8)[:10] - k).abs()
    assert bool((error <= scales[..., None] / 2 + 1e-7).all()), "every element within half its token's scale"
    assert cache.storage.num_requantized == 0
    assert bool((cache.k_scales[0].view(16, 2)[10:] == SCALE_FLOOR).all()), "unwritten slots keep the floor"


def test_fp8_scale_maps_each_tokens_largest_value_to_448():
    cache, k, _ = _written("fp8_per_token_head")
    scales = cache.k_scales[0].view(16, 2)[:10]
    torch.testing.assert_close(scales, k.abs().amax(dim=-1) / FP8_E4M3_MAX)
    back = cache.dequantized(0)[0].view(16, 2, 8)[:10]
    assert bool(((back - k).abs() <= k.abs() / 16 + 1e-6).all()), "3 mantissa bits: relative error <= 1/16"


def test_a_large_token_costs_its_neighbours_nothing_unlike_a_per_block_scale():
    """One token 100x larger than the rest of its block: per token, the others keep their precision.

    With one scale per (block, head) the block's scale grows 100x and its small values round to a few steps.
    """
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 2, 64, generator=g)
    x[5] *= 100
    errors = {}
    for name in ("int8", "int8_per_token_head"):
        cache = PagedKVCache(1, 2, 16, 2, 64, kv_cache_dtype=name)
        cache.write(0, x, x, torch.arange(16))
        back = cache.dequantized(0)[0][0]                          # block 0: [16, 2, 64]
        errors[name] = float((back - x)[torch.arange(16) != 5].abs().max())
    assert errors["int8_per_token_head"] < 0.03 < 0.5 < errors["int8"], errors


def test_rewriting_a_slot_replaces_its_scale_and_leaves_the_others():
    cache, k, _ = _written("int8_per_token_head")
    before = cache.k_scales[0].clone()
    cache.write(0, 3 * k[:1], k[:1], torch.tensor([7]))
    after = cache.k_scales[0].view(16, 2)
    torch.testing.assert_close(after[7], 3 * k[0].abs().amax(dim=-1) / INT8_MAX)
    others = torch.arange(16) != 7
    assert torch.equal(after[others], before.view(16, 2)[others])


def test_gather_through_a_block_table_and_gather_slots_agree_with_the_dequantised_pool():
    cache, *_ = _written("int8_per_token_head", num_tokens=16)
    k_pool, v_pool = cache.dequantized(0)
    table = [2, 0, 3]
    k, v = cache.storage.gather(0, table, 10, torch.float32)                  # [Hkv, 10, D]
    expected = k_pool[torch.tensor(table)].flatten(0, 1)[:10].transpose(0, 1)
    torch.testing.assert_close(k, expected)
    slots = torch.tensor([9, 0, 15, 4])
    ks, vs = cache.storage.gather_slots(0, slots, torch.float32)              # [4, Hkv, D]
    torch.testing.assert_close(ks, k_pool.flatten(0, 1)[slots])
    torch.testing.assert_close(vs, v_pool.flatten(0, 1)[slots])


def test_copy_blocks_carries_the_per_token_scales():
    cache, *_ = _written("int8_per_token_head", num_tokens=8)
    copy_blocks(cache, [(1, 3)])
    assert torch.equal(cache.k_pools[0][3], cache.k_pools[0][1])
    assert torch.equal(cache.k_scales[0][3], cache.k_scales[0][1]) and torch.equal(cache.v_scales[0][3],
                                                                                   cache.v_scales[0][1])


# --- bytes --------------------------------------------------------------------------------------

def test_bytes_count_a_float32_scale_per_token_per_head_for_k_and_v(embedded):
    """Embedded model (4 layers, 2 KV heads, dim 64): 1,024 bytes of values + 64 of scales per token.

    Per block (kvlab's int8) the scales cost 4 bytes per token at block size 16; per token 64.
    """
    model, _ = embedded
    cache = PagedKVCache.for_model(model, 8, 16, kv_cache_dtype="int8_per_token_head")
    assert cache.bytes_per_token() == 2 * 4 * 2 * 64 + 2 * 4 * 2 * SCALE_BYTES == 1088
    assert block_bytes(model.config, "int8_per_token_head", 16) == cache.nbytes / 8 == 16 * 1088
    llama3 = load_model_config("llama-3-8b")
    assert block_bytes(llama3, "int8_per_token_head") == 2 * 32 * 8 * 16 * (128 + 4)
    assert block_bytes(llama3, "fp8_per_token_head") == block_bytes(llama3, "int8_per_token_head")
    assert block_bytes(llama3, "int8") == 2 * 32 * 8 * (16 * 128 + 4)
    assert block_bytes(llama3, "float16") / block_bytes(llama3, "int8_per_token_head") == pytest.approx(256 / 132)


# --- bad input ----------------------------------------------------------------------------------

def test_the_name_lists_every_format_when_it_is_wrong():
    with pytest.raises(ValueError, match="int8_per_token_head, fp8_per_token_head"):
        make_kv_storage("int4_per_token_head", 1, 2, 16, 2, 8)
    with pytest.raises(ValueError, match="unsupported kv_cache_dtype 'int8_per_token'"):
        scale_granularity("int8_per_token")
    assert scale_granularity("int8") == "block" and scale_granularity("fp8_per_token_head") == "token"
    with pytest.raises(ValueError, match="QuantizedKVStorage"):
        PerTokenHeadKVStorage(1, 2, 16, 2, 8, kv_cache_dtype="int8")


def test_fixed_scales_are_refused_since_each_token_brings_its_own():
    cache, *_ = _written("int8_per_token_head")
    with pytest.raises(ValueError, match="computes a scale for every token"):
        cache.storage.set_scales(0, 0.1, 0.1)


def test_the_triton_kernels_are_refused_with_the_way_out_and_auto_picks_torch():
    cache, *_ = _written("int8_per_token_head")
    with pytest.raises(ValueError, match="use attention_backend 'torch' or 'reference'"):
        cache.storage.kernel_inputs(0)
    auto = PagedKVCache(1, 2, 16, 2, 8, kv_cache_dtype="int8_per_token_head", attention_backend="auto")
    assert auto.attention_backend == "torch"


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_nan_is_rejected_and_nothing_is_stored(kv_cache_dtype):
    cache, k, v = _written(kv_cache_dtype)
    pools = [p.view(torch.uint8).clone() for p in cache.k_pools + cache.v_pools]
    scales = [s.clone() for s in cache.k_scales + cache.v_scales]
    bad = k[:2].clone()
    bad[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        cache.write(0, bad, v[:2], torch.tensor([0, 1]))
    # Inside a forward pass the check is deferred to the pass's end, and the pass stores nothing either.
    cache.set_batch(BatchLayout([2], [2], [[0]], torch.tensor([0, 1])))
    cache.attend(0, torch.randn(1, 2, 2, 8), bad.transpose(0, 1)[None], v[:2].transpose(0, 1)[None], 0.3)
    with pytest.raises(ValueError, match="nothing of this pass was stored"):
        cache.finish_pass()
    assert all(torch.equal(a.view(torch.uint8), b) for a, b in zip(cache.k_pools + cache.v_pools, pools))
    assert all(torch.equal(a, b) for a, b in zip(cache.k_scales + cache.v_scales, scales))


# --- the engine ------------------------------------------------------------------------------

def test_the_engine_runs_per_token_head_and_follows_full_precision(embedded):
    """LLM(kv_cache_dtype="int8_per_token_head"): 8-bit pools, per-token scales, the pool back empty after.

    Measured on these three prompts, 48 greedy tokens each: identical to the float32 cache's output.
    """
    model, tokenizer = embedded
    prompts = ["HAMLET.\nTo be, or not", "ROMEO.\n", "KING LEAR.\nNothing will come"]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    auto = [o.outputs[0].token_ids for o in LLM(model, tokenizer, num_blocks=32).generate(prompts, params)]
    llm = LLM(model, tokenizer, num_blocks=32, kv_cache_dtype="int8_per_token_head")
    cache = llm.llm_engine.cache
    assert llm.llm_engine.kv_cache_dtype == "int8_per_token_head" and cache.k_pools[0].dtype == torch.int8
    assert cache.k_scales[0].shape == (32, 16, model.config.num_key_value_heads)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    equal = sum(a == b for x, y in zip(auto, got) for a, b in zip(x, y))
    assert equal >= 0.9 * 3 * 48, f"{equal} of {3 * 48} greedy tokens equal the float32 cache's"


def test_the_engine_refuses_vllms_int4_per_token_head_by_name(embedded):
    model, tokenizer = embedded
    with pytest.raises(ValueError, match="unsupported kv_cache_dtype 'int4_per_token_head'"):
        LLM(model, tokenizer, num_blocks=8, kv_cache_dtype="int4_per_token_head")


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_keeps_the_output_with_per_token_scales(embedded, preemption_mode):
    """8 blocks for 4 requests: preempted and resumed (recomputed, or swapped out and in with their per-token
    scales), every output equals the roomy pool's."""
    model, tokenizer = embedded
    prompts = ["OTHELLO.\n", "HAMLET.\nTo be, or not", "KING LEAR.\nNothing will come of nothing.\n", "ROMEO.\n"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(model, tokenizer, num_blocks=64, kv_cache_dtype="int8_per_token_head")
    tight = LLM(model, tokenizer, num_blocks=8, max_num_seqs=4, kv_cache_dtype="int8_per_token_head",
                preemption_mode=preemption_mode)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.llm_engine.scheduler.num_preemptions > 0, "set-up: the tight pool must preempt"
    assert got == expected
