"""Chapters 6 and 7 together: the engine's steps through the unified Triton kernel equal transformers' generate.

On CPU the kernel runs in Triton's interpreter (slow, so the model and outputs are tiny); on a GPU the
same test runs the compiled kernel, and test_gpu.py checks the embedded model there.
"""

import pytest
import torch

import kvlab.kernels  # (on a CPU-only machine this switches Triton to its interpreter)
from conftest import make_tiny_model
from kvlab import SamplingParams
from kvlab.baselines.transformers_generate import reference_generate
from kvlab.cache.paged_cache import PagedKVCache
from kvlab.engine.llm_engine import LLMEngine

PROMPTS = [[5, 9, 13, 2, 7], [11, 3], [4, 4, 8, 15, 16, 23, 42, 1, 6]]
# Where the kernels can run in this process: CPU tensors in the interpreter, CUDA ones once compiled.
DEVICE = torch.device("cpu" if kvlab.kernels.RUNS_IN_INTERPRETER else "cuda")


def tiny_model(**kwargs):
    """The tiny test model, on the device the kernels run on here."""
    return make_tiny_model("llama", **kwargs).to(DEVICE)


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_engine_with_the_triton_decode_kernel_equals_generate(num_kv_heads):
    model = tiny_model(num_kv_heads=num_kv_heads)
    engine = LLMEngine(model, None, block_size=8, num_blocks=12, max_num_seqs=4, max_num_batched_tokens=16,
                       attention_backend="triton")
    assert engine.cache.attention_backend == "triton"
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
    """auto follows the pools' device: the kernel for CUDA pools, batched torch for CPU ones."""
    model = make_tiny_model("llama")

    def backend(m, name="auto"):
        return PagedKVCache.for_model(m, 4, 8, attention_backend=name).attention_backend

    assert backend(model) == "torch", "CPU pools decode with torch"
    if torch.cuda.is_available():
        assert backend(model.to("cuda")) == "triton", \
            "CUDA pools decode with the kernel"
        model = model.to("cpu")
    assert backend(model, "torch") == "torch"
    with pytest.raises(ValueError, match="attention_backend must be one of auto, reference, torch, triton"):
        PagedKVCache.for_model(model, 4, 8, attention_backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="runs on a CUDA device"):
        PagedKVCache.for_model(model, 4, 8, attention_backend="triton")


@pytest.mark.parametrize("preemption_mode, kv_cache_dtype", [("recompute", "auto"), ("swap", "auto"),
                                                             ("recompute", "int8")])
def test_every_step_runs_through_the_unified_kernel(preemption_mode, kv_cache_dtype, monkeypatch):
    """Chunked prefills, prefix hits, decodes and preemption: every attention call is one unified launch."""
    launches = []
    real = kvlab.kernels.launch_unified_attention

    def spy(shape, *args, **kwargs):
        launches.append((shape.num_tokens, shape.num_seqs))
        return real(shape, *args, **kwargs)

    monkeypatch.setattr(kvlab.kernels, "launch_unified_attention", spy)
    model = tiny_model(num_kv_heads=2)
    shared = [7, 3, 9, 1, 12, 5, 8, 2]               # two blocks of 4 that later prompts hit
    prompts = [shared + [4, 6, 11], shared + [13], [10, 14, 3, 3, 5], shared + [4, 6, 11, 2]]
    engine = LLMEngine(model, None, block_size=4, num_blocks=9, max_num_seqs=3, max_num_batched_tokens=7,
                       enable_prefix_caching=True, preemption_mode=preemption_mode,
                       num_cpu_blocks=16 if preemption_mode == "swap" else None, attention_backend="triton",
                       kv_cache_dtype=kv_cache_dtype)
    reference = LLMEngine(model, None, block_size=4, num_blocks=64, attention_backend="torch",
                          kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    outputs = {}
    for name, eng in (("triton", engine), ("torch", reference)):
        for i, prompt in enumerate(prompts):
            eng.add_request(i, prompt, params)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    outputs[name, out.request_id] = out.outputs[0].token_ids
    for i, prompt in enumerate(prompts):
        if kv_cache_dtype == "auto":
            assert outputs["triton", str(i)] == reference_generate(model, prompt, 7), f"request {i} differs"
        assert outputs["triton", str(i)] == outputs["torch", str(i)], f"request {i}: kernel and torch paths differ"
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the pool of 9 blocks must force a preemption"
    assert engine.kv_cache_manager.hits > 0, "later prompts must hit the shared prefix blocks"
    assert any(tokens > seqs for tokens, seqs in launches), "no prefill chunk went through the kernel"
    assert any(tokens == seqs for tokens, seqs in launches), "no decode-only step went through the kernel"


def test_decode_steps_split_the_context_when_the_grid_is_small(monkeypatch):
    """With splits allowed from 4 tokens on, decode-only steps go through split-KV and still equal generate."""
    import kvlab.kernels.split_kv as split_kv

    monkeypatch.setattr(split_kv, "MIN_TOKENS_PER_SPLIT", 4)
    split_launches = []
    real = kvlab.kernels.launch_paged_decode_split_kv

    def spy(shape, *args, **kwargs):
        split_launches.append(shape.num_seqs)
        return real(shape, *args, **kwargs)

    monkeypatch.setattr(kvlab.kernels, "launch_paged_decode_split_kv", spy)
    model = tiny_model(num_kv_heads=2)
    engine = LLMEngine(model, None, block_size=4, num_blocks=32, attention_backend="triton")
    prompt = [5, 9, 13, 2, 7, 11, 3, 8, 1]
    engine.add_request(0, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
    assert tokens == reference_generate(model, prompt, 6), "split-KV decode steps changed the output"
    assert split_launches, "one sequence on 2 KV heads should have split its decode steps"
