"""Chapter 12's break-even between loading a prefix over a link and recomputing it on the GPU (kvlab.analysis.offload,
and kvlab.simulation.break_even for a real model on a datasheet GPU)."""

import math
import random

import pytest

from kvlab.analysis.kv_size import kv_cache_bytes_per_token, load_model_config
from kvlab.analysis.offload import (
    break_even_tokens,
    bytes_per_block,
    load_time_s,
    pass_time_s,
    recompute_time_s,
)
from kvlab.simulation.break_even import offload_case

# A toy GPU: 1 GB of weights at 1 TB/s (1 ms a pass at least), 10 us of compute per token: the ridge is 100 tokens.
TOY = dict(num_params=0.5e9, weight_bytes=1e9, flops_per_s=100e12, memory_bytes_per_s=1e12)


def test_bytes_per_block_is_block_size_times_bytes_per_token():
    llama3 = load_model_config("llama-3-8b")
    assert bytes_per_block(llama3, 16, "bfloat16") == 16 * 128 * 1024 == 2 * 1024 * 1024
    assert bytes_per_block(llama3, 1, "float32") == kv_cache_bytes_per_token(llama3, "float32")
    with pytest.raises(ValueError, match="block_size"):
        bytes_per_block(llama3, 0)


def test_load_time_is_bytes_over_bandwidth():
    assert load_time_s(1000, 131072, 64e9) == pytest.approx(1000 * 131072 / 64e9)
    assert load_time_s(0, 131072, 64e9) == 0
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        load_time_s(10, 100, 0)
    with pytest.raises(ValueError, match="num_tokens"):
        load_time_s(-1, 100, 1e9)


def test_recompute_is_free_below_the_ridge_and_linear_above_it():
    # pass(t) = max(1 ms, 2 * 0.5e9 * t / 100e12) = max(1 ms, 10 us * t): the ridge is at 100 tokens.
    assert pass_time_s(1, **TOY) == pytest.approx(1e-3)
    assert pass_time_s(100, **TOY) == pytest.approx(1e-3)
    assert pass_time_s(300, **TOY) == pytest.approx(3e-3)
    assert recompute_time_s(0, **TOY) == 0
    assert recompute_time_s(99, **TOY) == pytest.approx(0, abs=1e-12)
    assert recompute_time_s(299, **TOY) == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="num_params"):
        recompute_time_s(5, **{**TOY, "num_params": -1})


def test_break_even_by_hand():
    # A token costs 10 us to compute and 2 us to load (20 KB at 10 GB/s): load(n) = 2n us,
    # recompute(n) = 10 (n + 1) - 1000 us past the ridge; load < recompute from n = 124 (248 < 250), not at 123.
    assert break_even_tokens(20_000, 10e9, **TOY) == 124
    assert load_time_s(123, 20_000, 10e9) >= recompute_time_s(123, **TOY)
    # A link slower than the GPU computes a token: loading never wins.
    assert break_even_tokens(10_000, 1e9, **TOY) is None
    assert break_even_tokens(100_000, 10e9, **TOY) is None


def test_break_even_is_the_first_winning_length_on_random_cases():
    rng = random.Random(12)
    for _ in range(300):
        case = dict(num_params=rng.uniform(1e6, 1e10), weight_bytes=rng.uniform(1e6, 2e10),
                    flops_per_s=rng.uniform(1e12, 1e15), memory_bytes_per_s=rng.uniform(1e11, 5e12))
        per_token, link = rng.randint(1, 1 << 20), rng.uniform(1e9, 1e11)
        n = break_even_tokens(per_token, link, **case)
        if n is None:
            assert 2 * case["num_params"] / case["flops_per_s"] <= per_token / link
            continue
        assert load_time_s(n, per_token, link) < recompute_time_s(n, **case)
        assert n == 1 or load_time_s(n - 1, per_token, link) >= recompute_time_s(n - 1, **case)
        # and loading keeps winning afterwards: both grow linearly past the ridge
        for m in (n + 1, 2 * n, 10 * n):
            assert load_time_s(m, per_token, link) < recompute_time_s(m, **case)


def test_llama3_on_h100_behind_pcie_gen5_and_nvme():
    llama3 = load_model_config("llama-3-8b")
    pcie = offload_case(llama3, "H100-SXM", 64e9, "bfloat16")
    nvme = offload_case(llama3, "H100-SXM", 12e9, "bfloat16")
    assert pcie.bytes_per_token == 131072
    assert 7.0e9 < pcie.num_params < 8.0e9, "Llama-3-8B's matmul weights, the embedding lookup left out"
    assert pcie.weight_bytes == 2 * pcie.num_params
    # The slower link breaks even later; both within a few hundred tokens of the ridge.
    ridge = math.ceil(pcie.weight_bytes / pcie.memory_bytes_per_s / (2 * pcie.num_params / pcie.flops_per_s))
    assert ridge < pcie.break_even_tokens < nvme.break_even_tokens < 4 * ridge
    assert offload_case(llama3, "H100-SXM", 1e9, "bfloat16").break_even_tokens is None, \
        "at 1 GB/s a token crosses the link slower than the GPU recomputes it"
    with pytest.raises(ValueError, match="unknown GPU"):
        offload_case(llama3, "H900", 64e9)
