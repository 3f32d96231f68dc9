"""The OffloadingManager contract for both eviction policies: what lookup counts, what pins protect, what
a failed or impossible call leaves behind, and where LRU and ARC part ways."""

import random
from collections import Counter

import pytest

from kvlab.kv_offload import ARCOffloadingManager, Backend, LRUOffloadingManager

POLICIES = {"lru": LRUOffloadingManager, "arc": ARCOffloadingManager}


def make(policy: str, num_blocks: int, block_size: int = 4):
    return POLICIES[policy](Backend("CPU", block_size, num_blocks), enable_events=True)


def stored(manager, *hashes):
    """Store and complete these hashes; the store must have found room."""
    out = manager.prepare_store(list(hashes))
    assert out is not None, f"no room to store {hashes} in {manager.backend.num_blocks} blocks"
    manager.complete_store(list(hashes))
    return out


def snapshot(manager):
    """Everything a call could change: the held blocks in eviction order, the free ids, ARC's ghosts and p."""
    held = tuple((h, b.block_id, b.ref_cnt, b.is_ready) for h, b in manager.held_blocks())
    state = [held, sorted(manager.backend._free_ids), len(manager.events)]
    if isinstance(manager, ARCOffloadingManager):
        state += [list(manager.b1), list(manager.b2), manager.target_t1_size]
    return state


def access(manager, block_hash) -> bool:
    """One use of one block, as the engine would make it: a hit loads and touches it, a miss stores it."""
    if manager.lookup([block_hash]) == 1:
        manager.prepare_load([block_hash])
        manager.complete_load([block_hash])
        manager.touch([block_hash])
        return True
    if manager.prepare_store([block_hash]) is not None:
        manager.complete_store([block_hash])
    return False


@pytest.mark.parametrize("policy", POLICIES)
def test_lookup_counts_only_the_ready_prefix(policy):
    """lookup stops at the first block that is absent or still being stored: later blocks are useless without it."""
    m = make(policy, 8)
    stored(m, "a", "b")
    m.prepare_store(["c"])
    assert m.lookup(["a", "b", "c"]) == 2, "c is being stored: not loadable yet"
    m.complete_store(["c"])
    assert m.lookup(["a", "b", "c", "d"]) == 3
    assert m.lookup(["x", "a", "b"]) == 0, "a miss on the first block means nothing after it counts"
    assert m.lookup([]) == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_skips_held_hashes_and_reports_where(policy):
    """Hashes already stored or being stored are not stored twice; the spec names the new blocks' ids."""
    m = make(policy, 8)
    stored(m, "a")
    m.prepare_store(["b"])
    out = m.prepare_store(["a", "b", "c", "c", "d"])
    assert out.block_hashes_to_store == ["c", "d"], "a is stored, b is being stored, c is asked for twice"
    assert out.store_spec.medium == "CPU" and len(out.store_spec.block_ids) == 2
    assert out.store_spec.block_hashes == ("c", "d")
    assert out.block_hashes_evicted == []
    ids = [b.block_id for _, b in m.held_blocks()]
    assert len(set(ids)) == len(ids) == 4, f"every held block has its own id, got {ids}"


@pytest.mark.parametrize("policy", POLICIES)
def test_a_full_tier_evicts_instead_of_failing(policy):
    """Storing into a full tier evicts a ready, unpinned copy and reports it, with a removal event."""
    m = make(policy, 2)
    stored(m, "a", "b")
    m.take_events()
    out = stored(m, "c")
    assert len(out.block_hashes_evicted) == 1 and out.block_hashes_evicted[0] in {"a", "b"}
    events = list(m.take_events())
    assert [(e.removed, e.block_hashes) for e in events] == [(True, out.block_hashes_evicted), (False, ["c"])]
    assert m.backend.get_num_free_blocks() == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_pinned_and_unready_blocks_are_never_evicted(policy):
    """A block being loaded (pinned) or being stored cannot make room; with nothing else, prepare_store is None."""
    m = make(policy, 2)
    stored(m, "a")
    m.prepare_load(["a"])
    m.prepare_store(["b"])
    before = snapshot(m)
    assert m.prepare_store(["c"]) is None, "a is pinned by a load and b is still being stored: no room"
    assert snapshot(m) == before, "a refused prepare_store must change nothing"
    m.complete_load(["a"])
    out = m.prepare_store(["c"])
    assert out.block_hashes_evicted == ["a"], "once its load completed, a is the only evictable block"


@pytest.mark.parametrize("policy", POLICIES)
def test_the_callers_own_hashes_are_not_evicted_to_make_room(policy):
    """prepare_store(['a', 'c']) with a held and the tier full must not evict a to store c."""
    m = make(policy, 1)
    stored(m, "a")
    assert m.prepare_store(["a", "c"]) is None
    assert m.lookup(["a"]) == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_failed_store_leaves_no_trace(policy):
    """complete_store(success=False) frees the ids and forgets the hashes; no event ever mentions them."""
    m = make(policy, 4)
    stored(m, "a")
    free_before = m.backend.get_num_free_blocks()
    m.prepare_store(["a", "b", "c"])
    m.complete_store(["a", "b", "c"], success=False)
    assert m.backend.get_num_free_blocks() == free_before
    assert m.lookup(["a"]) == 1, "a was stored before: a failed store of b and c must not touch it"
    assert m.lookup(["b"]) == 0 and m.lookup(["c"]) == 0
    mentioned = {h for e in m.take_events() for h in e.block_hashes}
    assert mentioned == {"a"}
    with pytest.raises(ValueError, match="never prepared"):
        m.complete_store(["b"])


@pytest.mark.parametrize("policy", POLICIES)
def test_bad_calls_raise_and_change_nothing(policy):
    """Each misuse names the block and what to do, and leaves the manager exactly as it was."""
    m = make(policy, 3)
    stored(m, "a")
    m.prepare_store(["b"])
    bad_calls = [
        (lambda: m.prepare_load(["a", "zz"]), "'zz' is not offloaded"),
        (lambda: m.prepare_load(["b"]), "still being stored"),
        (lambda: m.complete_load(["a"]), "0 load"),
        (lambda: m.complete_store(["zz"]), "never prepared"),
    ]
    for call, message in bad_calls:
        before = snapshot(m)
        with pytest.raises(ValueError, match=message):
            call()
        assert snapshot(m) == before, f"the refused call ({message}) changed the manager"
    m.prepare_load(["a"])
    with pytest.raises(ValueError, match="1 load.*2 completion"):
        m.complete_load(["a", "a"])
    m.complete_load(["a"])


@pytest.mark.parametrize("num_blocks,block_size", [(0, 4), (4, 0), (-1, 4)])
def test_non_positive_sizes_are_refused(num_blocks, block_size):
    with pytest.raises(ValueError, match="num_blocks|block_size"):
        Backend("CPU", block_size, num_blocks)


def test_backend_refuses_a_double_free_and_an_overdraft():
    backend = Backend("CPU", 4, 2)
    blocks = backend.allocate_blocks(["a", "b"])
    assert [b.block_id for b in blocks] == [0, 1]
    with pytest.raises(ValueError, match="only 0 of 2 ids are free"):
        backend.allocate_blocks(["c"])
    backend.free(blocks[0])
    with pytest.raises(ValueError, match="freed twice"):
        backend.free(blocks[0])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_every_invariant(policy, seed):
    """Thousands of random calls, checked after each against a model built only from what the calls returned."""
    rng = random.Random(seed)
    capacity = rng.choice([1, 3, 5])
    m = make(policy, capacity)
    universe = list(range(12))
    ready_by_events: set = set()  # what the events say is ready: stores add, removals subtract
    pins: Counter = Counter()  # loads in flight, from prepare_load
    pending: list[list] = []  # stores in flight, from prepare_store

    def check():
        held = dict(m.held_blocks())
        assert len(held) <= capacity and len(held) + m.backend.get_num_free_blocks() == capacity, \
            "held blocks and free ids must add up to the tier's size"
        ids = [b.block_id for b in held.values()]
        assert len(set(ids)) == len(ids) and all(0 <= i < capacity for i in ids), f"ids clash or overflow: {ids}"
        for event in m.take_events():
            assert event.medium == "CPU" and event.block_size == 4
            if event.removed:
                assert set(event.block_hashes) <= ready_by_events, "an eviction of a block never announced"
                ready_by_events.difference_update(event.block_hashes)
            else:
                assert not set(event.block_hashes) & ready_by_events, "a block announced twice"
                ready_by_events.update(event.block_hashes)
        assert {h for h, b in held.items() if b.is_ready} == ready_by_events, "events disagree with the blocks"
        for h, n in pins.items():
            assert h in held and held[h].is_ready and held[h].ref_cnt == n, f"pinned block {h} lost or miscounted"
        for batch in pending:
            for h in batch:
                assert h in held and not held[h].is_ready, f"block {h} being stored vanished or became ready early"
        if isinstance(m, ARCOffloadingManager):
            assert len(m.t1) + len(m.b1) <= capacity, "ARC keeps |T1| + |B1| <= c"
            assert len(m.t1) + len(m.t2) + len(m.b1) + len(m.b2) <= 2 * capacity, "ARC remembers at most 2c hashes"
            assert not (set(m.b1) | set(m.b2)) & set(held), "a ghost is a hash no longer held"
            assert 0 <= m.target_t1_size <= capacity, "p stays between 0 and c"
        probe = rng.sample(universe, rng.randint(1, 6))
        expected = next((i for i, h in enumerate(probe) if h not in ready_by_events), len(probe))
        assert m.lookup(probe) == expected, f"lookup({probe}) must count the ready prefix"

    for _ in range(400):
        op = rng.random()
        if op < 0.35:
            batch = rng.sample(universe, rng.randint(1, 4))
            before = snapshot(m)
            out = m.prepare_store(batch)
            if out is None:
                assert snapshot(m) == before, "prepare_store returned None but changed the manager"
            else:
                evicted = set(out.block_hashes_evicted)
                assert not evicted & set(pins), "a pinned block was evicted"
                assert not evicted & {h for b in pending for h in b}, "a block being stored was evicted"
                assert not evicted & set(batch), "a block the caller is storing was evicted"
                pending.append(out.block_hashes_to_store)
        elif op < 0.55 and pending:
            batch = pending.pop(rng.randrange(len(pending)))
            success = rng.random() < 0.8
            m.complete_store(batch, success=success)
            if not success:
                held = dict(m.held_blocks())
                assert not set(batch) & set(held), "a failed store left blocks behind"
        elif op < 0.7:
            probe = rng.sample(universe, rng.randint(1, 4))
            hit = m.lookup(probe)
            if hit:
                m.prepare_load(probe[:hit])
                pins.update(probe[:hit])
        elif op < 0.85 and pins:
            h = rng.choice(sorted(pins))
            m.complete_load([h])
            pins[h] -= 1
            if not pins[h]:
                del pins[h]
        elif op < 0.95:
            m.touch(rng.sample(universe, rng.randint(1, 4)))
        else:
            absent = [h for h in universe if h not in dict(m.held_blocks())]
            if absent:
                before = snapshot(m)
                with pytest.raises(ValueError):
                    m.prepare_load([absent[0]])
                assert snapshot(m) == before
        check()


def test_lru_evicts_the_least_recently_used_and_touch_refreshes():
    """Stored a, b, c; touching a makes b the oldest; a touch of [x, y] leaves x the most recent."""
    m = make("lru", 3)
    stored(m, "a")
    stored(m, "b")
    stored(m, "c")
    m.touch(["a"])
    assert stored(m, "d").block_hashes_evicted == ["b"]
    m.touch(["c", "d"])  # c is the prefix's first block: it should outlive d
    assert [h for h, _ in m.held_blocks()] == ["a", "d", "c"], "eviction order: a, then d, then c"
    assert stored(m, "e").block_hashes_evicted == ["a"]


def test_arc_promotes_on_second_use_and_remembers_evictions():
    """A touched copy moves T1 -> T2; an evicted one leaves its hash in a ghost list; storing it again adapts p."""
    m = make("arc", 2)
    stored(m, "a")
    stored(m, "b")
    m.touch(["a"])
    assert list(m.t1) == ["b"] and list(m.t2) == ["a"]
    assert stored(m, "c").block_hashes_evicted == ["b"], "|T1| = 1 > p = 0: T1's oldest goes"
    assert list(m.b1) == ["b"]
    out = stored(m, "b")
    assert m.target_t1_size == 1.0, "a B1 ghost hit means T1 was too small: p grows by max(|B2|/|B1|, 1) = 1"
    assert "b" in m.t2 and "b" not in m.b1, "a ghost stored again has been wanted twice: it goes to T2"
    assert out.block_hashes_evicted == ["a"], "|T1| = 1 is no longer above p = 1: T2's oldest goes this time"
    assert list(m.b2) == ["a"]


def scan_trace(hot: list, scan_length: int) -> list:
    """The hot blocks used twice, a scan of blocks used once, then the hot blocks again."""
    return hot + hot + [f"scan{i}" for i in range(scan_length)] + hot


def test_arc_resists_a_scan_that_flushes_lru():
    """A system prompt's blocks used twice survive a burst of one-off prompts in ARC (T2), not in LRU."""
    hot = ["sys0", "sys1", "sys2"]
    trace = scan_trace(hot, scan_length=10)
    last = len(hot)
    hits = {}
    for policy in POLICIES:
        m = make(policy, 4)
        results = [access(m, h) for h in trace]
        hits[policy] = results[-last:]
    assert hits["lru"] == [False] * last, "LRU: ten one-off blocks pushed the three hot ones out of four slots"
    assert hits["arc"] == [True] * last, "ARC: the hot blocks sit in T2 and the scan only evicts within T1"


@pytest.mark.parametrize("capacity,loop", [(4, 5), (8, 10), (3, 7)])
def test_a_pure_loop_defeats_both_policies(capacity, loop):
    """Cycling over more blocks than fit, each used once per pass: ARC is no worse than LRU, and both get 0 hits.

    LRU always evicts the block needed next. ARC cannot do better here: no block is used twice while resident,
    so nothing reaches T2, T1 fills the whole tier and (|T1| + |B1| <= c) leaves B1 no room to remember.
    """
    trace = [f"b{i % loop}" for i in range(loop * 12)]
    rate = {}
    for policy in POLICIES:
        m = make(policy, capacity)
        rate[policy] = sum(access(m, h) for h in trace) / len(trace)
    assert rate["arc"] >= rate["lru"], f"hit rates {rate}"
    assert rate == {"lru": 0.0, "arc": 0.0}, f"a loop with no reuse while resident gives no policy a hit: {rate}"


@pytest.mark.parametrize("seed", range(3))
def test_arc_beats_lru_when_hot_blocks_loop_among_scans(seed):
    """Four hot blocks, reused every round in a shuffled order, between scans of 2-8 one-off blocks (6 slots).

    LRU lets each scan push the hot blocks out; ARC keeps them in T2 once a round used them twice.
    """
    rng = random.Random(seed)
    hot = [f"hot{i}" for i in range(4)]
    trace = []
    for burst in range(30):
        trace += rng.sample(hot, len(hot))
        trace += [f"scan{burst}_{i}" for i in range(rng.randint(2, 8))]
    rate = {}
    for policy in POLICIES:
        m = make(policy, 6)
        rate[policy] = sum(access(m, h) for h in trace) / len(trace)
    assert rate["arc"] > rate["lru"], f"hit rates {rate}"


def test_events_are_off_unless_asked_for():
    m = LRUOffloadingManager(Backend("CPU", 4, 2))
    stored(m, "a")
    assert list(m.take_events()) == []


@pytest.mark.parametrize("policy", POLICIES)
def test_remove_forgets_a_ready_unpinned_copy_and_refuses_others(policy):
    manager = make(policy, 3)
    stored(manager, "a", "b")
    manager.prepare_load(["b"])
    manager.prepare_store(["c"])  # not completed: still being stored
    before = snapshot(manager)
    for block_hash in ("b", "c", "x"):
        with pytest.raises(ValueError, match=f"'{block_hash}'"):
            manager.remove([block_hash])
        assert snapshot(manager) == before, "a refused remove changes nothing"
    manager.remove(["a"])
    assert manager.lookup(["a"]) == 0 and manager.backend.get_num_free_blocks() == 1, "a's id went back"
    assert [e.removed for e in manager.take_events()][-1] is True, "the removal is reported as an eviction"
