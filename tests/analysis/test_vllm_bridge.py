"""Chapter 14: kvlab's knobs under vLLM's names, vLLM's block-count arithmetic and its three start-up errors."""

import math

import pytest

from conftest import FAMILIES, make_tiny_model
from kvlab.analysis.kv_size import load_model_config
from kvlab.analysis.vllm_bridge import (
    KNOBS,
    check_vllm_startup,
    estimate_num_parameters,
    estimate_weights_bytes,
    knobs_table,
    vllm_num_kv_blocks,
)

GiB = 1024 ** 3


# --- the knob table --------------------------------------------------------------------------

def test_knob_table_maps_every_knob_the_course_teaches():
    """Every kvlab knob of the chapter appears with its vLLM name, in markdown and in HTML."""
    by_vllm = {k.vllm: k for k in KNOBS}
    for name in ("block_size", "gpu_memory_utilization", "enable_prefix_caching", "max_num_seqs",
                 "max_num_batched_tokens", "max_model_len", "kv_cache_dtype"):
        assert name in by_vllm, f"no row maps to vLLM's {name}"
    assert by_vllm["gpu_memory_utilization"].kvlab.startswith("num_blocks")
    assert by_vllm["gpu_memory_utilization"].vllm_default.startswith("0.92")  # current vLLM; 0.9 in 0.11
    assert by_vllm["kv_cache_memory_bytes"].kvlab == "kv_cache_memory"
    assert "ignores gpu_memory_utilization" in by_vllm["kv_cache_memory_bytes"].meaning
    assert "int8_per_token_head" in by_vllm["kv_cache_dtype"].meaning and "nvfp4" in by_vllm["kv_cache_dtype"].meaning
    assert "no int8" not in knobs_table()
    preemption = next(k for k in KNOBS if k.kvlab.startswith("preemption_mode"))
    assert "swap_space" in preemption.vllm and "V1: recompute" in preemption.vllm_default
    assert "vllm:num_preemptions" in preemption.meaning and "logs no warning" in preemption.meaning
    assert all(k.meaning.endswith(".") for k in KNOBS)
    markdown = knobs_table()
    assert markdown.count("\n") == len(KNOBS) + 1 and "| `block_size` | `block_size` | 16 |" in markdown
    table = knobs_table("html")
    assert table.startswith("<table>") and table.count("<tr>") == len(KNOBS) + 1
    assert '"recompute"' not in table and "&quot;recompute&quot;" in table  # escaped
    with pytest.raises(ValueError, match="'markdown' or 'html'"):
        knobs_table("latex")


# --- parameter estimate ----------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_parameter_estimate_is_exact_for_tiny_models_of_each_family(family):
    """The config arithmetic equals transformers' own parameter count (Qwen2's q/k/v biases included)."""
    model = make_tiny_model(family)
    assert estimate_num_parameters(model.config) == sum(p.numel() for p in model.parameters())


def test_parameter_estimate_is_exact_for_biased_llama_opt_and_the_embedded_model(embedded):
    """Llama with attention and MLP biases, a tiny OPT (learned positions, tied head), and the tied embedded model."""
    import transformers

    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attention_bias=True, mlp_bias=True))
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=50, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=40, word_embed_proj_dim=32))
    model, _ = embedded
    for m in (llama, opt, model):
        assert estimate_num_parameters(m.config) == sum(p.numel() for p in m.parameters()), type(m).__name__
    assert estimate_num_parameters(model.config) == 2_923_520  # "a 2.9M-parameter model"


@pytest.mark.parametrize("name, published", [
    ("llama-2-7b", 6.74e9), ("llama-3-8b", 8.03e9), ("mistral-7b-v0.1", 7.24e9),
    ("qwen2-7b-instruct", 7.62e9), ("qwen2.5-0.5b-instruct", 0.494e9),
])
def test_parameter_estimate_matches_published_sizes(name, published):
    """The shipped real configs give the parameter counts their model cards state (to 3 figures)."""
    assert estimate_num_parameters(load_model_config(name)) == pytest.approx(published, rel=1e-3)


def test_parameter_estimate_refuses_an_unknown_architecture():
    with pytest.raises(ValueError, match="pass weights_bytes instead"):
        estimate_num_parameters({"model_type": "gpt2", "hidden_size": 8, "num_hidden_layers": 1,
                                 "vocab_size": 10, "num_attention_heads": 2})


# --- how many blocks -------------------------------------------------------------------------

def test_worked_example_llama_3_8b_on_an_80_gb_gpu():
    """Llama-3-8B, fp16, 80 GB GPU at 0.9: work the block count out by hand, then compare.

    K/V per token: 2 (K and V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 131,072 B (128 KiB).
    A 16-token block across all layers: 16 x 131,072 = 2,097,152 B (2 MiB).
    Weights: 8,030,261,248 parameters x 2 bytes = 16,060,522,496 B (about 16 GB, 14.96 GiB).
    Usable: 80e9 x 0.9 = 72e9 B; left for blocks: 72e9 - 16,060,522,496 = 55,939,477,504 B.
    Blocks: floor(55,939,477,504 / 2,097,152) = 26,674, i.e. 426,784 tokens, 52 sequences of 8,192.
    """
    per_token = 2 * 32 * 8 * 128 * 2
    block = 16 * per_token
    weights = 8_030_261_248 * 2
    available = int(80e9 * 0.9) - weights
    expected_blocks = available // block
    assert (per_token, block, expected_blocks) == (131_072, 2 * 1024 ** 2, 26_674)

    budget = vllm_num_kv_blocks(load_model_config("llama-3-8b"), 80e9, 0.9, kv_cache_dtype="float16", dtype="float16")
    assert budget.bytes_per_token == per_token and budget.block_bytes == block
    assert budget.weights_bytes == weights and budget.available_bytes == available
    assert budget.num_blocks == expected_blocks and budget.max_tokens == 426_784
    assert budget.max_model_len == 8192 and budget.max_full_sequences == 52
    assert budget.max_concurrency == pytest.approx(426_784 / 8192)  # 52.1x
    # With the weights given as a round 16 GB instead of the estimate: floor(56e9 / 2 MiB) blocks.
    rounded = vllm_num_kv_blocks(load_model_config("llama-3-8b"), 80e9, 0.9, weights_bytes=16e9)
    assert rounded.num_blocks == int(56e9 // (2 * 1024 ** 2)) == 26_702
    # fp8 K/V halves the bytes per token and about doubles the blocks.
    fp8 = vllm_num_kv_blocks(load_model_config("llama-3-8b"), 80e9, 0.9, kv_cache_dtype="fp8")
    assert fp8.bytes_per_token == per_token // 2 and fp8.num_blocks == available // (block // 2)


def test_figures_from_the_facts_sheet():
    """Llama-2-7B fp16: 512 KiB per token, a 16-token block across all layers is 8 MiB."""
    budget = vllm_num_kv_blocks(load_model_config("llama-2-7b"), 80 * GiB, 0.9)
    assert budget.bytes_per_token == 512 * 1024 and budget.block_bytes == 8 * 1024 ** 2
    assert vllm_num_kv_blocks(load_model_config("llama-3-8b"), 80 * GiB).bytes_per_token == 128 * 1024


# A vLLM 0.6 start-up log posted in vllm-project/vllm issue 10517: Llama-3.1-8B-Instruct (Llama-3-8B's
# architecture) on an RTX 3090, total_gpu_memory=23.58GiB, gpu_memory_utilization=0.90, "Loading model
# weights took 14.9888 GB" (GiB), non_torch_memory=0.35GiB; peak_torch_memory (weights + activations)
# 17.06GiB at max_model_len 20000 gave "GPU blocks: 1952" and "Maximum concurrency ... 1.56x";
# 17.98GiB at 29000 gave 1478 blocks and the start-up error naming 23648 tokens. The log rounds each
# input to 0.01 GiB (5 MiB = 2.5 blocks each), so the block counts agree to within a few blocks.
RTX3090 = dict(gpu_memory_bytes=23.58 * GiB, gpu_memory_utilization=0.9, weights_bytes=14.9888 * GiB,
               other_bytes=0.35 * GiB)


def test_block_count_agrees_with_a_real_vllm_startup_log():
    """Our arithmetic reproduces the blocks and concurrency vLLM printed, within the log's rounding."""
    config = load_model_config("llama-3-8b")
    ok = check_vllm_startup(config, max_model_len=20000, activation_peak_bytes=(17.06 - 14.9888) * GiB, **RTX3090)
    assert abs(ok.num_blocks - 1952) <= 8
    assert round(ok.max_concurrency, 2) == pytest.approx(1.56, abs=0.01)
    with pytest.raises(ValueError) as error:
        check_vllm_startup(config, max_model_len=29000, activation_peak_bytes=(17.98 - 14.9888) * GiB, **RTX3090)
    budget = vllm_num_kv_blocks(config, max_model_len=29000, activation_peak_bytes=(17.98 - 14.9888) * GiB, **RTX3090)
    assert abs(budget.num_blocks - 1478) <= 8 and abs(budget.max_tokens - 23648) <= 8 * 16
    assert f"at most {budget.max_tokens}" in str(error.value)


# --- the three start-up errors ---------------------------------------------------------------

def test_free_memory_below_the_requested_utilization():
    """vLLM's most common start-up error: another process holds memory, so less than utilization x total is free."""
    config = load_model_config("llama-3-8b")
    # 80 GiB GPU at 0.92 asks for 73.6 GiB; with 70 GiB free (10 GiB held elsewhere) it refuses.
    with pytest.raises(ValueError, match="is less than desired GPU memory utilization") as error:
        check_vllm_startup(config, 80 * GiB, 0.92, free_memory_bytes=70 * GiB)
    message = str(error.value)
    assert "(70.00/80.00 GiB)" in message and "(0.92, 73.60 GiB)" in message
    assert "other processes hold 10.00 GiB" in message and "at most 0.875" in message
    # The same free memory is enough at 0.875 (70 GiB exactly), and None skips the check.
    ok = check_vllm_startup(config, 80 * GiB, 0.875, free_memory_bytes=70 * GiB)
    assert ok.usable_bytes == 70 * GiB and ok.num_blocks > 0
    assert check_vllm_startup(config, 80 * GiB, 0.92).num_blocks == vllm_num_kv_blocks(config, 80 * GiB).num_blocks
    # It is checked first: on a 16 GiB GPU with little free, the free-memory error wins over "no memory left".
    with pytest.raises(ValueError, match="Free memory on device"):
        check_vllm_startup(config, 16 * GiB, 0.9, free_memory_bytes=4 * GiB)
    for bad, match in [(-1, "free_memory_bytes must be non-negative"), (81 * GiB, "cannot exceed gpu_memory_bytes"),
                       (math.nan, "finite number")]:
        with pytest.raises(ValueError, match=match):
            check_vllm_startup(config, 80 * GiB, 0.92, free_memory_bytes=bad)


def test_default_utilization_is_current_vllms():
    """0.92 by default (current vLLM); older releases such as 0.11 used 0.9."""
    config = load_model_config("llama-3-8b")
    assert vllm_num_kv_blocks(config, 80 * GiB).gpu_memory_utilization == 0.92
    assert check_vllm_startup(config, 80 * GiB).usable_bytes == int(80 * GiB * 0.92)


def test_non_torch_memory_and_the_cuda_graph_estimate_are_subtracted():
    config = load_model_config("llama-3-8b")
    base = vllm_num_kv_blocks(config, 80 * GiB, 0.9, weights_bytes=16 * GiB)
    less = vllm_num_kv_blocks(config, 80 * GiB, 0.9, weights_bytes=16 * GiB, other_bytes=GiB, cuda_graph_bytes=GiB)
    assert less.available_bytes == base.available_bytes - 2 * GiB and less.cuda_graph_bytes == GiB
    assert less.num_blocks == base.num_blocks - 2 * GiB // less.block_bytes
    with pytest.raises(ValueError, match="CUDA-graph estimate"):
        check_vllm_startup(config, 20 * GiB, 0.9, weights_bytes=16 * GiB, cuda_graph_bytes=2 * GiB)


def test_no_memory_left_for_blocks():
    """Llama-3-8B's 15 GiB of weights on a 16 GiB GPU at 0.9 (14.4 GiB): nothing is left for blocks."""
    config = load_model_config("llama-3-8b")
    budget = vllm_num_kv_blocks(config, 16 * GiB, 0.9)
    assert budget.available_bytes < 0 and budget.num_blocks == 0 and budget.max_tokens == 0
    with pytest.raises(ValueError, match="No available memory for the KV cache blocks") as error:
        check_vllm_startup(config, 16 * GiB, 0.9)
    message = str(error.value)
    assert "Try increasing gpu_memory_utilization" in message and "14.40 GiB" in message and "14.96 GiB" in message
    # Exactly nothing left is as bad as less than nothing.
    with pytest.raises(ValueError, match="No available memory"):
        check_vllm_startup(config, 20 * GiB, 0.5, weights_bytes=10 * GiB)


def test_max_model_len_larger_than_the_pool():
    """One max_model_len sequence must fit, or vLLM refuses to start; one token fewer than capacity is fine."""
    config = load_model_config("llama-3-8b")
    budget = vllm_num_kv_blocks(config, 24 * GiB, 0.9)
    capacity = budget.max_tokens
    assert check_vllm_startup(config, 24 * GiB, 0.9, max_model_len=capacity).max_full_sequences == 1
    with pytest.raises(ValueError, match="max_model_len is .* tokens, but the KV cache can store at most") as error:
        check_vllm_startup(config, 24 * GiB, 0.9, max_model_len=capacity + 1)
    message = str(error.value)
    assert "Try increasing gpu_memory_utilization or decreasing max_model_len" in message
    assert f"at most {capacity} " in message and "max_model_len 'auto', or -1" in message


# --- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(gpu_memory_utilization=0), r"in \(0, 1\]"),
    (dict(gpu_memory_utilization=1.5), r"in \(0, 1\]"),
    (dict(gpu_memory_utilization=-0.1), r"in \(0, 1\]"),
    (dict(gpu_memory_utilization=math.nan), r"in \(0, 1\]"),
    (dict(gpu_memory_utilization=True), r"in \(0, 1\]"),
    (dict(gpu_memory_bytes=-1), "gpu_memory_bytes must be positive"),
    (dict(gpu_memory_bytes=0), "gpu_memory_bytes must be positive"),
    (dict(gpu_memory_bytes=math.inf), "finite number"),
    (dict(weights_bytes=-5), "weights_bytes must be non-negative"),
    (dict(activation_peak_bytes=-5), "activation_peak_bytes must be non-negative"),
    (dict(other_bytes=-5), "other_bytes must be non-negative"),
    (dict(cuda_graph_bytes=-5), "cuda_graph_bytes must be non-negative"),
    (dict(block_size=0), "positive power of two"),
    (dict(block_size=12), "positive power of two"),
    (dict(block_size=-16), "positive power of two"),
    (dict(block_size=16.0), "positive power of two"),
    (dict(block_size=True), "positive power of two"),
    (dict(max_model_len=0), "max_model_len must be a positive integer"),
    (dict(kv_cache_dtype="int8"), "vLLM spells its int8 KV cache 'int8_per_token_head'"),
    (dict(kv_cache_dtype="int8_per_token_head"), "is a vLLM option, but its scales"),
    (dict(kv_cache_dtype="fp8_per_token_head"), "is a vLLM option, but its scales"),
    (dict(kv_cache_dtype="int4_per_token_head"), "is a vLLM option, but its scales"),
    (dict(kv_cache_dtype="nvfp4"), "is a vLLM option, but its scales"),
    (dict(kv_cache_dtype="int4"), "unsupported kv_cache_dtype 'int4'"),
])
def test_bad_input_is_rejected(kwargs, message):
    """Utilization outside (0, 1], negative memory, a block size that is not a power of two: ValueError."""
    args = dict(config=load_model_config("llama-3-8b"), gpu_memory_bytes=80 * GiB) | kwargs
    with pytest.raises(ValueError, match=message):
        vllm_num_kv_blocks(**args)
    with pytest.raises(ValueError, match=message):
        check_vllm_startup(**args)


def test_full_utilization_and_other_block_sizes_are_accepted():
    config = load_model_config("llama-3-8b")
    full = vllm_num_kv_blocks(config, 80 * GiB, 1.0, block_size=32)
    assert full.usable_bytes == 80 * GiB and full.block_bytes == 32 * 128 * 1024
    one = vllm_num_kv_blocks(config, 80 * GiB, 1.0, block_size=1)
    assert one.num_blocks == one.available_bytes // (128 * 1024) and one.num_blocks >= full.num_blocks * 32
    assert estimate_weights_bytes(config, "float32") == 2 * estimate_weights_bytes(config)
