"""Tests for the first-fit contiguous arena and the Orca-style reservation policies."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.analysis.contiguous import POLICIES, BuddyArena, ContiguousArena, Hole, make_arena, reservation_slots


def snapshot(arena: ContiguousArena):
    return arena.holes, arena.allocations


def test_fresh_arena_is_one_hole():
    arena = ContiguousArena(100)
    assert arena.holes == [Hole(0, 100)]
    assert arena.num_free_slots == 100 and arena.num_allocated_slots == 0
    assert arena.largest_hole == 100


def test_allocations_are_packed_from_the_low_end():
    arena = ContiguousArena(100)
    assert [arena.allocate(n) for n in (10, 20, 30)] == [0, 10, 30]
    assert arena.holes == [Hole(60, 40)]
    assert arena.allocations == {0: 10, 10: 20, 30: 30}


def test_first_fit_takes_the_lowest_hole_that_fits_not_the_tightest():
    arena = ContiguousArena(100)
    a, b, c, d = (arena.allocate(n) for n in (40, 10, 20, 30))
    arena.free(a)  # hole of 40 at 0
    arena.free(c)  # hole of 20 at 50
    assert arena.holes == [Hole(0, 40), Hole(50, 20)]
    # Best fit would pick the 20-slot hole; first fit picks the lower one.
    assert arena.allocate(15) == 0
    assert arena.holes == [Hole(15, 25), Hole(50, 20)]
    # A request larger than the first hole skips it.
    assert arena.find_hole(22) == 15
    assert arena.allocate(25) == 15
    assert arena.allocate(20) == 50
    assert arena.holes == []
    assert arena.allocate(1) is None


def test_free_coalesces_with_both_neighbours():
    arena = ContiguousArena(100)
    a, b, c, d = (arena.allocate(n) for n in (10, 20, 30, 40))
    arena.free(a)
    arena.free(c)
    assert arena.holes == [Hole(0, 10), Hole(30, 30)]
    assert arena.free(b) == 20  # merges the hole before and the hole after
    assert arena.holes == [Hole(0, 60)]
    arena.free(d)
    assert arena.holes == [Hole(0, 100)]


def test_free_coalesces_with_one_neighbour():
    arena = ContiguousArena(100)
    a, b, c = (arena.allocate(n) for n in (10, 20, 30))  # hole [60, 100) remains
    arena.free(c)  # merges with the hole after it
    assert arena.holes == [Hole(30, 70)]
    arena.free(a)  # no free neighbour: a separate hole
    assert arena.holes == [Hole(0, 10), Hole(30, 70)]
    arena.free(b)
    assert arena.holes == [Hole(0, 100)]


def test_external_fragmentation_holes_of_30_and_30_cannot_hold_50():
    arena = ContiguousArena(100)
    a, b, c, d = (arena.allocate(n) for n in (30, 20, 30, 20))
    arena.free(a)
    arena.free(c)
    assert arena.num_free_slots == 60
    assert arena.hole_sizes == [30, 30]
    before = snapshot(arena)
    assert not arena.can_allocate(50)
    assert arena.allocate(50) is None
    assert snapshot(arena) == before
    arena.free(b)  # now the holes merge into one of 80
    assert arena.allocate(50) == 0


@pytest.mark.parametrize("size", [0, -1, 101])
def test_bad_allocation_size_raises_and_changes_nothing(size):
    arena = ContiguousArena(100)
    arena.allocate(30)
    before = snapshot(arena)
    with pytest.raises(ValueError):
        arena.allocate(size)
    assert snapshot(arena) == before


def test_non_integer_sizes_are_rejected():
    arena = ContiguousArena(100)
    with pytest.raises(TypeError):
        arena.allocate(2.5)
    with pytest.raises(TypeError):
        arena.allocate(True)
    with pytest.raises(TypeError):
        ContiguousArena(10.0)


@pytest.mark.parametrize("num_slots", [0, -5])
def test_arena_needs_a_positive_size(num_slots):
    with pytest.raises(ValueError):
        ContiguousArena(num_slots)


def test_freeing_an_unknown_or_freed_range_raises_and_changes_nothing():
    arena = ContiguousArena(100)
    a = arena.allocate(30)
    b = arena.allocate(30)
    arena.free(a)
    before = snapshot(arena)
    for bad in (a, b + 1, 99, -1, 1000):  # already freed, inside a range, in a hole, outside
        with pytest.raises(ValueError):
            arena.free(bad)
        assert snapshot(arena) == before


def test_repr_shows_allocation_and_holes():
    arena = ContiguousArena(10)
    arena.allocate(4)
    assert "allocated=4" in repr(arena) and "(4, 6)" in repr(arena)


# --- reservation policies -------------------------------------------------------------------


def test_policy_names():
    assert POLICIES == ("max", "pow2", "oracle")


@pytest.mark.parametrize(
    "policy, prompt_len, output_len, max_model_len, expected",
    [
        ("max", 100, 50, 2048, 2048),
        ("max", 1, 1, 2048, 2048),
        ("oracle", 100, 50, 2048, 150),
        ("oracle", 2000, 48, 2048, 2048),
        ("pow2", 100, 28, 2048, 128),  # exactly a power of two
        ("pow2", 100, 29, 2048, 256),  # one past it
        ("pow2", 1, 1, 2048, 2),
        ("pow2", 1000, 1000, 2048, 2048),
        ("pow2", 1000, 200, 1500, 1500),  # capped at a max_model_len that is not a power of two
    ],
)
def test_reservation_sizes(policy, prompt_len, output_len, max_model_len, expected):
    assert reservation_slots(policy, prompt_len, output_len, max_model_len) == expected


@pytest.mark.parametrize("policy", POLICIES)
def test_reservation_covers_the_final_length(policy):
    for final_len in range(2, 300, 7):
        slots = reservation_slots(policy, final_len - 1, 1, 256 if final_len <= 256 else 300)
        assert slots >= final_len


@pytest.mark.parametrize(
    "args",
    [
        ("max", 0, 10, 2048),
        ("pow2", 10, 0, 2048),
        ("oracle", -1, 10, 2048),
        ("oracle", 10, 10, 0),
        ("oracle", 2000, 49, 2048),  # longer than max_model_len
        ("best", 10, 10, 2048),  # unknown policy
    ],
)
def test_bad_reservation_inputs_raise(args):
    with pytest.raises(ValueError):
        reservation_slots(*args)


# --- property test --------------------------------------------------------------------------

NUM_SLOTS = 64
ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, NUM_SLOTS)),
        st.tuples(st.just("free"), st.integers(0, 10_000)),
    ),
    max_size=60,
)


def check_invariants(arena: ContiguousArena) -> None:
    holes = arena.holes
    allocs = arena.allocations
    covered = [0] * NUM_SLOTS
    for start, size in [(h.start, h.size) for h in holes] + list(allocs.items()):
        assert size > 0 and 0 <= start and start + size <= NUM_SLOTS
        for slot in range(start, start + size):
            covered[slot] += 1
    assert covered == [1] * NUM_SLOTS  # no overlap, nothing lost: free + allocated = arena
    assert arena.num_free_slots + sum(allocs.values()) == NUM_SLOTS
    for left, right in zip(holes, holes[1:]):
        assert left.end < right.start  # sorted, and touching holes were merged


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_alloc_free_sequences_keep_the_arena_consistent(operations):
    arena = ContiguousArena(NUM_SLOTS)
    for op, value in operations:
        if op == "alloc":
            first_fit = next((h.start for h in arena.holes if h.size >= value), None)
            assert arena.allocate(value) == first_fit
        elif arena.allocations:
            starts = list(arena.allocations)
            arena.free(starts[value % len(starts)])
        check_invariants(arena)
    for start in list(arena.allocations):
        arena.free(start)
    assert arena.holes == [Hole(0, NUM_SLOTS)]


# --- the buddy allocator the paper's Orca baselines assume ------------------------------------------------------


def test_a_buddy_arena_starts_as_its_binary_decomposition():
    arena = BuddyArena(100)  # 64 + 32 + 4: every top block aligned to its size
    assert arena.holes == [Hole(0, 64), Hole(64, 32), Hole(96, 4)]
    assert arena.largest_range == 64, "no range can span two top blocks"
    assert BuddyArena(64).holes == [Hole(0, 64)]


def test_a_buddy_range_is_rounded_up_to_a_power_of_two_and_aligned_to_it():
    arena = BuddyArena(64)
    assert arena.allocate(5) == 0, "5 slots take a block of 8 at the lowest address"
    assert arena.allocations == {0: 8}
    assert arena.allocate(9) == 16, "9 slots take 16, aligned to 16: [8, 16) stays free"
    assert arena.holes == [Hole(8, 8), Hole(32, 32)]
    assert arena.num_allocated_slots == 24, "5 + 9 slots asked, 8 + 16 held: the rest is rounding"
    assert BuddyArena.block_size(5) == 8 and BuddyArena.block_size(8) == 8 and ContiguousArena.block_size(5) == 5


def test_the_smallest_free_block_that_fits_is_split_not_the_lowest_address():
    arena = BuddyArena(100)  # 64 at 0, 32 at 64, 4 at 96
    assert arena.allocate(3) == 96, "a 4-block exists: nothing is split"
    assert arena.allocate(20) == 64, "the 32-block fits a 20-slot range; the 64-block stays whole"
    assert arena.allocate(40) == 0


def test_a_freed_block_merges_with_its_buddy_only():
    arena = BuddyArena(64)
    a, b, c, d = (arena.allocate(16) for _ in range(4))
    assert (a, b, c, d) == (0, 16, 32, 48)
    assert arena.free(b) == 16 and arena.free(c) == 16
    # [16, 48) is 32 free, contiguous slots, but 16 and 32 are not buddies (16's buddy is 0, 32's is 48).
    assert arena.holes == [Hole(16, 16), Hole(32, 16)]
    assert not arena.can_allocate(17), "first fit would place 32 slots there; a buddy allocator cannot"
    first_fit = ContiguousArena(64)
    starts = [first_fit.allocate(16) for _ in range(4)]
    first_fit.free(starts[1])
    first_fit.free(starts[2])
    assert first_fit.can_allocate(32)
    arena.free(a)  # 0 + 16 -> 32 at 0, which waits for its buddy at 32 (half of it is still held)
    assert arena.holes == [Hole(0, 32), Hole(32, 16)]
    arena.free(d)
    assert arena.holes == [Hole(0, 64)]


def test_merging_stops_at_a_top_block():
    arena = BuddyArena(96)  # 64 at 0 and 32 at 64: 64 and 64 + 32 are not buddies of one block
    a, b = arena.allocate(64), arena.allocate(32)
    arena.free(a)
    arena.free(b)
    assert arena.holes == [Hole(0, 64), Hole(64, 32)]


def test_bad_buddy_input_raises_and_changes_nothing():
    arena = BuddyArena(100)
    arena.allocate(10)
    before = snapshot(arena)
    with pytest.raises(ValueError, match="cannot allocate 101 slots in an arena of 100"):
        arena.allocate(101)
    with pytest.raises(ValueError, match="no allocated range starts at slot 3"):
        arena.free(3)
    for bad in (0, -4, 2.5, "8"):
        with pytest.raises(ValueError):
            arena.allocate(bad)
    assert snapshot(arena) == before
    assert arena.allocate(70) is None, "70 slots round to 128: no block that large"
    with pytest.raises(ValueError, match="unknown arena 'best-fit'"):
        make_arena("best-fit", 10)
    assert isinstance(make_arena("buddy", 10), BuddyArena) and isinstance(make_arena("first-fit", 10), ContiguousArena)


def check_buddy_invariants(arena: BuddyArena) -> None:
    covered = [0] * arena.num_slots
    for start, size in [*arena.allocations.items(), *((h.start, h.size) for h in arena.holes)]:
        assert size & (size - 1) == 0 and start % size == 0, f"block [{start}, {start + size}) is not aligned"
        for i in range(start, start + size):
            covered[i] += 1
    assert covered == [1] * arena.num_slots, "free and allocated blocks tile the arena exactly"


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_buddy_sequences_keep_the_arena_consistent(operations):
    arena = BuddyArena(NUM_SLOTS + 36)  # 64 + 32 + 4: top blocks of three sizes
    initial = arena.holes
    for op, value in operations:
        if op == "alloc":
            fits = [h for h in arena.holes if h.size >= value]
            smallest = min((h.size for h in fits), default=None)
            expected = min((h.start for h in fits if h.size == smallest), default=None)
            assert arena.allocate(value) == expected
        elif arena.allocations:
            starts = list(arena.allocations)
            arena.free(starts[value % len(starts)])
        check_buddy_invariants(arena)
    for start in list(arena.allocations):
        arena.free(start)
    assert arena.holes == initial, "freeing everything merges back to the arena's top blocks"
