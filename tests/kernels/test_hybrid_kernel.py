"""The unified Triton kernel serves a hybrid model: Qwen2's full and windowed layers on kvlab's hybrid pool.

On CPU the kernel runs in Triton's interpreter (so the model and outputs are tiny); on a GPU
(scripts/gpu_check.sh) compiled. The windowed layers' tables hold the null block where blocks went back, which
the kernel must never read: the outputs equal transformers' generate only if it honours the window and skips them.
"""

import sys
from pathlib import Path

import torch

import kvlab.kernels  # (on a CPU-only machine this switches Triton to its interpreter)
from kvlab.decoding.hybrid_generate import HybridGenerator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decoding"))
from test_hybrid_generate import prompts, reference, tiny  # noqa: E402

DEVICE = torch.device("cpu" if kvlab.kernels.RUNS_IN_INTERPRETER else "cuda")


def test_the_triton_kernel_on_a_hybrid_pool_equals_generate():
    model = tiny("qwen2").to(DEVICE)
    gen = HybridGenerator(model, num_blocks=30, block_size=4, max_num_batched_tokens=12, attention_backend="triton")
    assert gen.cache.attention_backend == "triton"
    outs = gen.generate(prompts()[:3], 10)
    for i, (prompt, out) in enumerate(zip(prompts()[:3], outs)):
        assert out == reference(model, prompt, 10), f"prompt {i}: the kernel's windowed attention differs"
    assert gen.coordinator.hits > 0


def test_the_engine_on_the_triton_backend_never_reads_what_a_window_gave_back():
    from kvlab import LLM, SamplingParams

    model = tiny("qwen2").to(DEVICE)
    llm = LLM(model, block_size=4, num_blocks=30, max_num_batched_tokens=12, attention_backend="triton")
    cache = llm.llm_engine.cache
    assert cache.attention_backend == "triton"
    for pool in (*cache.k_pools, *cache.v_pools):  # the null block: NaN spoils any output that reads it
        pool[0] = float("nan")
    outs = llm.generate(prompts()[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for i, (prompt, out) in enumerate(zip(prompts()[:2], outs)):
        assert list(out.outputs[0].token_ids) == reference(model, prompt, 8), \
            f"prompt {i}: the engine's Triton path differs from transformers"
