"""kvlab: a hands-on course on how LLM serving systems manage the KV cache, the way vLLM does it.

The modules follow the chapters:
  Chapter 1  kv_size (bytes per token), attention (reference causal attention), runner (the hook
             that lets a transformers model run on kvlab's cache), naive_cache, generate, model
  Chapter 2  contiguous (first-fit arena, Max/Pow2/Oracle reservations), traces, memory_sim
  Chapter 3  paging (block tables, slot mapping, BlockManager), paged_cache (K/V pools, gather
             attention), paged_generate (several sequences on one pool), widgets (the block map)
  Chapter 4  block_pool (ref counts, LRU free queue), prefix_cache (block-hash chain),
             kv_cache_manager (per-request blocks and cache hits), prefix_generate, chat_prompts
  Chapter 5  fork (fork and copy-on-write over the block pool), beam_search (equal to transformers'
             beam search), parallel_sampling (n samples sharing one prefill)
  Chapter 6  sampling_params (SamplingParams, BeamSearchParams), request, sampler, swap (the CPU
             block pool), scheduler (token budget, chunked prefill, preemption), model_runner (one
             ragged forward per step), batched_attention (a step's decodes in one batch),
             llm_engine (LLMEngine), llm (LLM), static_batching (the baseline), widgets.timeline
  Chapter 7  kernels (the Triton paged decode kernel, its split-KV variant, a torch reference,
             ahead-of-time compilation for GPUs that are not here)
  Chapter 8  quantized_cache (int8 / fp8 K and V with per-block scales), vllm_bridge (kvlab's knobs
             in vLLM's names, the KV blocks vLLM would allocate, its start-up errors explained)
"""

__version__ = "0.1.0"

__all__ = ["load_model", "LLM", "SamplingParams", "BeamSearchParams", "__version__"]


def __getattr__(name):
    # Imported on first use so that torch-free chapters (the memory simulator) start fast.
    if name == "load_model":
        from .model import load_model

        return load_model
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name in ("SamplingParams", "BeamSearchParams"):
        from . import sampling_params

        return getattr(sampling_params, name)
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
