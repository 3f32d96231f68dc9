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


def kv_block_bytes(model, kv_cache_dtype: str, block_size: int, draft_model=None, kv_cache_groups=None) -> int:
    """One block's bytes across every layer, K and V, scales included; a draft model's own K/V added.

    A hybrid model's block id (kv_cache_groups given) spans one layer of its group, in the pool tensors its largest
    group needs (kvlab.cache.hybrid_cache): its bytes are that share of every layer's.
    """
    def stored(m):
        return str(m.dtype).removeprefix("torch.") if kv_cache_dtype == "auto" else kv_cache_dtype

    total = block_bytes(model.config, stored(model), block_size)
    if kv_cache_groups is not None:
        num_layers = sum(len(g.layer_ids) for g in kv_cache_groups)
        total = total // num_layers * max(len(g.layer_ids) for g in kv_cache_groups)
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


def _one_table_knobs(config) -> list[str]:
    """The knobs set in config that need a request's blocks in one table of the device pool: draft tokens, swap and
    Orca's reservations. Neither the hybrid KV cache manager nor the KV connectors serve them."""
    scheduler_config = config.scheduler_config
    refused = []
    if config.speculative_config is not None:
        refused.append("speculative_config (draft tokens)")
    if scheduler_config.preemption_mode != "recompute":
        refused.append(f"preemption_mode={scheduler_config.preemption_mode!r} (vLLM V1 recomputes only)")
    if scheduler_config.reservation_policy is not None:
        refused.append(f"reservation_policy={scheduler_config.reservation_policy!r} (Orca's contiguous reservations)")
    return refused


def check_hybrid_config(config) -> None:
    """Refuse, before anything is built, the knobs kvlab's hybrid KV cache manager does not serve."""
    refused = _one_table_knobs(config)
    if refused:
        raise ValueError(f"this model has sliding-window layers, which kvlab serves with the hybrid KV cache manager; "
                         f"it does not support {', '.join(refused)}: leave them out, or give "
                         f"disable_hybrid_kv_cache_manager=True to keep every layer's blocks")


def check_kv_transfer_config(config, hybrid: bool) -> None:
    """Refuse, before anything is built, the knobs kvlab's KV connectors do not combine with."""
    if config.kv_transfer_config is None:
        return
    refused = ["a model with sliding-window layers (one block table per group)"] if hybrid else []
    refused += _one_table_knobs(config)
    if config.cache_config.kv_cache_dtype != "auto":
        refused.append(f"kv_cache_dtype={config.cache_config.kv_cache_dtype!r} (the connector copies no scales)")
    if refused:
        raise ValueError(f"kv_transfer_config ({config.kv_transfer_config.kv_connector}) does not support "
                         f"{', '.join(refused)}: leave them out, or leave kv_transfer_config out")
