"""Contiguous KV-cache allocation, the way serving systems reserved memory before paging.

A request reserves one contiguous range of token slots in a fixed arena when it is admitted and
keeps it until it finishes. How large that range is depends on the reservation policy:

* `"max"`: `max_model_len` slots, whatever the request's length (Orca (Max)).
* `"pow2"`: the next power of two at or above the request's final length `prompt_len +
  output_len`, capped at `max_model_len` (Orca (Pow2)).
* `"oracle"`: exactly the final length; an oracle that knows the output length in advance
  (Orca (Oracle)).

Two arenas place the ranges, so external fragmentation arises for real (free slots scattered over
holes that are each too small for the next request):

* `ContiguousArena`: first-fit from a free list of holes sorted by address; a freed range merges
  with any free neighbour.
* `BuddyArena`: the binary buddy allocator the paper's Orca baselines assume (Kwon et al., SOSP
  2023, §6.1): a range is rounded up to a power of two, aligned to its size, and on free merges
  only with its buddy, the other half of the block it was split from.
"""

import bisect
from dataclasses import dataclass

from kvlab.validation import check_int, check_positive_int

POLICIES: tuple[str, ...] = ("max", "pow2", "oracle")
ARENAS: tuple[str, ...] = ("first-fit", "buddy")


@dataclass(slots=True, frozen=True)
class Hole:
    """A run of free slots `[start, start + size)` in the arena."""

    start: int
    size: int

    @property
    def end(self) -> int:
        """One past the last slot of the hole."""
        return self.start + self.size


class ContiguousArena:
    """A fixed arena of `num_slots` token slots that hands out contiguous ranges first-fit."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = check_positive_int("num_slots", num_slots)
        # Two parallel lists sorted by start, so bisect finds a freed range's neighbours.
        self._hole_starts: list[int] = [0]
        self._hole_sizes: list[int] = [self.num_slots]
        self._allocations: dict[int, int] = {}

    @staticmethod
    def block_size(size: int) -> int:
        """Slots a request of `size` slots takes: exactly `size` (first fit does not round)."""
        return check_positive_int("size", size)

    @property
    def largest_range(self) -> int:
        """The largest range the arena could ever hand out: all of it."""
        return self.num_slots

    def find_hole(self, size: int) -> int | None:
        """Return the start of the lowest-addressed hole with at least `size` slots, or None."""
        size = check_positive_int("size", size)
        for start, hole_size in zip(self._hole_starts, self._hole_sizes):
            if hole_size >= size:
                return start
        return None

    def can_allocate(self, size: int) -> bool:
        """Whether some single hole has room for `size` contiguous slots."""
        return self.find_hole(size) is not None

    def allocate(self, size: int) -> int | None:
        """Reserve `size` contiguous slots first-fit: their start, or None if no hole fits."""
        size = check_positive_int("size", size)
        if size > self.num_slots:
            raise ValueError(f"cannot allocate {size} slots in an arena of {self.num_slots}")
        for i, hole_size in enumerate(self._hole_sizes):
            if hole_size < size:
                continue
            start = self._hole_starts[i]
            if hole_size == size:
                del self._hole_starts[i], self._hole_sizes[i]
            else:
                # Carve from the low end so the remainder stays one hole at the same list index.
                self._hole_starts[i] = start + size
                self._hole_sizes[i] = hole_size - size
            self._allocations[start] = size
            return start
        return None

    def free(self, start: int) -> int:
        """Free the range that starts at `start`, merging it with adjacent holes; return its size."""
        start = check_int("start", start, minimum=0)
        if start not in self._allocations:
            raise ValueError(f"no allocated range starts at slot {start} (unknown or freed)")
        size = self._allocations.pop(start)
        i = bisect.bisect_left(self._hole_starts, start)
        merges_prev = i > 0 and self._hole_starts[i - 1] + self._hole_sizes[i - 1] == start
        merges_next = i < len(self._hole_starts) and start + size == self._hole_starts[i]
        if merges_prev and merges_next:
            self._hole_sizes[i - 1] += size + self._hole_sizes[i]
            del self._hole_starts[i], self._hole_sizes[i]
        elif merges_prev:
            self._hole_sizes[i - 1] += size
        elif merges_next:
            self._hole_starts[i] = start
            self._hole_sizes[i] += size
        else:
            self._hole_starts.insert(i, start)
            self._hole_sizes.insert(i, size)
        return size

    @property
    def holes(self) -> list[Hole]:
        """The free list, sorted by address."""
        return [Hole(s, n) for s, n in zip(self._hole_starts, self._hole_sizes)]

    @property
    def hole_sizes(self) -> list[int]:
        """Sizes of the holes, in address order."""
        return list(self._hole_sizes)

    @property
    def allocations(self) -> dict[int, int]:
        """Allocated ranges as `{start: size}`, sorted by start."""
        return dict(sorted(self._allocations.items()))

    @property
    def num_free_slots(self) -> int:
        """Total free slots over all holes."""
        return sum(self._hole_sizes)

    @property
    def num_allocated_slots(self) -> int:
        """Total slots in allocated ranges."""
        return self.num_slots - self.num_free_slots

    @property
    def largest_hole(self) -> int:
        """Size of the largest hole, 0 when the arena is full."""
        return max(self._hole_sizes, default=0)

    def __repr__(self) -> str:
        return (
            f"ContiguousArena(num_slots={self.num_slots}, allocated={self.num_allocated_slots}, "
            f"holes={[(h.start, h.size) for h in self.holes]})"
        )


class BuddyArena:
    """A fixed arena of `num_slots` slots run as a binary buddy allocator.

    A request of n slots takes a block of 2**ceil(log2 n) slots whose start is a multiple of its size. An arena
    whose size is not a power of two starts as its binary decomposition, largest first (100 = 64 + 32 + 4),
    so every top block is aligned to its size and merging never crosses from one top block into the next.
    Among free blocks of the smallest order that fits, the lowest address is split.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = check_positive_int("num_slots", num_slots)
        # free[k]: starts of the free blocks of 2**k slots.
        self._free: list[set[int]] = [set() for _ in range(self.num_slots.bit_length())]
        self._allocations: dict[int, int] = {}  # start -> order
        self._top_starts: list[int] = []
        self._top_orders: list[int] = []
        start = 0
        for k in reversed(range(self.num_slots.bit_length())):
            if self.num_slots >> k & 1:
                self._free[k].add(start)
                self._top_starts.append(start)
                self._top_orders.append(k)
                start += 1 << k

    @staticmethod
    def block_size(size: int) -> int:
        """Slots a request of `size` slots takes: the smallest power of two at or above it."""
        size = check_positive_int("size", size)
        return 1 << (size - 1).bit_length()

    @property
    def largest_range(self) -> int:
        """The largest range the arena could ever hand out: its largest top block."""
        return 1 << self._top_orders[0]

    def _order_that_fits(self, size: int) -> int | None:
        """The smallest order >= size's with a free block, or None."""
        for k in range((size - 1).bit_length(), len(self._free)):
            if self._free[k]:
                return k
        return None

    def find_hole(self, size: int) -> int | None:
        """Return the start `allocate(size)` would give, or None if no free block is large enough."""
        size = check_positive_int("size", size)
        k = self._order_that_fits(size)
        return None if k is None else min(self._free[k])

    def can_allocate(self, size: int) -> bool:
        """Whether some free block has room for `size` slots rounded up to a power of two."""
        return self.find_hole(size) is not None

    def allocate(self, size: int) -> int | None:
        """Reserve a block of `block_size(size)` slots: its start, or None if no free block is large enough."""
        size = check_positive_int("size", size)
        if size > self.num_slots:
            raise ValueError(f"cannot allocate {size} slots in an arena of {self.num_slots}")
        order = (size - 1).bit_length()
        k = self._order_that_fits(size)
        if k is None:
            return None
        start = min(self._free[k])
        self._free[k].discard(start)
        while k > order:  # keep the low half, free the high half (its buddy)
            k -= 1
            self._free[k].add(start + (1 << k))
        self._allocations[start] = order
        return start

    def free(self, start: int) -> int:
        """Free the block that starts at `start`, merging it with its buddy while the buddy is free; return its
        size."""
        start = check_int("start", start, minimum=0)
        if start not in self._allocations:
            raise ValueError(f"no allocated range starts at slot {start} (unknown or freed)")
        order = self._allocations.pop(start)
        size = 1 << order
        top = self._top_orders[bisect.bisect_right(self._top_starts, start) - 1]
        while order < top:
            buddy = start ^ (1 << order)
            if buddy not in self._free[order]:
                break
            self._free[order].discard(buddy)
            start = min(start, buddy)
            order += 1
        self._free[order].add(start)
        return size

    @property
    def holes(self) -> list[Hole]:
        """The free blocks, sorted by address (two free neighbours that are not buddies stay two holes)."""
        return [Hole(s, 1 << k) for s, k in sorted((s, k) for k, starts in enumerate(self._free) for s in starts)]

    @property
    def hole_sizes(self) -> list[int]:
        """Sizes of the free blocks, in address order."""
        return [h.size for h in self.holes]

    @property
    def allocations(self) -> dict[int, int]:
        """Allocated blocks as `{start: size}`, sorted by start (sizes are powers of two)."""
        return {s: 1 << k for s, k in sorted(self._allocations.items())}

    @property
    def num_free_slots(self) -> int:
        """Total free slots over all free blocks."""
        return sum(len(starts) << k for k, starts in enumerate(self._free))

    @property
    def num_allocated_slots(self) -> int:
        """Total slots in allocated blocks (requests' sizes rounded up to powers of two)."""
        return self.num_slots - self.num_free_slots

    @property
    def largest_hole(self) -> int:
        """Size of the largest free block, 0 when the arena is full."""
        return max((1 << k for k, starts in enumerate(self._free) if starts), default=0)

    def __repr__(self) -> str:
        return (
            f"BuddyArena(num_slots={self.num_slots}, allocated={self.num_allocated_slots}, "
            f"holes={[(h.start, h.size) for h in self.holes]})"
        )


def make_arena(kind: str, num_slots: int) -> ContiguousArena | BuddyArena:
    """A `kind` arena ("first-fit" or "buddy") of `num_slots` slots."""
    if kind == "first-fit":
        return ContiguousArena(num_slots)
    if kind == "buddy":
        return BuddyArena(num_slots)
    raise ValueError(f"unknown arena {kind!r}; expected one of {ARENAS}")


def reservation_slots(policy: str, prompt_len: int, output_len: int, max_model_len: int) -> int:
    """Number of contiguous slots `policy` reserves for a request of the given lengths."""
    prompt_len = check_positive_int("prompt_len", prompt_len)
    output_len = check_positive_int("output_len", output_len)
    max_model_len = check_positive_int("max_model_len", max_model_len)
    final_len = prompt_len + output_len
    if final_len > max_model_len:
        raise ValueError(
            f"request of {prompt_len} prompt + {output_len} output tokens exceeds max_model_len={max_model_len}"
        )
    if policy == "max":
        return max_model_len
    if policy == "pow2":
        return min(1 << (final_len - 1).bit_length(), max_model_len)
    if policy == "oracle":
        return final_len
    raise ValueError(f"unknown reservation policy {policy!r}; expected one of {POLICIES}")
