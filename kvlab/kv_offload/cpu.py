"""The CPU tier's bookkeeping: how many host blocks a byte budget buys, as vLLM's backends/cpu.py.

vLLM sizes the host pool from kv_offloading_size, the bytes of CPU memory to give to KV copies. A block
of block_size tokens holds K and V for every layer:

    bytes per block = num_layers * 2 * block_size * num_kv_heads * head_dim * bytes per element
    num_blocks      = kv_offloading_size // bytes per block     (a partial block buys nothing)

The host tensors themselves live in kvlab.kv_offload.worker; this module stays torch-free so the scheduler
can size the tier without tensors (the element size is a plain int: 4 for float32, 2 for bfloat16).
"""

from kvlab.kv_offload.backend import Backend
from kvlab.kv_offload.mediums import CPU_MEDIUM
from kvlab.validation import check_block_size, check_positive_int


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       element_size: int) -> int:
    """Bytes of K and V, all layers, for one block: num_layers * 2 * block_size * num_kv_heads * head_dim * size."""
    return (check_positive_int("num_layers", num_layers) * 2 * check_block_size(block_size)
            * check_positive_int("num_kv_heads", num_kv_heads) * check_positive_int("head_dim", head_dim)
            * check_positive_int("element_size", element_size))


def num_blocks_for_budget(kv_offloading_size: int, bytes_per_block: int) -> int:
    """Whole blocks that fit in kv_offloading_size bytes; ValueError if not even one does."""
    budget = check_positive_int("kv_offloading_size", kv_offloading_size)
    per_block = check_positive_int("bytes_per_block", bytes_per_block)
    if budget < per_block:
        raise ValueError(f"kv_offloading_size={budget} bytes is less than one block ({per_block} bytes): "
                         "raise the budget or offload nothing")
    return budget // per_block


class CPUBackend(Backend):
    """The ids of num_blocks host blocks (slots of the host pool in kvlab.kv_offload.worker)."""

    def __init__(self, block_size: int, num_blocks: int):
        super().__init__(CPU_MEDIUM, block_size, num_blocks)

    @classmethod
    def from_budget(cls, kv_offloading_size: int, block_size: int, bytes_per_block: int) -> "CPUBackend":
        """A CPU tier with as many blocks as kv_offloading_size bytes hold."""
        return cls(block_size, num_blocks_for_budget(kv_offloading_size, bytes_per_block))
