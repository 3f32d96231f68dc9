"""Chapter 5: fork shares blocks, copy-on-write copies only a shared, partly filled last block."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.core.fork import CowBlockManager


def state(m):
    return ({s: (list(table), m.num_tokens[s]) for s, table in m.block_tables.items()},
            [b.ref_cnt for b in m.block_pool.blocks], m.block_pool.free_block_queue.block_ids(), set(m.freed),
            list(m.copy_orders))


def append(m, seq):
    """One more token of a running sequence through the common API: (its slot, the copy order it made or None)."""
    (slot,) = m.allocate_slots(seq, 1)
    copies = m.take_copy_orders()
    assert len(copies) <= 1, f"one token copies at most its one shared last block, got {copies}"
    return slot, (copies[0] if copies else None)


def test_fork_shares_all_blocks_and_counts():
    m = CowBlockManager(10, block_size=4)
    m.allocate_slots("a", 10)  # 3 blocks, last one 2/4 full
    m.fork("a", "b")
    assert m.block_tables["b"] == m.block_tables["a"] and m.num_tokens["b"] == 10
    assert all(m.block_pool.blocks[b].ref_cnt == 2 for b in m.block_tables["a"])
    assert m.num_used_blocks == 3


def test_cow_copies_only_the_partly_filled_shared_block():
    m = CowBlockManager(10, block_size=4)
    m.allocate_slots("a", 10)
    m.fork("a", "b")
    shared_last = m.block_tables["a"][-1]
    slot, copy = append(m, "b")
    new_last = m.block_tables["b"][-1]
    assert copy == (shared_last, new_last) and new_last != shared_last
    assert slot == new_last * 4 + 2
    assert m.block_tables["b"][:2] == m.block_tables["a"][:2]  # full blocks stay shared
    assert [m.block_pool.blocks[b].ref_cnt for b in m.block_tables["a"]] == [2, 2, 1]
    # a is now the only owner of its last block: it writes in place
    slot, copy = append(m, "a")
    assert copy is None and slot == shared_last * 4 + 2


def test_full_shared_last_block_stays_shared_and_new_block_only_when_full():
    m = CowBlockManager(10, block_size=4)
    m.allocate_slots("a", 8)
    m.fork("a", "b")
    slot, copy = append(m, "b")
    assert copy is None and m.block_tables["b"][:2] == m.block_tables["a"]
    assert len(m.block_tables["b"]) == 3 and slot == m.block_tables["b"][2] * 4
    used = m.num_used_blocks
    for _ in range(3):  # the new block fills up without taking another
        assert append(m, "b")[1] is None
    assert m.num_used_blocks == used
    append(m, "b")
    assert m.num_used_blocks == used + 1


def test_copy_orders_wait_until_taken_and_a_multi_token_append_copies_once():
    m = CowBlockManager(10, block_size=4)
    m.allocate_slots("a", 6)  # blocks 0 (full) and 1 (2 of 4)
    m.fork("a", "b")
    m.fork("a", "c")
    assert m.num_blocks_to_allocate("b", 3) == 2, "a copy of the shared block 1, then a new block for the 8th token"
    slots_b = m.allocate_slots("b", 3)
    slots_c = m.allocate_slots("c", 1)
    assert m.copy_orders == [(1, 2), (1, 4)], "every copy-on-write order waits in the manager, oldest first"
    assert slots_b == [2 * 4 + 2, 2 * 4 + 3, 3 * 4] and slots_c == [4 * 4 + 2]
    assert m.take_copy_orders() == [(1, 2), (1, 4)] and m.take_copy_orders() == [], "taking the orders clears them"
    assert m.num_blocks_to_allocate("a", 1) == 0, "a holds block 1 alone again: it writes in place"


def test_freeing_the_copy_drops_its_pending_order():
    m = CowBlockManager(4, block_size=4)
    m.allocate_slots("a", 2)
    m.fork("a", "b")
    m.allocate_slots("b", 1)
    assert m.copy_orders == [(0, 1)]
    m.free("b")
    assert m.copy_orders == [], "block 1 went back to the pool: nobody reads a copy into it"


def test_free_returns_only_unreferenced_blocks():
    m = CowBlockManager(10, block_size=4)
    m.allocate_slots("a", 10)
    m.fork("a", "b")
    append(m, "b")  # b owns a private copy of the last block
    assert m.num_used_blocks == 4
    m.free("a")
    assert m.num_used_blocks == 3  # a's private last block is free, the shared ones stay
    assert all(m.block_pool.blocks[b].ref_cnt == 1 for b in m.block_tables["b"])
    m.free("b")
    assert m.num_free_blocks == 10


def test_errors_leave_state_unchanged():
    m = CowBlockManager(3, block_size=4)
    m.allocate_slots("a", 6)
    m.fork("a", "b")
    m.allocate_slots("c", 1)  # pool now full
    m.free("c")
    m.allocate_slots("c", 4)
    before = state(m)
    for bad, error in ((lambda: m.fork("zz", "d"), KeyError), (lambda: m.free("zz"), KeyError),
                       (lambda: m.fork("a", "b"), ValueError), (lambda: m.fork("c", "a"), ValueError),
                       (lambda: m.allocate_slots("a", 0), ValueError),
                       (lambda: m.allocate_slots("d", 1, computed_blocks=[m.block_pool.blocks[0]]), ValueError),
                       (lambda: m.allocate_slots("a", 2, new_token_ids=[7]), ValueError)):
        with pytest.raises(error):
            bad()
        assert state(m) == before
    with pytest.raises(KeyError, match="'zz' holds no blocks .*unknown"):
        m.free("zz")
    with pytest.raises(MemoryError):
        m.allocate_slots("b", 1)  # needs a copy of the shared block: none free
    assert state(m) == before
    with pytest.raises(MemoryError):
        m.allocate_slots("c", 1)  # full last block: needs a new one
    assert state(m) == before
    with pytest.raises(MemoryError):
        m.allocate_slots("d", 1)
    assert state(m) == before
    m.free("c")
    before = state(m)
    with pytest.raises(KeyError, match="double free"):
        m.free("c")
    with pytest.raises(KeyError, match="finished"):
        m.fork("c", "e")
    assert state(m) == before


def test_no_prefix_cache_means_no_computed_blocks():
    m = CowBlockManager(4, block_size=2)
    assert m.get_computed_blocks("a", [1, 2, 3]) == ([], 0), "a manager without prefix caching never has hits"
    m.allocate_slots("a", 3)
    with pytest.raises(ValueError, match="already running"):
        m.get_computed_blocks("a", [1, 2, 3])


# --- property test: random programs of allocate / fork / append / free -----------------------------
#
# Every operation is first judged from the outside, from the block tables, token counts and reference
# counts before it. One that must succeed is called plainly, so any exception fails the test; one that
# must fail has to raise the expected error and leave the manager exactly as it was.

BS, NUM_BLOCKS = 3, 12


def blocks_needed(m, seq, n):
    """Blocks allocate_slots(seq, n) must take, worked out from the tables: new blocks plus a copy-on-write copy."""
    if seq not in m.num_tokens:
        return -(-n // BS)
    t, table = m.num_tokens[seq], m.block_tables[seq]
    copy = t % BS != 0 and m.block_pool.blocks[table[-1]].ref_cnt > 1
    return -(-(t + n) // BS) - len(table) + copy


def attempt(m, error, method, *args):
    """method(*args) must succeed when error is None; otherwise it must raise error and change nothing."""
    if error is None:
        return method(*args)
    before = state(m)
    with pytest.raises(error):
        method(*args)
    assert state(m) == before, f"a failed operation ({error.__name__}) must leave the manager exactly as it was"
    return None


def check_allocation(m, seq, n, tables_before, tokens_before, slots):
    start = tokens_before.get(seq, 0)
    table = m.block_tables[seq]
    assert m.num_tokens[seq] == start + n, "allocate_slots grows the sequence by exactly num_new_tokens"
    assert slots == [table[p // BS] * BS + p % BS for p in range(start, start + n)], \
        "the slots are those of positions start .. start + n - 1 through the new block table"
    assert all(m.block_pool.blocks[s // BS].ref_cnt == 1 for s in slots), \
        "a token is only ever written into a block no other sequence holds (copy-on-write)"
    old = tables_before.get(seq, [])
    assert table[:start // BS] == old[:start // BS], "full blocks are never replaced: they stay shared"
    copies = m.take_copy_orders()
    if start % BS and old[-1] != table[len(old) - 1]:
        assert copies == [(old[-1], table[len(old) - 1])], "a replaced shared block is copied into its replacement"
    else:
        assert copies == [], "no copy unless a shared, partly filled last block was replaced"


ops = st.lists(st.tuples(st.sampled_from(["alloc", "fork", "append", "free"]), st.integers(0, 7), st.integers(0, 9)),
               max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_fork_append_free_keeps_invariants(program):
    m = CowBlockManager(NUM_BLOCKS, block_size=BS)
    for op, a, b in program:
        tables, tokens = m.block_tables, dict(m.num_tokens)
        held = {x for t in tables.values() for x in t}
        running = a in tokens
        if op in ("alloc", "append"):
            # alloc admits a new sequence of b tokens (or grows a running one by b); append adds one token.
            n = b if op == "alloc" else 1
            error = ValueError if n == 0 else MemoryError if blocks_needed(m, a, n) > m.num_free_blocks else None
            # With error None this must succeed: e.g. one more token of a sequence whenever a block is free.
            slots = attempt(m, error, m.allocate_slots, a, n)
            if error is None:
                check_allocation(m, a, n, tables, tokens, slots)
        elif op == "fork":
            child = b % 8
            error = KeyError if not running else ValueError if child in tokens else None
            attempt(m, error, m.fork, a, child)
            if error is None:
                assert m.block_tables[child] == tables[a] and m.num_tokens[child] == tokens[a], \
                    "a fork names its parent's blocks and stores as many tokens"
                assert m.num_free_blocks == NUM_BLOCKS - len(held), "a fork takes no block"
        else:
            attempt(m, None if running else KeyError, m.free, a)
            if running:
                still_held = {x for s, t in tables.items() if s != a for x in t}
                assert m.num_free_blocks == NUM_BLOCKS - len(still_held), \
                    "free returns exactly the blocks no other sequence holds"
                assert a not in m.block_tables and a not in m.num_tokens
        pool = m.block_pool
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        owners = [0] * pool.num_blocks
        for sid, table in m.block_tables.items():
            assert len(table) == -(-m.num_tokens[sid] // BS)
            for blk in table:
                owners[blk] += 1
        assert [blk.ref_cnt for blk in pool.blocks] == owners
        assert sorted(pool.free_block_queue.block_ids()) == [i for i, c in enumerate(owners) if c == 0]
        assert m.copy_orders == [], "every copy order made was taken"
