"""Chapter 12's break-even on a real GPU: kvlab.analysis.offload's rates for a model config and a datasheet GPU.

The achieved rates are the datasheet's times the matmul efficiencies of the step-time model
(kvlab.simulation.step_time.EFFICIENCY), the weights those of the model's matmuls (the embedding lookup does no
FLOPs), so that the roofline here is the one Chapter 10's step-time model applies to a matmul.
"""

from kvlab.analysis.kv_size import kv_cache_bytes_per_token
from kvlab.analysis.offload import OffloadCase
from kvlab.simulation.gpus import GPU, get_gpu
from kvlab.simulation.step_time import EFFICIENCY, ModelSpec, weight_bytes_per_gpu
from kvlab.validation import check_number


def offload_case(config, gpu: GPU | str, link_bytes_per_s: float, dtype: str | None = None) -> OffloadCase:
    """config's K/V bytes per token and matmul weights on gpu (a GPU or its name) behind a link of link_bytes_per_s."""
    spec = ModelSpec.from_config(config, dtype=dtype)
    gpu = get_gpu(gpu)
    weights = weight_bytes_per_gpu(spec)
    matmul = EFFICIENCY["matmul"]
    return OffloadCase(kv_cache_bytes_per_token(config, dtype), weights / spec.dtype_bytes, weights,
                       gpu.flops_per_s * matmul.flops, gpu.memory_bytes_per_s * matmul.memory,
                       float(check_number("link_bytes_per_s", link_bytes_per_s, allow_zero=False)))
