"""Contiguous KV-cache allocation, the way serving systems reserved memory before paging.

A request reserves one contiguous range of token slots in a fixed arena when it is admitted and
keeps it until it finishes. How large that range is depends on the reservation policy:

* `"max"`: `max_model_len` slots, whatever the request's length (Orca (Max)).
* `"pow2"`: the next power of two at or above the request's final length `prompt_len +
  output_len`, capped at `max_model_len` (Orca (Pow2)).
* `"oracle"`: exactly the final length; an oracle that knows the output length in advance
  (Orca (Oracle)).

The arena hands out ranges first-fit from a free list of holes sorted by address and merges
neighbouring holes on free, so external fragmentation arises for real: free slots scattered over
holes that are each too small for the next request.
"""

import bisect
from dataclasses import dataclass

from kvlab.validation import check_int, check_positive_int

POLICIES: tuple[str, ...] = ("max", "pow2", "oracle")


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
