"""Orca's reservations in one contiguous range: KVCacheManager(reservation_arena=...) and the scheduler's admission.

The paper's Orca baselines keep a request's whole reservation in one range of memory placed by a buddy allocator
(Kwon et al., SOSP 2023, §6.1). With an arena, a request is admitted only when a range fits, even if the pool has
enough free blocks: that gap is external fragmentation.
"""

import pytest

from kvlab.analysis.contiguous import make_arena
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.engine.request import Request
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.scheduler import Scheduler


def manager(num_blocks: int, arena: str | None) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size=4, enable_prefix_caching=False,
                          reservation_arena=None if arena is None else make_arena(arena, num_blocks))


def test_a_range_that_does_not_fit_is_refused_though_blocks_are_free():
    for arena, fits in (("buddy", False), ("first-fit", True)):
        kv = manager(16, arena)
        for rid in "abcd":
            assert kv.reserve_range(rid, 16), f"{arena}, {rid}: 16 tokens = 4 blocks, a quarter of the arena"
            kv.allocate_slots(rid, 16)
        kv.free("b")
        kv.free("c")
        assert kv.num_free_blocks == 8 and kv.arena.hole_sizes == ([4, 4] if arena == "buddy" else [8])
        assert kv.reserve_range("e", 32) is fits, \
            f"{arena}: blocks 4-11 are free; first fit merges them, a buddy allocator cannot (4 and 8 are no buddies)"
        assert ("e" in kv._ranges) is fits, "a refused range leaves nothing behind"


def test_free_releases_the_range_and_a_held_range_is_not_placed_twice():
    kv = manager(8, "buddy")
    assert kv.reserve_range("a", 20), "20 tokens = 5 blocks, rounded to a range of 8"
    assert kv.reserve_range("a", 20), "the request holds its range already"
    assert not kv.reserve_range("b", 1), "the whole arena is a's"
    kv.allocate_slots("a", 20)
    assert kv.num_free_blocks == 3, "the pool still hands out only the blocks a request fills"
    kv.free("a")
    assert kv.reserve_range("b", 32)


def test_without_an_arena_every_reservation_fits_and_bad_input_is_refused():
    kv = manager(4, None)
    assert kv.arena is None and kv.reserve_range("a", 10**6)
    with pytest.raises(ValueError, match="unknown arena 'slab'"):
        manager(4, "slab")
    with pytest.raises(ValueError, match=r"reservation_arena must be None .* with one slot per block \(4\)"):
        KVCacheManager(4, block_size=4, reservation_arena=make_arena("buddy", 8))
    kv = manager(12, "buddy")  # top ranges of 8 and 4 blocks
    with pytest.raises(ValueError, match="can never fit the BuddyArena, whose largest range is 8 blocks"):
        kv.reserve_range("a", 33)
    with pytest.raises(ValueError):
        kv.reserve_range("a", 0)
    assert kv.arena.hole_sizes == [8, 4], "nothing placed"


def request(rid: str, prompt_len: int, reserved_len: int) -> Request:
    r = Request(rid, [1] * prompt_len, SamplingParams(max_tokens=reserved_len - prompt_len, ignore_eos=True),
                0, (), None, 256)
    r.reserved_len = reserved_len
    return r


def test_the_scheduler_admits_a_reservation_only_where_a_range_fits():
    # 16 blocks of 4. a reserves 5 blocks -> a range of 8; b 3 blocks -> 4; c 3 blocks -> 4, the arena's last.
    kv = manager(16, "buddy")
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    for rid, prompt, reserved in (("a", 8, 20), ("b", 4, 12), ("c", 4, 12), ("d", 4, 8)):
        scheduler.add_request(request(rid, prompt, reserved))
    out = scheduler.schedule()
    assert out.admitted == ["a", "b", "c"], "d's 2 blocks would round to a range of 2: none is left"
    assert kv.num_free_blocks == 16 - 5 - 3 - 3, "5 blocks are free in the pool, yet d waits"
    paged = manager(16, None)
    scheduler = Scheduler(paged, max_num_seqs=8, max_num_batched_tokens=64)
    for rid, prompt, reserved in (("a", 8, 20), ("b", 4, 12), ("c", 4, 12), ("d", 4, 8)):
        scheduler.add_request(request(rid, prompt, reserved))
    assert scheduler.schedule().admitted == ["a", "b", "c", "d"], "reserved in the pool's blocks, d fits"
