"""Chapter 7: Triton paged-attention kernels, checked against a plain-torch reference.

    interpreter        where the kernels run: importing this package on a machine without CUDA switches Triton to
                       its interpreter (TRITON_INTERPRET=1) unless the variable is already set, so the kernels run
                       on CPU tensors; with CUDA they are compiled for the GPU
    validation         the checks every call shares, and the one shape type they return
    triton_unified_attention  one kernel for a whole ragged step (chunked prefills, prefix hits, decodes); the decode is
                       its one-token case
    split_kv           split-KV decode for few long sequences: the split kernel and its reduce
    cache_write        a step's new K/V stored into the pools at their slots (vLLM's reshape_and_cache)
    reference          the torch reference of the kernels' contract
    load_counter       the bytes a kernel requests, counted in the interpreter
    aot                compilation for a GPU that is not here (python -m kvlab.kernels.aot)

The pools may also be int8 or float8_e4m3fn (an 8-bit PagedKVCache) with k_scale and v_scale. Every attention
kernel and reference takes a sliding_window (None: full attention; W: a hybrid model's windowed layer, each query
seeing its last W positions), and never reads a table entry wholly before every query's window.
"""

from .cache_write import reshape_and_cache
from .interpreter import RUNS_IN_INTERPRETER
from .reference import (
    gather_blocks,
    paged_attention_decode_reference,
    reshape_and_cache_reference,
    unified_attention_reference,
)
from .split_kv import (
    allocate_split_workspace,
    choose_num_splits,
    launch_paged_decode_split_kv,
    num_sms,
    paged_attention_decode_split_kv,
    split_plan,
)
from .triton_unified_attention import (
    launch_paged_decode,
    launch_unified_attention,
    paged_attention_decode,
    unified_attention,
)
from .validation import (
    PagedAttentionShape,
    quantized_cache_dtypes,
    validate_paged_attention_inputs,
    validate_paged_decode_inputs,
)

__all__ = [
    "RUNS_IN_INTERPRETER",
    "PagedAttentionShape",
    "allocate_split_workspace",
    "choose_num_splits",
    "gather_blocks",
    "launch_paged_decode",
    "launch_paged_decode_split_kv",
    "launch_unified_attention",
    "num_sms",
    "paged_attention_decode",
    "paged_attention_decode_reference",
    "paged_attention_decode_split_kv",
    "quantized_cache_dtypes",
    "reshape_and_cache",
    "reshape_and_cache_reference",
    "split_plan",
    "unified_attention",
    "unified_attention_reference",
    "validate_paged_attention_inputs",
    "validate_paged_decode_inputs",
]
