"""What an engine settles once its model is loaded: the longest sequence and the pool's size in blocks.

vLLM sizes its pool after loading the model and measuring what the GPU has left
(gpu_memory_utilization; vllm/v1/core/kv_cache_utils.py). kvlab takes the pool from the configuration:
num_blocks as given, or a byte budget (kv_cache_memory) divided by what one block costs in the chosen
storage (a draft model's K/V under the same block ids included), or by default room for max_num_seqs
full-length sequences, capped at DEFAULT_POOL_BYTES.
"""

from kvlab.cache.kv_storage import block_bytes
from kvlab.core.paging import num_blocks_needed
from kvlab.model.config import context_length

DEFAULT_POOL_BYTES = 512 * 2**20  # the pool's size when neither num_blocks nor kv_cache_memory is given


def resolve_max_model_len(max_model_len: int | None, model) -> int:
    """The configured max_model_len (default: the model's context), never beyond the model's context."""
    if max_model_len is None:
        return context_length(model)
    if max_model_len > context_length(model):
        raise ValueError(f"max_model_len {max_model_len} is beyond the model's context of "
                         f"{context_length(model)} tokens")
    return max_model_len


def kv_block_bytes(model, kv_cache_dtype: str, block_size: int, draft_model=None) -> int:
    """One block's bytes across every layer, K and V, scales included; a draft model's own K/V added."""
    def stored(m):
        return str(m.dtype).removeprefix("torch.") if kv_cache_dtype == "auto" else kv_cache_dtype

    total = block_bytes(model.config, stored(model), block_size)
    if draft_model is not None:  # the draft's own K/V under the same block ids: one block costs both
        total += block_bytes(draft_model.config, stored(draft_model), block_size)
    return total


def determine_num_blocks(cache_config, max_num_seqs: int, max_model_len: int, bytes_per_block: int) -> int:
    """The pool's blocks: num_blocks, or kv_cache_memory // bytes_per_block, or the capped default."""
    if cache_config.kv_cache_memory is not None:
        if cache_config.kv_cache_memory < bytes_per_block:
            raise ValueError(f"kv_cache_memory must be an integer number of bytes, at least one block "
                             f"({bytes_per_block} bytes), got {cache_config.kv_cache_memory!r}")
        return cache_config.kv_cache_memory // bytes_per_block
    if cache_config.num_blocks is not None:
        return cache_config.num_blocks
    # Room for max_num_seqs full-length sequences, but never more than DEFAULT_POOL_BYTES (a 32k-context model
    # would otherwise ask for gigabytes) and never less than one full-length sequence.
    full = num_blocks_needed(max_model_len, cache_config.block_size)
    return max(full, min(max_num_seqs * full, DEFAULT_POOL_BYTES // bytes_per_block))
