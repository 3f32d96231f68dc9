"""Chapter 7: a Triton paged decode-attention kernel, its split-KV variant and a plain-torch reference.

Importing this package on a machine without CUDA switches Triton to its interpreter
(TRITON_INTERPRET=1, set in paged_decode.py before the kernels are defined) unless the variable is
already set, so the kernels run on CPU tensors; with CUDA they are compiled for the GPU.
The pools may also be int8 or float8_e4m3fn (Chapter 10's QuantizedPagedKVCache) with k_scale and v_scale.
kvlab.kernels.aot compiles them for a GPU that is not here.
"""

from .paged_decode import (
    RUNS_IN_INTERPRETER,
    PagedDecodeShape,
    allocate_split_workspace,
    choose_num_splits,
    num_sms,
    quantized_cache_dtypes,
    split_plan,
    validate_paged_decode_inputs,
)
from .reference import gather_blocks, paged_attention_decode_reference, paged_attention_reference
from .unified_attention import (
    launch_paged_attention,
    launch_paged_decode,
    launch_paged_decode_split_kv,
    paged_attention,
    paged_attention_decode,
    paged_attention_decode_split_kv,
    validate_paged_attention_inputs,
)

__all__ = [
    "RUNS_IN_INTERPRETER",
    "PagedDecodeShape",
    "allocate_split_workspace",
    "choose_num_splits",
    "gather_blocks",
    "launch_paged_attention",
    "launch_paged_decode",
    "launch_paged_decode_split_kv",
    "num_sms",
    "paged_attention",
    "paged_attention_decode",
    "paged_attention_decode_reference",
    "paged_attention_reference",
    "paged_attention_decode_split_kv",
    "quantized_cache_dtypes",
    "split_plan",
    "validate_paged_attention_inputs",
    "validate_paged_decode_inputs",
]
