"""The KV capacity of a deployment: vLLM's start-up arithmetic for a model on a GPU, per tensor-parallel worker."""

import pytest

from kvlab.analysis.kv_size import kv_cache_bytes_per_token, load_model_config
from kvlab.analysis.vllm_bridge import estimate_weights_bytes, vllm_num_kv_blocks
from kvlab.simulation.capacity import activation_peak_bytes, kv_capacity
from kvlab.simulation.gpus import GPUS
from kvlab.simulation.step_time import ModelSpec

GiB = 1024 ** 3


def test_opt_13b_on_an_a100_40gb_keeps_about_12_gb_for_kv_as_in_the_paper():
    """The paper's Figure 1: 13B parameters (26 GB) on an A100-40GB leave about 12 GB to the KV cache."""
    config = load_model_config("opt-13b")
    b = kv_capacity(config, "A100-40GB", max_model_len=2048)
    peak = activation_peak_bytes(ModelSpec.from_config(config))
    expected = vllm_num_kv_blocks(config, 40 * GiB, 0.92, weights_bytes=estimate_weights_bytes(config),
                                  activation_peak_bytes=peak, max_model_len=2048)
    assert b.num_blocks == expected.num_blocks, "the same formula as the bridge chapter's, not a copy of it"
    assert 10 * GiB < b.num_blocks * b.block_bytes < 14 * GiB
    assert b.bytes_per_token == 819_200 and b.max_tokens == b.num_blocks * 16


def test_fp8_doubles_the_blocks_and_a_bigger_token_budget_costs_some():
    config = load_model_config("llama-3-8b")
    auto = kv_capacity(config, "H100-SXM")
    fp8 = kv_capacity(config, "H100-SXM", kv_cache_dtype="fp8")
    assert fp8.bytes_per_token * 2 == auto.bytes_per_token
    assert 2 * auto.num_blocks - 1 <= fp8.num_blocks <= 2 * auto.num_blocks + 1
    big = kv_capacity(config, "H100-SXM", max_num_batched_tokens=65536)
    assert big.activation_peak_bytes > auto.activation_peak_bytes and big.num_blocks < auto.num_blocks


def test_the_activation_peak_is_the_larger_of_the_forward_pass_and_the_sampler():
    model = ModelSpec.from_config(load_model_config("llama-3-8b"))
    forward = 2 * 8192 * (2 * 4096 + 3 * 14336)     # residual, hidden, gate/up and activation rows, bf16
    assert activation_peak_bytes(model, 8192, 1) == forward
    sampler = 2 * 1024 * 128256 * 4                   # fp32 logits and probabilities of 1024 rows
    assert activation_peak_bytes(model, 16, 1024) == sampler


def test_tensor_parallelism_halves_each_workers_kv_and_weights():
    config = load_model_config("llama-2-7b")
    one, two = kv_capacity(config, "A100-80GB"), kv_capacity(config, "A100-80GB", tensor_parallel_size=2)
    assert two.bytes_per_token * 2 == one.bytes_per_token == kv_cache_bytes_per_token(config)
    assert two.weights_bytes == pytest.approx(one.weights_bytes / 2, abs=1)
    assert two.num_blocks > 2 * one.num_blocks, "half the weights per worker leaves more room, for half-size blocks"
    with pytest.raises(ValueError, match="split evenly"):
        kv_capacity(load_model_config("llama-3-8b"), "A100-80GB", tensor_parallel_size=3)


def test_a_model_that_does_not_fit_gets_no_blocks():
    b = kv_capacity(load_model_config("llama-3-8b"), "T4")
    assert b.num_blocks == 0 and b.available_bytes < 0, "15 GiB of weights on a 16 GiB T4 at 0.92 leave nothing"
    assert not GPUS["T4"].bf16
    smaller = kv_capacity(load_model_config("llama-3-8b"), "L4", gpu_memory_bytes=int(22.5 * GiB))
    assert smaller.num_blocks < kv_capacity(load_model_config("llama-3-8b"), "L4").num_blocks, \
        "the driver's smaller total (22.5 GiB of an L4's 24) leaves fewer blocks"
    with pytest.raises(ValueError, match="unknown GPU"):
        kv_capacity(load_model_config("llama-3-8b"), "A200")
