"""How many KV blocks a deployment gets: vLLM's start-up arithmetic (kvlab.analysis.vllm_bridge) for a model on a GPU.

vLLM sizes the pool of each tensor-parallel worker from that worker's memory: gpu_memory_utilization x the
GPU's memory, less its share of the weights, the activation peak of a profiling forward pass, the memory
outside torch's allocator and the CUDA-graph estimate; the rest is divided into blocks of block_size tokens
of that worker's K/V heads (vllm/v1/worker/gpu_worker.py determine_available_memory, then
vllm/v1/core/kv_cache_utils.py). Every worker holds the same block ids, so the deployment has the blocks of one.

The activation peak: vLLM measures it by running one forward pass of max_num_batched_tokens dummy tokens and
a sampler pass over max_num_seqs rows (gpu_model_runner.py profile_run). kvlab has no GPU to measure on, so it
counts the largest set of tensors alive at once instead (`activation_peak_bytes`): in the forward pass, the
MLP's stage (the residual and hidden states, the fused gate/up output and the activation's output, each
max_num_batched_tokens rows); in the sampler, the logits of max_num_seqs rows in fp32 and their probabilities.
The forward pass's tensors are freed before sampling, so the peak is the larger of the two, not their sum. The
allocator's rounding and the attention kernel's workspace are left out, so vLLM's measured peak is somewhat
larger; pass activation_peak_bytes to use a measured one.
"""

from __future__ import annotations

import math

from kvlab.analysis.kv_size import config_dict, kv_heads_per_gpu, kv_shape
from kvlab.analysis.vllm_bridge import KVBlockBudget, estimate_weights_bytes, vllm_num_kv_blocks
from kvlab.simulation.gpus import GPU, get_gpu
from kvlab.simulation.step_time import ModelSpec
from kvlab.validation import check_number, check_positive_int

FP32_BYTES = 4


def activation_peak_bytes(model: ModelSpec, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                          tensor_parallel_size: int = 1) -> int:
    """Bytes of the largest set of activations alive at once on one worker (see the module docstring)."""
    t = check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
    rows = check_positive_int("max_num_seqs", max_num_seqs)
    tp = check_positive_int("tensor_parallel_size", tensor_parallel_size)
    heads, kv_heads = model.heads_per_gpu(tp)
    inter = math.ceil(model.intermediate_size / tp)
    b, h, d = model.dtype_bytes, model.hidden_size, model.head_dim
    attention_stage = 2 * h + (heads + 2 * kv_heads) * d + heads * d     # residual, hidden, qkv, attention output
    mlp_stage = 2 * h + (3 if model.gated_mlp else 2) * inter            # residual, hidden, up(/gate), activation
    forward = b * t * max(attention_stage, mlp_stage)
    sampler = 2 * rows * math.ceil(model.vocab_size / tp) * FP32_BYTES    # logits and probabilities, fp32
    return max(forward, sampler)


def kv_capacity(config, gpu: GPU | str, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.92,
                block_size: int = 16, kv_cache_dtype: str | None = "auto", max_num_batched_tokens: int = 8192,
                max_num_seqs: int = 256, max_model_len: int | None = None, dtype: str | None = None,
                activation_peak: int | None = None, other_bytes: int = 0,
                cuda_graph_bytes: int = 0, gpu_memory_bytes: int | None = None) -> KVBlockBudget:
    """The KV blocks (and tokens) one worker of a deployment gets, by vLLM's formula.

    config is a Hugging Face config (dict or path); kv_cache_dtype 'auto' (the weights' dtype), a float dtype
    ('float16', 'bfloat16') or 'fp8'. Weights are the estimate of kvlab.analysis.vllm_bridge divided over the
    tensor-parallel workers; activation_peak defaults to activation_peak_bytes (see the module docstring);
    gpu_memory_bytes defaults to the GPU's datasheet memory (a measured total, e.g. torch.cuda.mem_get_info's, is
    what vLLM uses).
    """
    cfg = config_dict(config)
    gpu = get_gpu(gpu)
    tp = check_positive_int("tensor_parallel_size", tensor_parallel_size)
    model = ModelSpec.from_config(cfg, dtype)
    heads_per_gpu = kv_heads_per_gpu(cfg, tp)  # raises if the KV heads do not split over tp
    model.heads_per_gpu(tp)                    # raises if the attention heads do not
    if activation_peak is None:
        activation_peak = activation_peak_bytes(model, max_num_batched_tokens, max_num_seqs, tp)
    check_number("activation_peak", activation_peak, what="number of bytes")
    # One worker's share: its K/V heads (the bridge's per-token arithmetic on a config of that many heads).
    worker_cfg = dict(cfg, num_key_value_heads=heads_per_gpu, head_dim=kv_shape(cfg)["head_dim"])
    return vllm_num_kv_blocks(
        worker_cfg, gpu.memory_bytes if gpu_memory_bytes is None else gpu_memory_bytes, gpu_memory_utilization,
        weights_bytes=math.ceil(estimate_weights_bytes(cfg, dtype) / tp),
        activation_peak_bytes=activation_peak, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
        other_bytes=other_bytes, max_model_len=max_model_len, dtype=dtype, cuda_graph_bytes=cuda_graph_bytes,
    )
