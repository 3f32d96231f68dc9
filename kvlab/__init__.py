"""kvlab: a hands-on course on how LLM serving systems manage the KV cache, the way vLLM does it.

The package is layered as vLLM V1 is; each layer imports only the ones above it in this list
(tests/test_import_layers.py checks it):

  analysis/   torch-free sizing and simulation: kv_size (bytes per token; Ch 1), contiguous, traces,
              memory_sim (Ch 2), chat_prompts (Ch 4), vllm_bridge (Ch 8), hybrid (layer patterns, Mamba's
              page size; Ch 11)
  core/       block bookkeeping in plain Python, no tensors (vLLM's v1/core): paging (block tables,
              slot mapping, the managers' shared API BaseBlockManager, BlockManager; Ch 3), block_pool,
              prefix_cache (the block-hash chain), kv_cache_manager (Ch 4), fork (copy-on-write; Ch 5),
              block_views (the block map's data), and for hybrid models (Ch 11) kv_cache_interface (specs and
              groups), single_type_kv_cache_manager, kv_cache_coordinator, hybrid_kv_cache_manager
  model/      loader (load_model), config (context length, EOS ids), attention_hook (the hook that
              lets a transformers model run on kvlab's caches; Ch 1)
  kernels/    the Triton kernels: unified paged attention for a whole ragged step (decode is its one-token
              case), split-KV decode, a torch reference, the byte counter, ahead-of-time compilation (Ch 7)
  cache/      K/V tensors and the attention that reads them: attention, naive_cache (Ch 1),
              ragged_batch (one forward pass over many sequences), kv_storage (the storage format: model
              dtype, int8, fp8), attention_backends (AttentionBackend and its typed per-step metadata:
              reference, torch, triton), paged_cache (PagedKVCache = a storage x a backend; Ch 3, 6, 8),
              swap (the CPU swap space; Ch 6), hybrid_cache (each layer through its group's tables; Ch 11)
  decoding/   the chapters' own loops: generate (Ch 1), paged_generate (Ch 3), prefix_generate (Ch 4),
              beam_search, parallel_sampling (Ch 5), hybrid_generate (Ch 11)
  spec_decode/ speculative decoding's proposers (vLLM's v1/spec_decode): config, ngram_proposer,
              draft_model, metrics (Ch 8)
  kv_offload/ tiers behind the GPU pool (vLLM's v1/kv_offload): the OffloadingManager with LRU and ARC
              eviction, a CPU tier and a disk tier (checksummed safetensors files), block movers (worker)
  kv_transfer/ the KV connector API (vLLM's distributed/kv_transfer): base, config (KVTransferConfig),
              factory, offloading_connector (CPU and disk tiers behind the prefix cache), socket_connector
              (disaggregated prefill/decode: a decode server pulls a prefill server's blocks by id; Ch 12)
  router/     routing across replicas by their caches (Ch 13): kv_index (block hash -> replicas, from KV-cache
              events; the longest consecutive hit; Dynamo's cost of prefill blocks plus active blocks), policies
              (round-robin, least-loaded, approx-prefix, precise-prefix, kv-cost; the live router's and the
              simulation's)
  engine/     the serving engine (Ch 6), in vLLM V1's parts: config (EngineConfig and its Model/Cache/Scheduler
              parts), kv_cache_utils (pool sizing), sampling_params, request, input_processor, scheduler
              (its rules as pure functions; owns request state), scheduler_output (what the scheduler hands the
              runner), model_runner (owns the tensors; samples and verifies drafts), outputs (what the runner
              hands back), sampler, rejection_sampler, output_processor (detokenizing, stop strings, n > 1),
              stats and metrics, llm_engine (LLMEngine.step: schedule, execute, update), llm (LLM), async_llm
  baselines/  what kvlab is measured against: transformers_generate (the oracles), static_batching
  benchmarks/ how kvlab measures (vLLM's vllm/benchmarks): latency definitions, datasets and Poisson
              arrivals, the online replay, step timing, the block-size sweep, 8-bit capacity and perplexity
  entrypoints/ kvlab serve (Ch 9): the OpenAI-compatible server (openai/: protocol, serving_completion,
              serving_chat, api_server), the CLI, the Prometheus export, a background server for notebooks,
              kvlab proxy and the launcher of a prefill/decode pair (disagg_proxy, disagg; Ch 12), kvlab router
              and kvlab replicas (router, replicas: cache-aware routing over replicas), process launching (launch)
  widgets/    the block map and the timeline; they draw plain data and nothing imports them but notebooks
  course/     the notebooks' checks (checks, kernel_checks), loaded afresh by every test cell

At the top: paths, validation (the argument checks every layer shares), quantization (the 8-bit KV
formats in plain torch; Ch 8), serve (the `kvlab serve` entry point).
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
