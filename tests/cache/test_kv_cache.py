"""Chapter 1: reference attention, the naive cache and the runner hook equal transformers' generate."""

import pytest
import torch

from conftest import FAMILIES, make_tiny_model
from kvlab.baselines.transformers_generate import reference_generate
from kvlab.cache.attention import causal_attention
from kvlab.cache.naive_cache import NaiveKVCache
from kvlab.decoding.generate import generate_without_cache, greedy_generate
from kvlab.model.attention_hook import forward


def _sdpa_causal(q, k, v, scaling):
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    return torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scaling)[0]


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_prefill_attention_equals_torch_sdpa(heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(heads, 7, 16, generator=g)
    k, v = torch.randn(kv_heads, 7, 16, generator=g), torch.randn(kv_heads, 7, 16, generator=g)
    out = causal_attention(q, k, v, 0.25)
    torch.testing.assert_close(out, _sdpa_causal(q, k, v, 0.25).transpose(0, 1))


def test_decode_attention_equals_last_row_of_prefill():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 9, 8, generator=g)
    k, v = torch.randn(2, 9, 8, generator=g), torch.randn(2, 9, 8, generator=g)
    full = causal_attention(q, k, v, 0.3)
    last = causal_attention(q[:, -3:], k, v, 0.3)
    torch.testing.assert_close(last, full[-3:])


def test_attention_rejects_more_queries_than_keys_and_uneven_groups():
    with pytest.raises(ValueError, match="append the new K/V"):
        causal_attention(torch.zeros(2, 3, 4), torch.zeros(2, 2, 4), torch.zeros(2, 2, 4), 1.0)
    with pytest.raises(ValueError, match="evenly"):
        causal_attention(torch.zeros(3, 1, 4), torch.zeros(2, 2, 4), torch.zeros(2, 2, 4), 1.0)


def test_naive_cache_grows_per_layer_and_counts_bytes():
    cache = NaiveKVCache(2)
    cache.update(0, torch.ones(2, 3, 4), torch.ones(2, 3, 4))
    k, v = cache.update(0, torch.zeros(2, 1, 4), torch.zeros(2, 1, 4))
    assert k.shape == (2, 4, 4) and cache.num_tokens == 4 and cache.k[1] is None
    assert cache.nbytes == 2 * 2 * 4 * 4 * 4
    with pytest.raises(ValueError, match="positive integer"):
        NaiveKVCache(0)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_greedy_on_naive_cache_equals_transformers_generate(family, kv_heads):
    model = make_tiny_model(family, num_kv_heads=kv_heads)
    prompt = [5, 17, 3, 42, 8, 1]
    expected = reference_generate(model, prompt, 40)
    assert greedy_generate(model, prompt, 40) == expected
    assert generate_without_cache(model, prompt, 40) == expected


def test_embedded_model_equals_transformers_generate(embedded):
    model, tokenizer = embedded
    for text in ["ROMEO:\n", "First Citizen:\nBefore we proceed any further, hear me speak."]:
        ids = tokenizer(text)["input_ids"]
        assert greedy_generate(model, ids, 80) == reference_generate(model, ids, 80), text


def test_the_model_keeps_no_cache_and_its_attention_setting_is_restored(embedded):
    model, tokenizer = embedded
    cache = NaiveKVCache(model.config.num_hidden_layers)
    forward(model, [3, 4, 5], [0, 1, 2], cache)
    assert cache.num_tokens == 3, "every layer's K/V went to kvlab's cache"
    assert model.config._attn_implementation == "sdpa", "forward must restore the model's own attention"


def test_prompt_longer_than_context_is_rejected_before_the_cache_is_touched(embedded):
    model, _ = embedded
    limit = model.config.max_position_embeddings
    cache = NaiveKVCache(model.config.num_hidden_layers)
    with pytest.raises(ValueError, match=f"context of {limit} tokens"):
        greedy_generate(model, [3] * (limit + 1), 1, cache=cache)
    with pytest.raises(ValueError, match="context"):
        greedy_generate(model, [3] * limit, 1, cache=cache)
    assert cache.num_tokens == 0, "a rejected request must leave the cache untouched"
    with pytest.raises(ValueError, match="empty"):
        greedy_generate(model, [], 5)
    with pytest.raises(ValueError, match="beyond the model's context"):
        forward(model, [1], [limit], cache)
    assert cache.num_tokens == 0


def test_forward_without_cache_says_how_to_call_it(embedded):
    from kvlab.model.attention_hook import kvlab_attention

    model, _ = embedded
    with kvlab_attention(model), pytest.raises(RuntimeError, match="kvlab.model.attention_hook.forward"):
        model(input_ids=torch.tensor([[1, 2]]), use_cache=False)
