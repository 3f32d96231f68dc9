"""Chapter 14's follow-up arithmetic: K/V per tensor-parallel GPU, a prompt's K/V in transit, MLA, sliding windows."""

import pytest

from kvlab.analysis.kv_size import (
    kv_bytes_per_gpu,
    kv_cache_bytes_per_token,
    kv_head_replicas,
    kv_heads_per_gpu,
    kv_transfer_bytes,
    load_model_config,
    mla_kv_bytes_per_token,
)
from kvlab.analysis.vllm_bridge import vllm_sliding_window_blocks
from kvlab.validation import ArgumentTypeError

KiB, MiB = 2**10, 2**20
# DeepSeek-V3's config.json: 61 layers, kv_lora_rank 512, qk_rope_head_dim 64.
DEEPSEEK_V3 = {"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512,
               "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def llama3():
    return load_model_config("llama-3-8b")


@pytest.mark.parametrize("tp, heads, replicas, per_gpu", [
    (1, 8, 1, 128 * KiB), (2, 4, 1, 64 * KiB), (8, 1, 1, 16 * KiB), (16, 1, 2, 16 * KiB),
])
def test_gqa_heads_split_then_replicate(llama3, tp, heads, replicas, per_gpu):
    assert kv_heads_per_gpu(llama3, tp) == heads
    assert kv_head_replicas(llama3, tp) == replicas
    assert kv_bytes_per_gpu(llama3, tp, "float16") == per_gpu


def test_tp1_matches_the_whole_model(llama3):
    assert kv_bytes_per_gpu(llama3, 1) == kv_cache_bytes_per_token(llama3)


@pytest.mark.parametrize("tp", [3, 12])
def test_uneven_splits_are_refused(llama3, tp):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        kv_heads_per_gpu(llama3, tp)


@pytest.mark.parametrize("tp", [0, -2, 2.0, True])
def test_tensor_parallel_size_is_validated(llama3, tp):
    with pytest.raises(ValueError):
        kv_bytes_per_gpu(llama3, tp)


def test_transfer_of_a_2000_token_prompt(llama3):
    assert kv_transfer_bytes(llama3, 2000, "float16") == 2000 * 128 * KiB == 250 * MiB
    assert kv_transfer_bytes(llama3, 0, "float16") == 0
    with pytest.raises(ArgumentTypeError):
        kv_transfer_bytes(llama3, 2.5)


def test_mla_latent_of_deepseek_v3():
    assert mla_kv_bytes_per_token(DEEPSEEK_V3) == 61 * 576 * 2 == 70_272
    assert mla_kv_bytes_per_token(DEEPSEEK_V3, "fp8") == 61 * 576
    with pytest.raises(KeyError, match="kv_lora_rank"):
        mla_kv_bytes_per_token({"num_hidden_layers": 32, "qk_rope_head_dim": 64})


@pytest.mark.parametrize("computed, held", [
    (0, 0), (1, 1), (1024, 64), (1040, 64), (1041, 65), (1056, 64), (4096, 64), (4097, 65),
])
def test_sliding_window_frees_blocks_behind_the_window(computed, held):
    assert vllm_sliding_window_blocks(computed, sliding_window=1024, block_size=16) == held


def test_sliding_window_never_holds_more_than_the_window_plus_one_block():
    assert max(vllm_sliding_window_blocks(n, 1024, 16) for n in range(5000)) == 1024 // 16 + 1


def test_sliding_window_is_validated():
    with pytest.raises(ValueError):
        vllm_sliding_window_blocks(10, sliding_window=0)
    with pytest.raises(ValueError):
        vllm_sliding_window_blocks(-1, sliding_window=8)
