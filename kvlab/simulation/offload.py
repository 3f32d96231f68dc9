"""A KV connector's copies on the simulated clock: the worker's half of an offloading tier, played by timing alone.

The scheduler's half is the real one (kvlab.kv_transfer.OffloadingConnector, built with role SCHEDULER and the
deployment's bytes per block): every lookup, pin, eviction and store order is the live engine's. What the worker
would copy, this module times. Each GPU of a tensor-parallel deployment holds 1 / tp of every block and copies it
over its own PCIe link, so a copy of n blocks takes

    n * bytes_per_block / tensor_parallel_size / link bytes per second

Loads (host -> GPU) queue on one copy engine per GPU, first come first served, as cudaMemcpyAsync calls on one
stream do. A load is asynchronous when the connector says so (vLLM's OffloadingConnector: the request waits in
WAITING_FOR_REMOTE_KVS, holding its blocks, while other requests run; the worker reports it in finished_recving at
the end of the first step that ends after its copy does). A load for a request scheduled in the same step is
synchronous (kvlab's connector with async_loads=False): the step's forward pass waits for it.

Saves (GPU -> host) run on their own stream in the other direction of the link (PCIe is full duplex), beside the
forward pass that writes the blocks: a step lasts max(forward pass, its saves), so saves cost nothing until they
need more time than the compute they hide behind. kvlab's connector finishes a step's saves within the step
(wait_for_save), so no backlog carries over.

The links: one direction of the GPU's host interface at its datasheet rate (HOST_LINKS), times PCIE_EFFICIENCY.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from kvlab.simulation.gpus import GPU, get_gpu
from kvlab.validation import check_number, check_positive_int

# One direction of each GPU's host interface, from the datasheets kvlab.simulation.gpus cites: H100 SXM and H200 SXM
# list "PCIe Gen5: 128 GB/s", the A100s "PCIe Gen4: 64 GB/s", L4 PCIe Gen4 x16 64 GB/s, T4 PCIe Gen3 x16 32 GB/s;
# each figure is both directions together, halved here.
HOST_LINKS = {"A100-40GB": 32e9, "A100-80GB": 32e9, "H100-SXM": 64e9, "H200": 64e9, "L4": 32e9, "T4": 16e9}

# The share of that figure a DMA copy of whole blocks reaches. vLLM's offloading blog measured about 50 GB/s one
# way on an H100 (PCIe Gen5, blocks of 2 MB: 0.78 of 64 GB/s); the course's facts give 25-31 GB/s on PCIe 4 x16
# (0.78-0.97 of 32 GB/s). 0.78 is the lower end of both.
PCIE_EFFICIENCY = 0.78


def host_link_bytes_per_s(gpu: GPU | str, efficiency: float = PCIE_EFFICIENCY) -> float:
    """Bytes per second one GPU copies to or from host memory: its datasheet host link (one way) x efficiency."""
    gpu = get_gpu(gpu)
    efficiency = check_number("efficiency", efficiency, allow_zero=False, what="share of the link")
    if efficiency > 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")
    return HOST_LINKS[gpu.name] * efficiency


@dataclass(frozen=True, slots=True)
class KVTransferLinks:
    """How fast the simulated worker copies blocks: bytes of one block on one GPU, and each direction's rate."""

    bytes_per_block: int            # of one GPU's share of a block (all its layers, K and V)
    load_bytes_per_s: float         # host -> GPU
    save_bytes_per_s: float         # GPU -> host

    def __post_init__(self):
        check_positive_int("bytes_per_block", self.bytes_per_block)
        for name in ("load_bytes_per_s", "save_bytes_per_s"):
            check_number(name, getattr(self, name), allow_zero=False, what="number of bytes per second")

    @classmethod
    def for_deployment(cls, bytes_per_block: int, gpu: GPU | str, tensor_parallel_size: int = 1,
                       efficiency: float = PCIE_EFFICIENCY) -> KVTransferLinks:
        """Links of a deployment: bytes_per_block is the whole block's (as the connector is sized), split over tp."""
        tp = check_positive_int("tensor_parallel_size", tensor_parallel_size)
        check_positive_int("bytes_per_block", bytes_per_block)
        rate = host_link_bytes_per_s(gpu, efficiency)
        return cls(-(-bytes_per_block // tp), rate, rate)

    def load_seconds(self, num_blocks: int) -> float:
        return num_blocks * self.bytes_per_block / self.load_bytes_per_s

    def save_seconds(self, num_blocks: int) -> float:
        return num_blocks * self.bytes_per_block / self.save_bytes_per_s


class SimulatedKVTransfers:
    """The worker's half of an offloading connector on the virtual clock: when each step's loads and saves end.

    Per step: start_load_kv (the loads queue on the copy engine; returns how long the forward pass waits for the
    synchronous ones), save_seconds (the saves beside the pass), get_finished (the asynchronous loads done by the
    step's end). Totals are kept for the result.
    """

    def __init__(self, links: KVTransferLinks):
        if not isinstance(links, KVTransferLinks):
            raise ValueError(f"links must be a KVTransferLinks, got {type(links).__name__}")
        self.links = links
        self.copy_engine_free_at = 0.0              # the host -> GPU copy engine is busy until then
        self.pending: dict[str, float] = {}         # request id -> when its asynchronous load ends
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0
        self.load_s = 0.0                           # copy time of every load
        self.save_s = 0.0                           # copy time of every save
        self.load_wait_s = 0.0                      # time forward passes waited for synchronous loads
        self.save_bound_s = 0.0                     # time steps lasted beyond their forward pass for saves

    def start_load_kv(self, metadata, scheduled: Collection[str], now: float) -> float:
        """Queue the step's loads at `now`; the seconds the forward pass waits (synchronous loads only)."""
        ready = now
        for rid, pairs in metadata.loads.items():
            if not pairs:
                continue
            seconds = self.links.load_seconds(len(pairs))
            end = max(now, self.copy_engine_free_at) + seconds
            self.copy_engine_free_at = end
            self.num_loaded_blocks += len(pairs)
            self.load_s += seconds
            if rid in scheduled:      # its tokens after the loaded ones run in this very pass
                ready = max(ready, end)
            else:
                self.pending[rid] = end
        self.load_wait_s += ready - now
        return ready - now

    def save_seconds(self, metadata) -> float:
        """Copy time of the step's saves, which run beside its forward pass."""
        num_blocks = sum(len(pairs) for pairs in metadata.saves.values())
        self.num_saved_blocks += num_blocks
        seconds = self.links.save_seconds(num_blocks)
        self.save_s += seconds
        return seconds

    def next_load_end(self) -> float | None:
        """When the first asynchronous load still in flight ends; None with none in flight."""
        return min(self.pending.values()) if self.pending else None

    def get_finished(self, now: float) -> set[str] | None:
        """The requests whose asynchronous loads have ended by `now` (vLLM's finished_recving), or None."""
        done = {rid for rid, end in self.pending.items() if end <= now}
        for rid in done:
            del self.pending[rid]
        return done or None
