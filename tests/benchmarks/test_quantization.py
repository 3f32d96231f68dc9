"""Chapter 10's measurements of 8-bit KV caches: capacity in a byte budget, and what quantising costs the model."""

import pytest

from kvlab.analysis.kv_size import load_model_config
from kvlab.benchmarks.quantization import compare_capacity, logit_and_perplexity_change, tokens_that_fit
from kvlab.cache.kv_storage import block_bytes
from kvlab.cache.paged_cache import PagedKVCache
from kvlab.paths import ASSETS_DIR


@pytest.mark.parametrize("kv_cache_dtype, max_logit, mean_logit, max_ppl_change, min_top1", [
    ("int8", 0.5, 0.03, 0.002, 0.99),
    ("fp8", 1.5, 0.1, 0.01, 0.95),
])
def test_logit_and_perplexity_change_on_shakespeare(embedded, kv_cache_dtype, max_logit, mean_logit, max_ppl_change,
                                                    min_top1):
    """512 characters of the shipped text, teacher-forced in chunks of 8: logits and perplexity barely move.

    Measured on 3 stretches (offsets 10,000, 200,000, 600,000): int8 max |dlogit| 0.18-0.23, mean 0.012,
    perplexity change -0.02% to +0.04%, top-1 agreement 99.8-100%; fp8 max 0.61-0.77, mean 0.047-0.051,
    +0.11% to +0.15%, top-1 97.8-99.6%. Perplexity of the fp32 cache on the first stretch: 3.42.
    """
    model, tokenizer = embedded
    text = (ASSETS_DIR / "text" / "shakespeare.txt").read_text()[10_000:10_512]
    effect = logit_and_perplexity_change(model, tokenizer, text, kv_cache_dtype, chunk_size=8)
    assert effect.num_tokens == 512
    assert 2.0 < effect.perplexity_reference < 6.0, "the embedded model should predict Shakespeare well"
    assert effect.max_abs_logit_diff < max_logit and effect.mean_abs_logit_diff < mean_logit, effect
    assert abs(effect.relative_perplexity_change) < max_ppl_change, effect
    assert effect.top1_agreement >= min_top1, effect


def test_capacity_about_twice_fp16_and_four_times_fp32_minus_the_scales():
    """Llama-3-8B in 1 GiB: fp16 blocks of 2 MiB, int8 blocks of 2 x 32 x 8 x (16 x 128 + 4) bytes."""
    config = load_model_config("llama-3-8b")
    fp16_block = 16 * 2 * 32 * 8 * 128 * 2
    int8_block = 2 * 32 * 8 * (16 * 128 * 1 + 4)
    assert block_bytes(config, "float16") == fp16_block == 2 * 1024 ** 2
    assert block_bytes(config, "int8") == block_bytes(config, "fp8") == int8_block
    cmp = compare_capacity(config, 1024 ** 3, "int8", "float16")
    assert cmp.baseline_tokens == (1024 ** 3 // fp16_block) * 16 == 8192
    assert cmp.quantized_tokens == (1024 ** 3 // int8_block) * 16 == 16352
    assert 1.99 < cmp.ratio < 2.0
    vs_fp32 = compare_capacity(config, 1024 ** 3, "int8", "float32")
    assert 3.98 < vs_fp32.ratio < 4.0
    assert tokens_that_fit(config, 0, "int8") == 0


def test_unsupported_dtype_in_capacity_and_measurement(embedded):
    model, tokenizer = embedded
    with pytest.raises(ValueError, match="unsupported kv_cache_dtype 'int4'"):
        block_bytes(load_model_config("llama-3-8b"), "int4")
    with pytest.raises(ValueError, match="supported: int8, fp8, fp8_e4m3"):
        logit_and_perplexity_change(model, tokenizer, "To be", "int4")
    with pytest.raises(ValueError, match="chunk_size"):
        logit_and_perplexity_change(model, tokenizer, "To be", "int8", chunk_size=0)
    with pytest.raises(ValueError, match="one of auto, int8, fp8, fp8_e4m3"):
        PagedKVCache.for_model(model, 4, 16, kv_cache_dtype="float64")
    with pytest.raises(ValueError, match="must not be negative"):
        tokens_that_fit(load_model_config("llama-3-8b"), -1, "int8")
