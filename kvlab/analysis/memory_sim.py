"""Replay a request trace step by step and account where every KV-cache slot goes.

The KV arena has `num_slots` token slots. `simulate` runs a first-come-first-served server
over it with one of four allocators: the contiguous reservation policies `"max"`, `"pow2"`
and `"oracle"` of `kvlab.analysis.contiguous` (placed first-fit, or with `arena="buddy"` by the
binary buddy allocator the paper's Orca baselines assume, which rounds each reservation up to a
power of two: that rounding counts as internal fragmentation), or `"paged"` (a pool of
`num_slots // block_size` blocks of `block_size` slots, as in vLLM).

One scheduler step:

1. Requests whose `arrival_step` has come join the waiting queue.
2. Every running request that has processed its prompt generates one token and stores its
   state. A paged request takes a new block when its last one is full; if none is free, the most
   recently admitted request is preempted (its blocks are freed and it re-queues at the head of
   the waiting queue, to recompute its prompt and the tokens generated so far), as vLLM does.
   Contiguous requests reserved their whole range up front and never need more.
3. Unless a request was preempted this step, waiting requests are admitted in arrival order while
   their memory fits: a contiguous request needs one hole as large as its reservation, a paged
   one `ceil(prefill_len / block_size)` free blocks. The first one that doesn't fit waits and
   blocks the ones behind it. An admitted request processes its whole prompt in this step.
4. The arena is accounted (below).
5. Requests that stored their last output token finish and free their memory.

Accounting, at step 4 of every step, splits the arena's slots into five categories, each slot
counted exactly once. A running request holds `capacity` slots (its reservation, or its blocks
times `block_size`), stores `num_tokens` token states and will end at `final_len =
prompt_len + output_len` tokens:

* tokens: `num_tokens`, slots holding a token's key and value.
* reserved: `min(capacity, final_len) - num_tokens`, held slots the request will still fill.
* internal (fragmentation): `capacity - min(capacity, final_len)`, held slots it never fills.
* external (fragmentation): free slots stranded while a request waits. At a step that ends with a
  non-empty waiting queue, every free slot in a hole smaller than the head request's allocation
  unit (its whole reservation when contiguous, one block when paged) is external. After step 3 no
  hole fits the head request, so for the contiguous policies that is every free slot; for paged
  allocation it is only the `num_slots % block_size` slots that never form a block.
* free: the other free slots, idle because nobody waits for them (or, paged, because the waiting
  request needs more blocks than are free or the step preempted; running requests grow into them).

External fragmentation so defined includes a tail too small for any request (Orca (Max) in an
arena that is not a multiple of `max_model_len`), as the paper's allocator would strand it. The
stricter textbook kind, where the free slots would hold the waiting request if they were
contiguous, is reported too, as `external_strict`: a subset of external, not a sixth category.

Averages are over all simulated steps, and shares of *used* memory (the paper's Figure 2) are
ratios of sums over steps: `sum(tokens) / sum(tokens + reserved + internal + external)`. A
request's wait is the number of steps it ends in the waiting queue, before its admission and
after any preemption; `mean_wait_steps` averages it over completed requests.
"""

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvlab.analysis.contiguous import ARENAS, POLICIES, make_arena, reservation_slots
from kvlab.analysis.traces import TraceRequest
from kvlab.core.paging import num_blocks_needed
from kvlab.validation import check_block_size, check_positive_int

ALLOCATORS: tuple[str, ...] = (*POLICIES, "paged")
CATEGORIES: tuple[str, ...] = ("tokens", "reserved", "internal", "external", "free")
USED_CATEGORIES: tuple[str, ...] = ("tokens", "reserved", "internal", "external")


@dataclass(slots=True)
class _Sequence:
    """A request's state inside the simulator."""

    request: TraceRequest
    num_generated: int = 0  # output tokens produced so far; survives a preemption
    num_tokens: int = 0  # token states stored in the KV cache now
    capacity: int = 0  # slots held now
    start: int = -1  # contiguous only: first slot of the reserved range
    wait_steps: int = 0

    @property
    def prefill_len(self) -> int:
        """Tokens the next admission computes: the prompt plus any output being recomputed."""
        return self.request.prompt_len + self.num_generated


class _ContiguousAllocator:
    """Each request reserves one contiguous range chosen by a reservation policy."""

    def __init__(self, policy: str, num_slots: int, max_model_len: int, arena: str = "first-fit") -> None:
        self.policy = policy
        self.max_model_len = max_model_len
        self.arena = make_arena(arena, num_slots)

    @property
    def usable_slots(self) -> int:
        """Slots a single request could ever hold."""
        return self.arena.largest_range

    def peak_slots(self, request: TraceRequest) -> int:
        """Slots the request holds at its largest: its reservation."""
        r = request
        return reservation_slots(self.policy, r.prompt_len, r.output_len, self.max_model_len)

    def admission_slots(self, seq: _Sequence) -> int:
        """Slots the sequence needs, in one hole, to be admitted."""
        return self.peak_slots(seq.request)

    def try_admit(self, seq: _Sequence) -> bool:
        """Reserve the sequence's range in the arena, or return False if no hole fits."""
        size = self.peak_slots(seq.request)
        start = self.arena.allocate(size)
        if start is None:
            return False
        seq.start, seq.capacity = start, self.arena.block_size(size)
        return True

    def try_grow(self, seq: _Sequence) -> bool:
        """Make room for the sequence's next token."""
        # The reservation covers the final length, so there is always room.
        return True

    def release(self, seq: _Sequence) -> None:
        """Return the sequence's range to the arena."""
        self.arena.free(seq.start)
        seq.start, seq.capacity = -1, 0

    def stranded_slots(self, head: _Sequence) -> int:
        """Free slots in holes too small for the waiting `head`'s reservation."""
        unit = self.peak_slots(head.request)
        return sum(size for size in self.arena.hole_sizes if size < unit)


class _PagedAllocator:
    """Each request holds just enough fixed-size blocks for the tokens it has stored."""

    def __init__(self, block_size: int, num_slots: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_slots // block_size
        self.num_free_blocks = self.num_blocks
        self.tail_slots = num_slots - self.num_blocks * block_size

    def _blocks_for(self, num_tokens: int) -> int:
        return num_blocks_needed(num_tokens, self.block_size)

    @property
    def usable_slots(self) -> int:
        """Slots a single request could ever hold: the whole pool."""
        return self.num_blocks * self.block_size

    def peak_slots(self, request: TraceRequest) -> int:
        """Slots the request holds at its largest: blocks for its final length."""
        return self._blocks_for(request.final_len) * self.block_size

    def admission_slots(self, seq: _Sequence) -> int:
        """Slots, in whole blocks, the sequence needs to be admitted."""
        return self._blocks_for(seq.prefill_len) * self.block_size

    def try_admit(self, seq: _Sequence) -> bool:
        """Take blocks for the sequence's prefill, or return False if too few are free."""
        need = self._blocks_for(seq.prefill_len)
        if need > self.num_free_blocks:
            return False
        self.num_free_blocks -= need
        seq.capacity = need * self.block_size
        return True

    def try_grow(self, seq: _Sequence) -> bool:
        """Make room for the sequence's next token, taking a block if its last one is full."""
        if seq.num_tokens < seq.capacity:
            return True
        if self.num_free_blocks == 0:
            return False
        self.num_free_blocks -= 1
        seq.capacity += self.block_size
        return True

    def release(self, seq: _Sequence) -> None:
        """Return the sequence's blocks to the pool."""
        self.num_free_blocks += seq.capacity // self.block_size
        seq.capacity = 0

    def stranded_slots(self, head: _Sequence) -> int:
        """Free slots that cannot serve the waiting `head`."""
        # Any free block serves a paged request, so only the tail that is not a block is stranded.
        return self.tail_slots


@dataclass(slots=True)
class SimResult:
    """Per-step slot accounting of one simulated run, with its averages."""

    allocator: str  # "max", "pow2", "oracle" or "paged"
    block_size: int | None  # None for the contiguous policies
    num_slots: int
    max_model_len: int
    # Per-step arrays, one entry per simulated step; the five categories sum to num_slots.
    steps: np.ndarray  # the step numbers
    tokens: np.ndarray
    reserved: np.ndarray
    internal: np.ndarray
    external: np.ndarray
    free: np.ndarray
    external_strict: np.ndarray  # the part of external at steps where free slots would suffice
    num_running: np.ndarray
    num_waiting: np.ndarray  # arrived requests not running, after admission
    num_requests: int
    num_completed: int
    mean_wait_steps: float  # over completed requests: steps spent in the waiting queue
    num_preemptions: int
    wait_steps: dict[int, int] = field(default_factory=dict)  # request_id -> steps waited
    arena: str | None = None  # what placed a contiguous policy's ranges ("first-fit" or "buddy"); None when paged

    @property
    def label(self) -> str:
        """A short name for tables and plot legends."""
        if self.allocator == "paged":
            return f"paged(bs={self.block_size})"
        return f"{self.allocator}(buddy)" if self.arena == "buddy" else self.allocator

    @property
    def num_steps(self) -> int:
        """Number of simulated steps."""
        return len(self.steps)

    @property
    def used(self) -> np.ndarray:
        """Per-step slots in use: everything but free."""
        return self.tokens + self.reserved + self.internal + self.external

    def category(self, name: str) -> np.ndarray:
        """The per-step slot counts of one category of `CATEGORIES`."""
        if name not in CATEGORIES:
            raise ValueError(f"unknown category {name!r}; expected one of {CATEGORIES}")
        return getattr(self, name)

    def arena_shares(self) -> dict[str, float]:
        """Average share of the arena in each category; the shares sum to 1."""
        denom = self.num_slots * max(self.num_steps, 1)
        return {c: float(self.category(c).sum()) / denom for c in CATEGORIES}

    def used_shares(self) -> dict[str, float]:
        """Share of used slot-steps in tokens, reserved, internal and external (Figure 2's bars)."""
        total = float(self.used.sum())
        if not total:
            return dict.fromkeys(USED_CATEGORIES, 0.0)
        return {c: float(self.category(c).sum()) / total for c in USED_CATEGORIES}

    @property
    def token_share(self) -> float:
        """Share of used KV memory that holds token states: the paper's headline metric."""
        return self.used_shares()["tokens"]


_Allocator = _ContiguousAllocator | _PagedAllocator


def _make_allocator(allocator: str, num_slots: int, max_model_len: int, block_size: int,
                    arena: str = "first-fit") -> _Allocator:
    """Build the allocator named `allocator`, validating its arguments."""
    if arena not in ARENAS:
        raise ValueError(f"unknown arena {arena!r}; expected one of {ARENAS} (it places the contiguous policies)")
    if allocator in POLICIES:
        return _ContiguousAllocator(allocator, num_slots, max_model_len, arena)
    if allocator == "paged":
        check_block_size(block_size)
        if block_size > num_slots:
            raise ValueError(f"block_size={block_size} exceeds num_slots={num_slots}")
        return _PagedAllocator(block_size, num_slots)
    raise ValueError(f"unknown allocator {allocator!r}; expected one of {ALLOCATORS}")


def _check_requests(requests: Sequence[TraceRequest], allocator: _Allocator, max_model_len: int) -> None:
    """Reject requests the server could never run, before simulating anything."""
    ids = set()
    for r in requests:
        if r.request_id in ids:
            raise ValueError(f"duplicate request_id {r.request_id}")
        ids.add(r.request_id)
        if r.final_len > max_model_len:
            raise ValueError(f"request {r.request_id} needs {r.final_len} tokens > max_model_len={max_model_len}")
        need, limit = allocator.peak_slots(r), allocator.usable_slots
        if need > limit:
            raise ValueError(f"request {r.request_id} needs {need} slots; the arena has {limit}")


def _decode(running: list[_Sequence], waiting: deque[_Sequence], alloc: _Allocator) -> int:
    """Let every running sequence store one more token, preempting the youngest when out of
    memory; return the number of preemptions."""
    num_preempted = 0
    i = 0
    while i < len(running):
        seq = running[i]
        while not alloc.try_grow(seq):
            victim = running.pop()
            alloc.release(victim)
            victim.num_tokens = 0
            waiting.appendleft(victim)  # victims leave youngest first, so the oldest ends first
            num_preempted += 1
            if victim is seq:
                return num_preempted  # it was the youngest: nobody after it is left to decode
        seq.num_tokens += 1
        seq.num_generated += 1
        i += 1
    return num_preempted


def _admit(waiting: deque[_Sequence], running: list[_Sequence], alloc: _Allocator) -> None:
    """Admit waiting sequences in arrival order until the first one that does not fit."""
    while waiting and alloc.try_admit(waiting[0]):
        seq = waiting.popleft()
        seq.num_tokens = seq.prefill_len
        running.append(seq)


def _account(running: list[_Sequence], waiting: deque[_Sequence], alloc: _Allocator,
             num_slots: int) -> tuple[int, int, int, int, int, int]:
    """Split the arena into tokens, reserved, internal, external and free, plus strict external."""
    tokens = reserved = internal = 0
    for seq in running:
        fillable = min(seq.capacity, seq.request.final_len)
        tokens += seq.num_tokens
        reserved += fillable - seq.num_tokens
        internal += seq.capacity - fillable
    free = num_slots - tokens - reserved - internal
    external = external_strict = 0
    if waiting:
        head = waiting[0]
        external = alloc.stranded_slots(head)
        if free >= alloc.admission_slots(head):
            external_strict = external
    return tokens, reserved, internal, external, free - external, external_strict


def simulate(requests: Sequence[TraceRequest], allocator: str, *, num_slots: int, max_model_len: int = 2048,
             block_size: int = 16, max_steps: int | None = None, arena: str = "first-fit") -> SimResult:
    """Replay `requests` FCFS against `allocator` ("max", "pow2", "oracle" or "paged"); `arena` places the
    contiguous policies' ranges ("first-fit" or "buddy")."""
    check_positive_int("num_slots", num_slots)
    check_positive_int("max_model_len", max_model_len)
    if max_steps is not None and max_steps < 0:
        raise ValueError(f"max_steps must be >= 0, got {max_steps}")
    alloc = _make_allocator(allocator, num_slots, max_model_len, block_size, arena)
    _check_requests(requests, alloc, max_model_len)

    pending = deque(sorted(requests, key=lambda r: (r.arrival_step, r.request_id)))
    waiting: deque[_Sequence] = deque()
    running: list[_Sequence] = []  # in admission order, so the last one is the preemption victim
    step = pending[0].arrival_step if pending else 0
    rows: list[tuple[int, ...]] = []
    wait_steps: dict[int, int] = {}
    num_preemptions = 0

    while (pending or waiting or running) and (max_steps is None or len(rows) < max_steps):
        while pending and pending[0].arrival_step <= step:
            waiting.append(_Sequence(pending.popleft()))
        preempted = _decode(running, waiting, alloc)
        num_preemptions += preempted
        # A step that had to preempt is short of memory; admitting now would only evict again.
        if not preempted:
            _admit(waiting, running, alloc)
        accounted = _account(running, waiting, alloc, num_slots)
        rows.append((step, *accounted, len(running), len(waiting)))
        for seq in waiting:
            seq.wait_steps += 1
        for seq in running:
            if seq.num_generated == seq.request.output_len:
                alloc.release(seq)
                wait_steps[seq.request.request_id] = seq.wait_steps
        running = [seq for seq in running if seq.capacity]
        step += 1

    table = np.array(rows, dtype=np.int64).reshape(-1, 9)
    return SimResult(
        allocator=allocator,
        arena=None if allocator == "paged" else arena,
        block_size=block_size if allocator == "paged" else None,
        num_slots=num_slots,
        max_model_len=max_model_len,
        steps=table[:, 0],
        tokens=table[:, 1],
        reserved=table[:, 2],
        internal=table[:, 3],
        external=table[:, 4],
        free=table[:, 5],
        external_strict=table[:, 6],
        num_running=table[:, 7],
        num_waiting=table[:, 8],
        num_requests=len(requests),
        num_completed=len(wait_steps),
        mean_wait_steps=float(np.mean(list(wait_steps.values()))) if wait_steps else 0.0,
        num_preemptions=num_preemptions,
        wait_steps=wait_steps,
    )
