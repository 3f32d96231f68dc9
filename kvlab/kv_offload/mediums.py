"""The names of the places a KV block can live, as LoadStoreSpec.medium and OffloadingEvent.medium spell them.

vLLM's vllm/v1/kv_offload/mediums.py gives each medium its own LoadStoreSpec class; kvlab uses one spec with
the medium's name, and these names, so a connector can tell a GPU-to-CPU copy from a CPU-to-disk one.
"""

GPU_MEDIUM = "GPU"  # the engine's own block pool (kvlab.cache.kv_storage)
CPU_MEDIUM = "CPU"  # a host pool (kvlab.kv_offload.worker)
DISK_MEDIUM = "DISK"  # a directory of block files (kvlab.kv_offload.disk)
