"""Chapter 1's memory arithmetic on the real configs shipped in assets/configs."""

import pytest

from kvlab.analysis.kv_size import kv_cache_bytes_per_token, load_model_config, shipped_model_configs

KiB, GiB = 2**10, 2**30


@pytest.mark.parametrize(
    "name, per_token",
    [
        ("llama-2-7b", 512 * KiB),
        ("llama-3-8b", 128 * KiB),
        ("mistral-7b-v0.1", 128 * KiB),
        ("qwen2-7b-instruct", 56 * KiB),
        ("qwen2.5-0.5b-instruct", 12 * KiB),
        ("opt-13b", 800 * KiB),
    ],
)
def test_bytes_per_token_of_real_configs(name, per_token):
    assert kv_cache_bytes_per_token(load_model_config(name)) == per_token


def test_llama2_7b_holds_one_gib_at_2048_tokens_not_two_gb():
    assert 2048 * kv_cache_bytes_per_token(load_model_config("llama-2-7b")) == 1 * GiB


def test_at_least_four_families_are_shipped():
    names = shipped_model_configs()
    families = {load_model_config(n)["model_type"] for n in names}
    assert {"llama", "mistral", "qwen2"} <= families and len(names) >= 4


def test_dtype_argument_overrides_the_config():
    config = load_model_config("llama-2-7b")
    assert kv_cache_bytes_per_token(config, dtype="float32") == 2 * kv_cache_bytes_per_token(config)
    assert kv_cache_bytes_per_token(config, dtype="fp8") == kv_cache_bytes_per_token(config) // 2


def test_missing_field_is_named():
    config = load_model_config("llama-3-8b")
    del config["num_hidden_layers"]
    with pytest.raises(KeyError, match="num_hidden_layers"):
        kv_cache_bytes_per_token(config)


def test_missing_dtype_is_named_and_unknown_dtype_rejected():
    config = load_model_config("llama-3-8b")
    del config["torch_dtype"]
    with pytest.raises(KeyError, match="torch_dtype"):
        kv_cache_bytes_per_token(config)
    with pytest.raises(ValueError, match="unknown dtype"):
        kv_cache_bytes_per_token(load_model_config("llama-3-8b"), dtype="float13")


def test_unknown_shipped_config_lists_the_known_ones():
    with pytest.raises(FileNotFoundError, match="llama-2-7b"):
        load_model_config("gpt-5")
