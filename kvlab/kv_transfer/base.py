"""The connector API, in the shape of vLLM V1's KVConnectorBase_V1 (kv_connector/v1/base.py).

One class serves both roles; the engine builds one instance per role and each calls only its own half. In
vLLM the two halves live in different processes (the scheduler's and each GPU worker's), so all they share
is what the metadata carries; kvlab keeps them in one process but passes only the metadata between them,
so a connector written here could be split the same way.
"""

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable

from kvlab.kv_transfer.config import KVTransferConfig


class KVConnectorRole(enum.Enum):
    """Which half of a connector an instance is: the scheduler's bookkeeping or the worker's copies."""

    SCHEDULER = "scheduler"
    WORKER = "worker"


class KVConnectorMetadata:
    """What the scheduler's half tells the worker's half about one step; each connector subclasses it."""


class KVConnectorBase_V1(ABC):  # noqa: N801 (vLLM's name)
    """A KV connector: the scheduler-side calls decide, the worker-side calls copy, the metadata links them."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole):
        if not isinstance(config, KVTransferConfig):
            raise ValueError(f"config must be a KVTransferConfig, got {type(config).__name__}")
        if not isinstance(role, KVConnectorRole):
            raise ValueError(f"role must be a KVConnectorRole, got {role!r}")
        self.config = config
        self.role = role
        self._metadata: KVConnectorMetadata | None = None

    # ----- worker side -----
    def register_kv_caches(self, cache) -> None:
        """Hand the worker's half the runner's paged cache (its k_pools and v_pools) once, before any step."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Set this step's metadata, before the forward pass."""
        self._check_role(KVConnectorRole.WORKER, "bind_connector_metadata")
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        """Drop this step's metadata, after the forward pass."""
        self._metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        if self._metadata is None:
            raise RuntimeError("no connector metadata is bound: call bind_connector_metadata first")
        return self._metadata

    @abstractmethod
    def start_load_kv(self) -> None:
        """Start copying this step's external K/V into the paged pools, before the forward pass."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until layer layer_name's loads are in the pools (the forward pass reads them next)."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata) -> None:
        """Start saving one layer's K/V as soon as the forward pass has written it."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves have read what they need from the pools (they may be rewritten next)."""

    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose asynchronous saves finished, requests whose asynchronous loads finished): None, None for
        a connector that finishes every copy within its step."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose loads (reported in get_finished) failed since the last call: the scheduler recomputes them."""
        return set()

    def get_handshake_metadata(self) -> dict | None:
        """What a peer needs to reach this worker (its address for pulls), collected by the engine once at start."""
        return None

    def shutdown(self) -> None:
        """Stop any thread or socket the connector runs; called once, when the engine shuts down."""

    # ----- scheduler side -----
    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        """The workers' handshake metadata (get_handshake_metadata), handed to the scheduler's half once at start."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens after num_computed_tokens the connector can supply, whether it loads them asynchronously)."""

    @abstractmethod
    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request's blocks are allocated (block_ids: its whole table): note where the external tokens land."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """This step's copy orders for the worker; resets what the scheduler's half collected for the step."""

    def update_connector_output(self, finished_sending: set[str] | None, finished_recving: set[str] | None) -> None:
        """After the step: the worker's copies that finished (what get_finished reported)."""

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """A request stopped: (whether its blocks must wait for a save before they are freed, params for a peer).

        With delay_free the scheduler frees the blocks only once get_finished names the request in finished_sending.
        """
        return False, None

    def _check_role(self, role: KVConnectorRole, call: str) -> None:
        if self.role is not role:
            raise RuntimeError(f"{call} is a {role.value}-side call but this connector is the {self.role.value}'s")
