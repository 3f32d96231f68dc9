"""KV transfer: vLLM V1's KV connector API (vllm/distributed/kv_transfer/kv_connector/v1) on kvlab's engine.

A connector moves K/V between the engine's paged pools and somewhere else (another instance, host memory, a
disk). It is built twice, once per role: the scheduler's half decides which tokens of a request come from
outside and which blocks to copy out, and writes that into a KVConnectorMetadata; the model runner's half
carries the metadata's copies out around the forward pass. The scheduler calls, in this order per step:

    get_num_new_matched_tokens   at admission, after the GPU prefix-cache hit: tokens the connector can load
    update_state_after_alloc     once the request's blocks are allocated: which blocks the load fills
    build_connector_meta         at the end of schedule(): the step's copy orders, sent with the scheduler output
    update_connector_output      after the step: which copies finished
    request_finished             when a request stops or is aborted: may its blocks go back to the pool now?

and the runner: bind_connector_metadata, start_load_kv, wait_for_layer_load (per layer), save_kv_layer (per
layer), wait_for_save, get_finished, clear_connector_metadata.

    base                  KVConnectorRole, KVConnectorMetadata, KVConnectorBase_V1
    config                KVTransferConfig (kv_connector, kv_role, kv_connector_extra_config)
    factory               the connectors by name
    offloading_connector  OffloadingConnector: a CPU tier and a disk tier (kvlab.kv_offload) behind the GPU
                          prefix cache
    socket_connector      SocketConnector: disaggregated prefill/decode, a decode instance pulling a prefill
                          instance's blocks over TCP (vLLM's NixlConnector's flow)
"""

from kvlab.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from kvlab.kv_transfer.config import KVTransferConfig
from kvlab.kv_transfer.factory import KVConnectorFactory

__all__ = ["KVConnectorBase_V1", "KVConnectorFactory", "KVConnectorMetadata", "KVConnectorRole", "KVTransferConfig"]
