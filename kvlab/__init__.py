"""kvlab: a hands-on course on how LLM serving systems manage the KV cache, the way vLLM does it.

The package is layered as vLLM V1 is; each layer imports only the ones above it in this list
(tests/test_import_layers.py checks it):

  analysis/   torch-free sizing and simulation: kv_size (bytes per token; Ch 1), contiguous, traces,
              memory_sim (Ch 2), chat_prompts (Ch 4), vllm_bridge (Ch 8)
  core/       block bookkeeping in plain Python, no tensors (vLLM's v1/core): paging (block tables,
              slot mapping, the managers' shared API BaseBlockManager, BlockManager; Ch 3), block_pool,
              prefix_cache (the block-hash chain), kv_cache_manager (Ch 4), fork (copy-on-write; Ch 5),
              block_views (the block map's data)
  model/      loader (load_model), config (context length, EOS ids), attention_hook (the hook that
              lets a transformers model run on kvlab's caches; Ch 1)
  kernels/    the Triton kernels: unified paged attention for a whole ragged step (decode is its one-token
              case), split-KV decode, a torch reference, the byte counter, ahead-of-time compilation (Ch 7)
  cache/      K/V tensors and the attention that reads them: attention, naive_cache (Ch 1),
              ragged_batch (one forward pass over many sequences), paged_cache = kv_storage (the
              storage format: model dtype, int8, fp8) x attention_backends (per sequence, batched
              torch, Triton) (Ch 3, 6, 8), batched_attention (Ch 6), quantized_cache (Ch 8), swap (Ch 6)
  decoding/   the chapters' own loops: generate (Ch 1), paged_generate (Ch 3), prefix_generate (Ch 4),
              beam_search, parallel_sampling (Ch 5)
  engine/     the serving engine (Ch 6): sampling_params, request, scheduler (its rules as pure
              functions), sampler, model_runner, stats (StepRecord, EngineStats), llm_engine
              (LLMEngine), llm (LLM)
  baselines/  what kvlab is measured against: transformers_generate (the oracles), static_batching
  widgets/    the block map and the timeline; they draw plain data and nothing imports them but notebooks

At the top: paths, validation (the argument checks every layer shares), quantization (the 8-bit KV
formats in plain torch; Ch 8), checks (the notebooks' checks).
"""

__version__ = "0.1.0"

__all__ = ["load_model", "LLM", "SamplingParams", "BeamSearchParams", "__version__"]


def __getattr__(name):
    # Imported on first use so that torch-free chapters (the memory simulator) start fast.
    if name == "load_model":
        from kvlab.model.loader import load_model

        return load_model
    if name == "LLM":
        from kvlab.engine.llm import LLM

        return LLM
    if name in ("SamplingParams", "BeamSearchParams"):
        from kvlab.engine import sampling_params

        return getattr(sampling_params, name)
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
