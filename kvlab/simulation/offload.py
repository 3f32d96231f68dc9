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

A disk tier behind the CPU tier (the connector's disk_loads, disk_saves, disk_removals) has links of its own: one
NVMe drive per GPU, each holding that GPU's share of every block, read at NVME_READ_BYTES_PER_S and written at
NVME_WRITE_BYTES_PER_S. Disk loads are always asynchronous (the connector answers load_async for any block on
disk): they queue on the drive's read side from the start of the step that orders them, and a request that loads
from both tiers is reported in finished_recving when the later of its two copies ends. The host -> GPU leg of a
disk read is left out: PCIe moves it about four times faster than the drive delivers it, and it overlaps the next
block's read. Disk writes are write-through: the step's new blocks are copied GPU -> host beside the forward pass
(kvlab's wait_for_save takes that snapshot, so it is charged to the save stream with the CPU tier's saves), then
written on the drive's write side from the step's end, one request's files after another. A request is reported in
finished_sending at the end of the first step that ends after every write ordered for it so far, and only then
does the connector's disk manager let a lookup find those blocks. Removals (files the disk tier evicts) cost
nothing. No files exist: SimulatedDiskFiles answers the connector's question whether a block's file is still there.
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

# One enterprise NVMe drive (PCIe 5.0 x4) per GPU: Samsung's PM1743, whose announcement (Samsung Newsroom, December
# 2021) gives sequential reads up to 13,000 MB/s and sequential writes up to 6,600 MB/s. NVIDIA's DGX H100 datasheet
# lists 8 NVMe U.2 data drives beside 8 GPUs, hence one drive per GPU. These are the drive's best sequential rates,
# an upper bound: one file per block share (512 KiB for Llama-3-8B at TP 4) is read and written whole.
NVME_READ_BYTES_PER_S = 13.0e9
NVME_WRITE_BYTES_PER_S = 6.6e9


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
    disk_read_bytes_per_s: float = NVME_READ_BYTES_PER_S    # the GPU's drive -> GPU (disk tier loads)
    disk_write_bytes_per_s: float = NVME_WRITE_BYTES_PER_S  # host -> the GPU's drive (disk tier writes)

    def __post_init__(self):
        check_positive_int("bytes_per_block", self.bytes_per_block)
        for name in ("load_bytes_per_s", "save_bytes_per_s", "disk_read_bytes_per_s", "disk_write_bytes_per_s"):
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

    def disk_read_seconds(self, num_blocks: int) -> float:
        return num_blocks * self.bytes_per_block / self.disk_read_bytes_per_s

    def disk_write_seconds(self, num_blocks: int) -> float:
        return num_blocks * self.bytes_per_block / self.disk_write_bytes_per_s


class SimulatedDiskFiles:
    """The disk tier's files as the simulated worker keeps them: the block hashes whose write has ended and whose
    file was not removed since. It stands in for the connector's DiskBlockStore, which the scheduler half asks only
    whether a loaded block's file is still there (a real read that fails deletes it)."""

    def __init__(self):
        self.hashes: set = set()

    def contains(self, block_hash) -> bool:
        return block_hash in self.hashes


class SimulatedKVTransfers:
    """The worker's half of an offloading connector on the virtual clock: when each step's loads, saves and disk
    writes end.

    Per step: start_load_kv (the loads queue on the copy engine and the drives' read sides; returns how long the
    forward pass waits for the synchronous ones), save_seconds (the saves beside the pass), start_disk_writes (from
    the step's end), get_finished (the asynchronous loads done by the step's end) and get_finished_sending (the
    requests whose disk writes are done by then). Totals are kept for the result.
    """

    def __init__(self, links: KVTransferLinks, disk_files: SimulatedDiskFiles | None = None):
        if not isinstance(links, KVTransferLinks):
            raise ValueError(f"links must be a KVTransferLinks, got {type(links).__name__}")
        self.links = links
        self.disk_files = disk_files                # None: no disk tier
        self.copy_engine_free_at = 0.0              # the host -> GPU copy engine is busy until then
        self.disk_read_free_at = 0.0                # the drive's reads, queued in order, until then
        self.disk_write_free_at = 0.0               # the drive's writes, queued in order, until then
        self.pending: dict[str, float] = {}         # request id -> when its asynchronous load (every tier) ends
        self.pending_writes: dict[str, tuple[float, list]] = {}  # request id -> (its last write's end, its hashes)
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0
        self.num_disk_loaded_blocks = 0
        self.num_disk_written_blocks = 0
        self.load_s = 0.0                           # copy time of every load
        self.save_s = 0.0                           # copy time of every save (disk writes' snapshots included)
        self.disk_load_s = 0.0                      # drive read time of every disk load
        self.disk_write_s = 0.0                     # drive write time of every disk write
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
                self.pending[rid] = max(end, self.pending.get(rid, end))
        for rid, pairs in getattr(metadata, "disk_loads", {}).items():
            if not pairs:
                continue
            if rid in scheduled:
                raise ValueError(f"request {rid!r} loads from disk and computes in the same step: a disk load is "
                                 "asynchronous, the connector must have answered load_async=True")
            seconds = self.links.disk_read_seconds(len(pairs))
            end = max(now, self.disk_read_free_at) + seconds
            self.disk_read_free_at = end
            self.num_disk_loaded_blocks += len(pairs)
            self.disk_load_s += seconds
            self.pending[rid] = max(end, self.pending.get(rid, end))
        self.load_wait_s += ready - now
        return ready - now

    def save_seconds(self, metadata) -> float:
        """Copy time of the step's saves (and the disk writes' snapshots), which run beside its forward pass."""
        num_blocks = sum(len(pairs) for pairs in metadata.saves.values())
        self.num_saved_blocks += num_blocks
        num_blocks += sum(len(pairs) for pairs in getattr(metadata, "disk_saves", {}).values())
        seconds = self.links.save_seconds(num_blocks)
        self.save_s += seconds
        return seconds

    def start_disk_writes(self, metadata, step_end: float) -> None:
        """Queue the step's disk writes on the drive from the step's end (after its snapshot); removals are free."""
        disk_saves = getattr(metadata, "disk_saves", {})
        removals = getattr(metadata, "disk_removals", [])
        if (disk_saves or removals) and self.disk_files is None:
            raise ValueError("the connector orders disk writes but the transfers were built without disk_files")
        for block_hash in removals:
            self.disk_files.hashes.discard(block_hash)
        for rid, pairs in disk_saves.items():
            if not pairs:
                continue
            seconds = self.links.disk_write_seconds(len(pairs))
            end = max(step_end, self.disk_write_free_at) + seconds
            self.disk_write_free_at = end
            self.num_disk_written_blocks += len(pairs)
            self.disk_write_s += seconds
            _, hashes = self.pending_writes.get(rid, (end, []))
            self.pending_writes[rid] = (end, hashes + [h for _, h in pairs])

    def next_load_end(self) -> float | None:
        """When the first asynchronous load still in flight ends; None with none in flight."""
        return min(self.pending.values()) if self.pending else None

    def next_copy_end(self) -> float | None:
        """When the first asynchronous load or disk write still in flight ends; None with none in flight."""
        ends = [end for end, _ in self.pending_writes.values()]
        if self.pending:
            ends.append(min(self.pending.values()))
        return min(ends) if ends else None

    def get_finished(self, now: float) -> set[str] | None:
        """The requests whose asynchronous loads have ended by `now` (vLLM's finished_recving), or None."""
        done = {rid for rid, end in self.pending.items() if end <= now}
        for rid in done:
            del self.pending[rid]
        return done or None

    def get_finished_sending(self, now: float) -> set[str] | None:
        """The requests whose disk writes so far have all ended by `now` (finished_sending), their files now there."""
        done = {rid for rid, (end, _) in self.pending_writes.items() if end <= now}
        for rid in done:
            self.disk_files.hashes.update(self.pending_writes.pop(rid)[1])
        return done or None
