"""KV-cache events: what a block pool tells the world about its prefix cache, in vLLM's schema.

vLLM's engines publish three events (vllm/distributed/kv_events.py), and routers (llm-d's KV-cache manager,
NVIDIA Dynamo's KV router) rebuild from them an index of which replica holds which block hash:

    BlockStored       blocks just cached: their hashes in chain order, the hash of the block before the first
                      (None at the start of a sequence), the token ids they hold (block_size per block),
                      block_size, lora_id (None: no adapter) and medium ("GPU"; an offloading tier says "CPU")
    BlockRemoved      cached blocks whose contents were evicted (their block was reused)
    AllBlocksCleared  the whole prefix cache was dropped (vLLM's reset_prefix_cache)

Events travel in batches, one per engine step that produced any: KVEventBatch(ts, events,
data_parallel_rank). On the wire vLLM encodes them with msgspec as arrays, not maps (array_like=True), each
event's array led by its class name (tag=True), and trailing fields left at their default omitted
(omit_defaults=True):

    batch  = [ts, [event, ...]]                     (+ data_parallel_rank when it is set)
    event  = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
           | ["BlockRemoved", block_hashes, medium]
           | ["AllBlocksCleared"]

as_wire and from_wire below produce and read exactly that structure of lists; the publisher
(kvlab.engine.kv_events) packs it with msgpack, so a subscriber written for vLLM decodes kvlab's events.
vLLM's msgspec also omits an event's trailing fields equal to their defaults (lora_id None, medium None);
kvlab writes every event field, which msgspec's decoder accepts as well.

A block's hash names its whole prefix (kvlab.core.prefix_cache), which is what lets a router compare replicas:
two replicas that cached the same tokens report the same hashes, provided they hash alike.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

GPU_MEDIUM = "GPU"


@dataclass(frozen=True)
class BlockStored:
    """Blocks newly cached, in chain order: hashes, parent hash, their token ids (block_size each), block size."""

    block_hashes: list[Hashable]
    parent_block_hash: Hashable | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = GPU_MEDIUM

    def __post_init__(self):
        if len(self.token_ids) != len(self.block_hashes) * self.block_size:
            raise ValueError(f"BlockStored needs block_size ({self.block_size}) token ids per block: "
                             f"{len(self.block_hashes)} blocks but {len(self.token_ids)} token ids")


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks whose contents are gone (their blocks were reused)."""

    block_hashes: list[Hashable]
    medium: str | None = GPU_MEDIUM


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block is gone at once."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


@dataclass(frozen=True)
class KVEventBatch:
    """One step's events, with the wall-clock time they were taken (seconds since the epoch)."""

    ts: float
    events: list = field(default_factory=list)
    data_parallel_rank: int | None = None


def event_as_wire(event) -> list:
    """One event as vLLM's tagged array: its class name, then its fields in order."""
    if isinstance(event, BlockStored):
        return ["BlockStored", list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
                event.block_size, event.lora_id, event.medium]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise ValueError(f"not a KV-cache event: {event!r}")


def as_wire(batch: KVEventBatch) -> list:
    """A batch as vLLM's array: [ts, events] (+ data_parallel_rank when set)."""
    wire = [batch.ts, [event_as_wire(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        wire.append(batch.data_parallel_rank)
    return wire


def event_from_wire(wire: Sequence):
    """The event a tagged array describes; ValueError naming what is wrong otherwise."""
    if not isinstance(wire, (list, tuple)) or not wire or wire[0] not in EVENT_TYPES:
        raise ValueError(f"a KV-cache event is an array led by one of {', '.join(EVENT_TYPES)}, got {wire!r}")
    cls, fields = EVENT_TYPES[wire[0]], list(wire[1:])
    names = [f for f in cls.__dataclass_fields__]
    if len(fields) > len(names):
        raise ValueError(f"{wire[0]} has {len(names)} fields, got {len(fields)}: {wire!r}")
    try:
        return cls(**dict(zip(names, fields)))
    except TypeError as err:  # a required field is missing
        raise ValueError(f"{wire[0]} is missing fields: {err}") from None


def from_wire(wire: Sequence) -> KVEventBatch:
    """The batch a [ts, events(, rank)] array describes."""
    if not isinstance(wire, (list, tuple)) or len(wire) not in (2, 3) or not isinstance(wire[1], (list, tuple)):
        raise ValueError(f"a KV event batch is [ts, events] or [ts, events, data_parallel_rank], got {wire!r}")
    return KVEventBatch(float(wire[0]), [event_from_wire(e) for e in wire[1]], wire[2] if len(wire) == 3 else None)
