"""Chapters 6 and 7 together: the engine's decodes through the Triton kernel equal transformers' generate.

On CPU the kernel runs in Triton's interpreter (slow, so the model and outputs are tiny); on a GPU the
same test runs the compiled kernel, and test_gpu.py checks the embedded model there.
"""

import pytest
import torch

import kvlab.kernels  # noqa: F401  (on a CPU-only machine this switches Triton to its interpreter)
from conftest import make_tiny_model
from kvlab import SamplingParams
from kvlab.baselines.transformers_generate import reference_generate
from kvlab.cache.batched_attention import BatchedPagedKVCache
from kvlab.engine.llm_engine import LLMEngine

PROMPTS = [[5, 9, 13, 2, 7], [11, 3], [4, 4, 8, 15, 16, 23, 42, 1, 6]]


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_engine_with_the_triton_decode_kernel_equals_generate(num_kv_heads):
    model = make_tiny_model("llama", num_kv_heads=num_kv_heads)
    engine = LLMEngine(model, None, block_size=8, num_blocks=12, max_num_seqs=4, max_num_batched_tokens=16,
                       decode_backend="triton")
    assert engine.cache.decode_backend == "triton"
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(i, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    for i, prompt in enumerate(PROMPTS):
        assert done[str(i)] == reference_generate(model, prompt, 6), \
            f"request {i} differs with the Triton decode kernel"


def test_backend_choice_and_bad_backend(monkeypatch):
    model = make_tiny_model("llama")
    auto = BatchedPagedKVCache.for_model(model, 4, 8)
    expected = "triton" if torch.cuda.is_available() else "torch"
    assert auto.decode_backend == expected, "auto picks the kernel only where a GPU is"
    assert BatchedPagedKVCache.for_model(model, 4, 8, decode_backend="torch").decode_backend == "torch"
    with pytest.raises(ValueError, match="decode_backend must be one of auto, torch, triton"):
        BatchedPagedKVCache.for_model(model, 4, 8, decode_backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="runs on a CUDA device"):
            BatchedPagedKVCache.for_model(model, 4, 8, decode_backend="triton")
