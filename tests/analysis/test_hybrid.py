"""Hybrid models by arithmetic: layer patterns against transformers, block counts by hand, page sizes, bad input."""

import pytest
from transformers import Gemma3TextConfig, GptOssConfig, MistralConfig, Qwen2Config, Qwen3NextConfig

from kvlab.analysis import hybrid
from kvlab.analysis.kv_size import load_model_config

CONFIG_CLASSES = {"gemma3_text": Gemma3TextConfig, "gpt_oss": GptOssConfig, "qwen3_next": Qwen3NextConfig,
                  "mistral": MistralConfig, "qwen2": Qwen2Config}


def _transformers_types(fields):
    cls = CONFIG_CLASSES[fields["model_type"]]
    cfg = cls(**{k: v for k, v in fields.items() if not k.startswith("_")})
    if getattr(cfg, "layer_types", None) is None:  # Mistral has none: every layer slides when sliding_window is set
        kind = "sliding_attention" if cfg.sliding_window is not None else "full_attention"
        return [kind] * cfg.num_hidden_layers
    return list(cfg.layer_types)


@pytest.mark.parametrize("name", ["gemma-3-27b-it", "gpt-oss-120b", "qwen3-next-80b-a3b-instruct",
                                  "mistral-7b-v0.1", "qwen2-7b-instruct"])
def test_patterns_of_shipped_configs_match_transformers(name):
    fields = load_model_config(name)
    ours = hybrid.layer_pattern(fields)
    assert list(ours.layer_types) == _transformers_types(fields), (
        f"{name}: the layer pattern must be the one transformers' own config class reads from the same fields")


def test_gemma3_27b_is_five_sliding_to_one_full_and_groups_pad_the_last():
    pattern = hybrid.layer_pattern(load_model_config("gemma-3-27b-it"))
    assert (pattern.count(hybrid.SLIDING), pattern.count(hybrid.FULL), pattern.sliding_window) == (52, 10, 1024)
    group_size, groups = hybrid.kv_cache_groups(pattern)
    assert group_size == 10 and [g.num_layers for g in groups] == [10, 10, 10, 10, 10, 10, 2], (
        "52 sliding layers in groups of 10 leave a last group of 2 real layers and 8 padding layers")


def test_block_counts_by_hand():
    gemma = load_model_config("gemma-3-27b-it")
    f = hybrid.request_footprint(gemma, 8192, block_size=16)
    # full group: 8192/16 = 512 blocks; each sliding group: 512 - (8192-1024+1)//16 = 512 - 448 = 64.
    assert (f.full_blocks, f.hybrid_blocks) == (512, 512 + 6 * 64)
    page = 16 * 2 * 16 * 128 * 2  # block x K,V x kv heads x head dim x bf16
    assert f.hybrid_bytes == (512 + 6 * 64) * 10 * page and f.full_bytes == 512 * 62 * page
    gpt = hybrid.request_footprint(load_model_config("gpt-oss-120b"), 1000, block_size=16)
    # 1000 tokens: 63 blocks; window 128 frees (1000-128+1)//16 = 54 of them.
    assert (gpt.full_blocks, gpt.hybrid_blocks) == (63, 63 + 9)


def test_requests_that_fit_divides_the_pool_by_the_footprint():
    gpt = load_model_config("gpt-oss-120b")
    f = hybrid.request_footprint(gpt, 1000, block_size=16)
    page = 16 * 2 * 8 * 64 * 2
    budget = 18 * page * 720  # 720 block ids of 18 layers
    assert hybrid.requests_that_fit(f, budget, gpt) == (720 // 72, (720 * 18 // 36) // 63)


def test_qwen3_next_state_and_raised_block_size():
    q = load_model_config("qwen3-next-80b-a3b-instruct")
    state = hybrid.mamba_state_spec(q)
    # conv: 3 x (2*16*128 + 32*128) = 3 x 8192; recurrent: 32 x 128 x 128; bf16.
    assert state.page_size_bytes == (3 * 8192 + 32 * 128 * 128) * 2 == 1_097_728
    per_token = hybrid.attention_page_bytes_per_token(q)
    assert per_token == 2 * 2 * 256 * 2
    assert hybrid.mamba_attention_block_size(per_token, state.page_size_bytes, "none") == 16 * 34 == 544
    assert hybrid.mamba_attention_block_size(per_token, state.page_size_bytes, "all") == 64 * 9 == 576
    assert hybrid.mamba_attention_block_size(per_token, state.page_size_bytes, "align", block_size=1024) == 1024, (
        "vLLM only ever raises the block size it was given")


def test_unify_page_sizes_raises_smaller_blocks_by_whole_factors():
    assert hybrid.unify_page_sizes({"full": (16, 4096), "swa": (16, 1024)}) == {"full": 16, "swa": 64}
    with pytest.raises(ValueError, match="does not divide"):
        hybrid.unify_page_sizes({"a": (16, 3000), "b": (16, 4096)})


def test_short_shared_prefixes_never_hit_at_a_mamba_sized_block():
    prompts = hybrid.shared_prefix_prompts(20, 300, (20, 100))
    assert hybrid.simulate_prefix_hit_rate(prompts, 16) > 0.5, "at 16 tokens a block, the 300-token prefix is shared"
    assert hybrid.simulate_prefix_hit_rate(prompts, 544, "all") == 0.0, (
        "no prompt fills one 544-token block, so nothing is ever cached")


def test_align_keeps_fewer_states_than_all():
    prompts = hybrid.shared_prefix_prompts(30, 1200, (50, 600), seed=1)
    none, align, every = (hybrid.simulate_prefix_hit_rate(prompts, 544, m) for m in ("none", "align", "all"))
    assert none == 0.0 and 0.0 < align <= every


@pytest.mark.parametrize("fields, field", [
    ({"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 0}, "sliding_window"),
    ({"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 1.5}, "sliding_window"),
    ({"model_type": "gpt_oss", "num_hidden_layers": 3, "sliding_window": 128,
      "layer_types": ["full_attention"] * 2}, "layer_types"),
    ({"model_type": "gpt_oss", "num_hidden_layers": 2, "sliding_window": 128,
      "layer_types": ["full_attention", "local"]}, r"layer_types\[1\]"),
    ({"model_type": "gemma3_text", "num_hidden_layers": 0}, "num_hidden_layers"),
])
def test_bad_configs_name_the_field(fields, field):
    with pytest.raises(ValueError, match=field):
        hybrid.layer_pattern(fields)


def test_bad_mode_and_missing_state_fields():
    with pytest.raises(ValueError, match="mamba_cache_mode"):
        hybrid.mamba_attention_block_size(2048, 10**6, "some")
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        hybrid.mamba_state_spec(load_model_config("gpt-oss-120b"))
    with pytest.raises(ValueError, match="raise it"):
        hybrid.request_footprint(load_model_config("qwen3-next-80b-a3b-instruct"), 1024, block_size=16)
