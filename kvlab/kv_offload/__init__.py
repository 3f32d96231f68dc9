"""KV offloading: a second home for KV blocks outside the GPU pool, as vLLM V1's vllm/v1/kv_offload.

When the GPU's block pool evicts a cached block, its K/V is lost and a later request with the same prefix
recomputes it. An offloading tier keeps a copy: the scheduler asks the tier's OffloadingManager how many of a
request's leading blocks it holds (lookup), pins them while they are copied back (prepare_load ...
complete_load), and copies new full blocks out after they are computed (prepare_store ... complete_store),
evicting older copies by LRU or ARC when the tier is full.

The package is split the way vLLM splits it:

* bookkeeping, plain Python and torch-free like kvlab.core: abstract (the API), mediums (their names),
  backend (a medium's block ids), policy_manager (what both policies share), lru_manager and arc_manager
  (the two eviction policies), cpu (a host tier sized from a byte budget);
* movers, which touch tensors and files: worker (block copies between the device pools and a host pool) and
  disk (one checksummed safetensors file per block). Import them by name; this package imports neither.
"""

from kvlab.kv_offload.abstract import LoadStoreSpec, OffloadingEvent, OffloadingManager, PrepareStoreOutput
from kvlab.kv_offload.arc_manager import ARCOffloadingManager
from kvlab.kv_offload.backend import Backend, BlockStatus
from kvlab.kv_offload.cpu import CPUBackend, kv_bytes_per_block, num_blocks_for_budget
from kvlab.kv_offload.lru_manager import LRUOffloadingManager
from kvlab.kv_offload.mediums import CPU_MEDIUM, DISK_MEDIUM, GPU_MEDIUM

__all__ = [
    "ARCOffloadingManager", "Backend", "BlockStatus", "CPUBackend", "CPU_MEDIUM", "DISK_MEDIUM", "GPU_MEDIUM",
    "LRUOffloadingManager", "LoadStoreSpec", "OffloadingEvent", "OffloadingManager", "PrepareStoreOutput",
    "kv_bytes_per_block", "num_blocks_for_budget",
]
