"""Chapter 14's measurements of 8-bit KV caches: capacity in a byte budget, and what quantising costs the model."""

import pytest

from kvlab.analysis.kv_size import load_model_config
from kvlab.benchmarks.quantization import (
    compare_capacity,
    compare_kv_formats,
    greedy_agreement,
    held_out_prompts,
    held_out_text,
    logit_and_perplexity_change,
    tokens_that_fit,
)
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


# --- per block against per token, on text the model never trained on ------------------------

def test_held_out_prompts_come_from_the_validation_split_and_are_seeded():
    """The last 10 % of the shipped text (tools/train_model.py validates on it, never trains on it)."""
    text = (ASSETS_DIR / "text" / "shakespeare.txt").read_text(encoding="utf-8")
    held = held_out_text()
    assert held == text[int(0.9 * len(text)):] and len(held) > 100_000
    prompts = held_out_prompts(5, prompt_chars=32, seed=3)
    assert prompts == held_out_prompts(5, prompt_chars=32, seed=3) != held_out_prompts(5, prompt_chars=32, seed=4)
    assert all(len(p) == 32 and p in held for p in prompts)
    with pytest.raises(ValueError, match="num_prompts"):
        held_out_prompts(0)


def test_greedy_agreement_counts_positions_and_reuses_the_reference(embedded):
    """Four held-out prompts, 24 tokens: the counts are consistent, and the reference run is shared."""
    model, tokenizer = embedded
    prompts = held_out_prompts(4, prompt_chars=40)
    first, reference = greedy_agreement(model, tokenizer, prompts, "int8", max_tokens=24)
    second, same_reference = greedy_agreement(model, tokenizer, prompts, "int8_per_token_head", max_tokens=24,
                                              reference=reference)
    assert same_reference is reference and len(reference) == 4 and all(len(r) == 24 for r in reference)
    for a in (first, second):
        assert a.num_tokens == 96 and a.num_requests == 4
        assert a.tokens_before_divergence <= a.equal_tokens <= a.num_tokens
        assert a.identical_requests * 24 <= a.tokens_before_divergence
        assert a.share_equal == a.equal_tokens / 96
    assert first.kv_cache_dtype == "int8" and second.kv_cache_dtype == "int8_per_token_head"


def test_compare_kv_formats_reports_bytes_scales_and_both_measurements(embedded):
    model, tokenizer = embedded
    rows = compare_kv_formats(model, tokenizer, ("int8", "int8_per_token_head"), num_prompts=2, max_tokens=8,
                              perplexity_chars=256)
    by_name = {r.kv_cache_dtype: r for r in rows}
    assert by_name["int8"].scale_granularity == "block" and by_name["int8_per_token_head"].scale_granularity == "token"
    assert by_name["int8"].bytes_per_token == 1028 and by_name["int8_per_token_head"].bytes_per_token == 1088
    assert by_name["int8_per_token_head"].llama3_8b_bytes_per_token == 2 * 32 * 8 * (128 + 4)
    for row in rows:
        assert row.agreement.num_tokens == 16 and row.perplexity.num_tokens == 256
        assert abs(row.perplexity.relative_perplexity_change) < 0.01, row.perplexity
