"""Chapter 4: the KV cache manager's prefix caching: the longest cached prefix, shared blocks, eviction."""

import copy

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule
from test_block_pool import _pool_state

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.prefix_cache import block_hashes, hash_block_tokens


def _manager_state(manager: KVCacheManager):
    return (_pool_state(manager.block_pool), manager.block_tables, dict(manager.num_tokens),
            copy.deepcopy(manager._req_hashes), copy.deepcopy(manager._req_tail), manager.queries, manager.hits)


def _admit(manager, rid, tokens, extra_keys=None):
    blocks, num_cached = manager.get_computed_blocks(rid, tokens, extra_keys)
    manager.allocate_slots(rid, len(tokens) - num_cached, blocks, new_token_ids=tokens[num_cached:],
                           extra_keys=extra_keys)
    return num_cached


# --- the longest cached prefix -----------------------------------------------------------------------

@pytest.mark.parametrize("prompt_len", range(1, 16))
def test_a_hit_is_the_longest_cached_prefix_but_never_the_whole_prompt(prompt_len):
    manager = KVCacheManager(num_blocks=16, block_size=4)
    cached = list(range(100, 112))  # 3 full blocks, all cached
    _admit(manager, "a", cached + [7])
    prompt = (cached + [50, 51, 52, 53])[:prompt_len]
    blocks, num_cached = manager.get_computed_blocks("b", prompt)
    usable = min(3, (prompt_len - 1) // 4)  # full blocks that leave at least the last prompt token to compute
    assert num_cached == 4 * usable and len(blocks) == usable, (
        f"a {prompt_len}-token prompt whose first 3 blocks are cached hits {usable} blocks: as many as are cached, "
        f"capped at (len - 1) // block_size so the last token is recomputed and its logits sampled")
    assert num_cached < prompt_len, "the hit never covers the whole prompt"
    assert [b.block_id for b in blocks] == manager.block_tables["a"][:usable], "the hits are a's blocks, in order"


def test_the_hit_stops_at_the_first_uncached_block_even_if_later_ones_are_cached():
    manager = KVCacheManager(num_blocks=6, block_size=2)
    manager.allocate_slots("f", 1, new_token_ids=[1])       # f starts [1 ...] in block 0
    _admit(manager, "a", [1, 2, 9])                          # a caches [1, 2] (hash h0) in block 1
    manager.allocate_slots("f", 4, new_token_ids=[2, 3, 4, 5])
    # f's block 0 now holds [1, 2] too but stays uncached (h0 keeps its first block, a's block 1);
    # f's block 3 holds [3, 4] and is cached under h1, the hash of [3, 4] after [1, 2].
    h0 = hash_block_tokens(None, [1, 2])
    h1 = hash_block_tokens(h0, [3, 4])
    pool = manager.block_pool
    assert pool.get_cached_block(h0).block_id == 1 and pool.get_cached_block(h1).block_id == 3
    manager.free("a")
    _admit(manager, "x", [7, 7, 7, 7, 7])                    # takes blocks 5, 2, 1: evicts a's [1, 2]
    assert pool.get_cached_block(h0) is None and pool.get_cached_block(h1).block_id == 3
    assert manager.get_computed_blocks("y", [1, 2, 3, 4, 6]) == ([], 0), (
        "the first block missed, so nothing is a hit: a later cached block is useless without the K/V before it")


def test_lookups_change_nothing():
    manager = KVCacheManager(num_blocks=6, block_size=2)
    _admit(manager, "a", [1, 2, 3, 4, 5])
    manager.free("a")
    before = _manager_state(manager)
    blocks, num_cached = manager.get_computed_blocks("b", [1, 2, 3, 4, 5])
    assert num_cached == 4 and _manager_state(manager) == before, \
        "get_computed_blocks only looks: references are taken by allocate_slots"
    assert manager.num_blocks_to_allocate("b", 1, blocks) == 3 and _manager_state(manager) == before, \
        "two free cached hits leave the free queue plus one new block; counting them changes nothing"


# --- the rest of the manager -------------------------------------------------------------------------

def test_shared_prefix_is_a_hit_and_blocks_are_shared():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    assert _admit(manager, "a", list(range(10))) == 0
    assert _admit(manager, "b", list(range(8)) + [50, 51, 52]) == 8
    assert manager.block_tables["a"][:2] == manager.block_tables["b"][:2]
    assert manager.block_tables["a"][2] != manager.block_tables["b"][2]
    assert [manager.block_pool.blocks[i].ref_cnt for i in manager.block_tables["a"]] == [2, 2, 1]
    assert manager.num_cached_tokens == {"a": 0, "b": 8}
    assert (manager.queries, manager.hits, manager.prefill_tokens_saved) == (21, 8, 8)
    assert manager.hit_rate == pytest.approx(8 / 21)


def test_a_prompt_admitted_a_chunk_at_a_time_counts_whole_and_a_readmission_counts_apart():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    _admit(manager, "a", list(range(12)))
    prompt = list(range(8)) + [60 + i for i in range(12)]   # 20 tokens, the first 8 cached
    blocks, num_cached = manager.get_computed_blocks("b", prompt)
    manager.allocate_slots("b", 4, blocks, new_token_ids=prompt[8:12], num_query_tokens=len(prompt))
    assert (manager.queries, manager.hits) == (12 + 20, 8), \
        "the whole 20-token prompt was looked up, though only its first chunk of 4 was admitted now"
    manager.allocate_slots("b", 8, new_token_ids=prompt[12:])
    assert manager.queries == 32, "later chunks are no new lookup"
    manager.free("b")
    blocks, num_cached = manager.get_computed_blocks("b", prompt)
    manager.allocate_slots("b", 20 - num_cached, blocks, new_token_ids=prompt[num_cached:], num_query_tokens=20,
                           preempted=True)
    assert (manager.queries, manager.hits) == (32, 8), "a re-admission finds its own blocks: not prefix sharing"
    assert (manager.preempted_queries, manager.preempted_hits) == (20, num_cached) and num_cached == 16
    with pytest.raises(ValueError, match="num_query_tokens is the length looked up at admission"):
        manager.allocate_slots("c", 4, new_token_ids=[1, 2, 3, 4], num_query_tokens=3)
    assert "c" not in manager.num_tokens


def test_prefix_shorter_than_a_block_is_no_hit():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    _admit(manager, "a", [1, 2, 3, 9, 9])
    assert manager.get_computed_blocks("b", [1, 2, 3, 7, 7]) == ([], 0)


def test_whole_prompt_cached_recomputes_its_last_block():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    _admit(manager, "a", prompt)
    blocks, num_cached = manager.get_computed_blocks("b", prompt)
    assert num_cached == 4 and len(blocks) == 1, "the last block is left out so its last token gets logits"
    slots = manager.allocate_slots("b", 4, blocks, new_token_ids=prompt[4:])
    assert len(slots) == 4 and manager.block_tables["b"][0] == manager.block_tables["a"][0]
    assert manager.block_tables["b"][1] != manager.block_tables["a"][1]
    # One token more than the cached blocks: every full block is a hit.
    assert manager.get_computed_blocks("c", prompt + [99])[1] == 8


def test_blocks_filled_by_decoding_are_cached():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    _admit(manager, "a", [1, 2, 3])
    manager.allocate_slots("a", 1, new_token_ids=[4])
    manager.allocate_slots("a", 1, new_token_ids=[5])
    assert manager.get_computed_blocks("b", [1, 2, 3, 4, 5])[1] == 4


def test_evicted_block_is_a_miss_and_tail_goes_first():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    _admit(manager, "a", [1, 2, 3, 4, 5, 6, 7])  # 4 blocks, 3 full and cached
    manager.free("a")
    # Freed last block first: the prefix block is the last to be evicted.
    assert manager.block_pool.free_block_queue.block_ids() == [3, 2, 1, 0]
    _admit(manager, "b", [8, 8, 8])  # takes blocks 3 and 2: 2 held [5, 6]
    assert manager.get_computed_blocks("c", [1, 2, 3, 4, 5, 6, 0])[1] == 4
    _admit(manager, "d", [9, 9, 9])  # takes 1 ([3, 4]) and 0 ([1, 2])
    assert manager.get_computed_blocks("c", [1, 2, 3, 4, 5, 6, 0]) == ([], 0)


def test_freed_partial_blocks_are_reused_before_free_cached_ones():
    # vLLM's test_prefill at block size 4: two requests share 3 cached blocks and end in a partly
    # filled block each. After both finish, the partial blocks (no hash) are at the front, newest
    # first, then the never-used blocks, then the shared prefix tail first. Under the old rule
    # (every freed block to the back) the queue was [5, 6, 7, 8, 9, 3, 4, 2, 1, 0].
    manager = KVCacheManager(num_blocks=10, block_size=4)
    common = [1] * 4 + [2] * 4 + [3] * 4
    assert _admit(manager, "a", common + [4, 4, 4]) == 0
    assert _admit(manager, "b", common + [5]) == 12
    assert manager.block_tables == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 4]}
    manager.free("a")
    manager.free("b")
    assert manager.block_pool.free_block_queue.block_ids() == [4, 3, 5, 6, 7, 8, 9, 2, 1, 0]
    assert _admit(manager, "c", common + [6, 6]) == 12 and manager.block_tables["c"] == [0, 1, 2, 4], \
        "the hit takes the cached prefix; the new partial block is the partial block freed last"
    manager.free("c")
    assert _admit(manager, "d", [9] * 40) == 0
    assert manager.block_tables["d"] == [4, 3, 5, 6, 7, 8, 9, 2, 1, 0], \
        "a cache miss uses every uncached free block before it evicts a cached one, then the prefix tail first"


def test_a_new_request_does_not_evict_a_cached_prefix_while_uncached_blocks_are_free():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    _admit(manager, "a", [1, 2, 3])            # block 0 caches [1, 2]; block 1 holds [3]
    manager.free("a")                          # queue: 1 (uncached, front), 2, 3, 0 (cached, back)
    _admit(manager, "b", [7, 8, 9, 9, 9])      # 3 blocks: 1, 2 and 3, all uncached
    assert manager.block_tables["b"] == [1, 2, 3] and manager.block_pool.num_evictions == 0
    assert manager.get_computed_blocks("c", [1, 2, 5])[1] == 2, "a's prefix block survived b's admission"


def test_stale_hits_are_rejected():
    manager = KVCacheManager(num_blocks=2, block_size=2)
    _admit(manager, "a", [1, 2, 3])
    manager.free("a")
    blocks, _ = manager.get_computed_blocks("b", [1, 2, 3])
    _admit(manager, "c", [7, 7, 7])  # evicts the hit
    before = _manager_state(manager)
    with pytest.raises(ValueError, match="no longer cached"):
        manager.allocate_slots("b", 1, blocks, new_token_ids=[3])
    assert _manager_state(manager) == before


def test_extra_keys_separate_requests():
    manager = KVCacheManager(num_blocks=8, block_size=2)
    _admit(manager, "a", [1, 2, 3], extra_keys="lora-1")
    assert manager.get_computed_blocks("b", [1, 2, 3], "lora-2")[1] == 0
    assert manager.get_computed_blocks("b", [1, 2, 3], "lora-1")[1] == 2


def _serve_shared_prefixes(manager: KVCacheManager) -> list[int]:
    """Admit, grow and free requests that share two system prompts; the cached tokens of each admission."""
    system = [list(range(100, 100 + 3 * BLOCK_SIZE)), list(range(200, 200 + 2 * BLOCK_SIZE))]
    hits = []
    for i in range(12):
        tokens = system[i % 2] + [1000 + i] * (i % 5 + 1)
        hits.append(_admit(manager, i, tokens))
        manager.allocate_slots(i, 3, new_token_ids=[7, 8, 9])
        if i % 3:
            manager.free(i - 1)
    return hits


def test_builtin_hashing_finds_the_same_hits_as_sha256():
    by_algo = {algo: KVCacheManager(64, BLOCK_SIZE, prefix_caching_hash_algo=algo) for algo in ("sha256", "builtin")}
    hits = {algo: _serve_shared_prefixes(m) for algo, m in by_algo.items()}
    assert hits["sha256"] == hits["builtin"] and sum(hits["sha256"]) > 0, (
        f"a block's hash function decides only what equal prefixes are called, never which blocks match: "
        f"cached tokens per admission, sha256 {hits['sha256']}, builtin {hits['builtin']}")
    assert by_algo["sha256"].block_tables == by_algo["builtin"].block_tables
    assert all(isinstance(h, int) for h in by_algo["builtin"].block_pool.cached_block_hash_to_block), (
        "builtin hashes are Python's 64-bit hash() values")
    with pytest.raises(ValueError, match="sha256, builtin"):
        KVCacheManager(4, BLOCK_SIZE, prefix_caching_hash_algo="md5")


def test_allocate_blocks_is_allocate_slots_without_the_slots():
    with_slots, without = KVCacheManager(24, BLOCK_SIZE), KVCacheManager(24, BLOCK_SIZE)
    tokens = list(range(1, 2 * BLOCK_SIZE + 3))
    slots = with_slots.allocate_slots("a", len(tokens), new_token_ids=tokens)
    assert without.allocate_blocks("a", len(tokens), new_token_ids=tokens) is None
    def state(m):
        pool = m.block_pool
        return (m.block_tables, m.num_tokens, m._req_hashes, m._req_tail, m.queries, pool.free_block_queue.block_ids(),
                [(b.ref_cnt, b.block_hash) for b in pool.blocks],
                {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()})
    assert state(with_slots) == state(without), (
        "the scheduler calls allocate_blocks: it must change the manager exactly as allocate_slots does")
    table = without.block_tables["a"]
    assert slots == [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(len(tokens))], (
        "the slots allocate_slots returns are what the runner computes from the block table it is sent")


def test_manager_errors_leave_it_unchanged():
    manager = KVCacheManager(num_blocks=3, block_size=2)
    _admit(manager, "a", [1, 2, 3, 4, 5])
    manager.free("a")
    _admit(manager, "b", [1, 2, 6])
    before = _manager_state(manager)
    with pytest.raises(KeyError, match="'a' holds no blocks"):
        manager.free("a")
    with pytest.raises(KeyError, match="'zzz' holds no blocks"):
        manager.free("zzz")
    with pytest.raises(MemoryError, match="request 'c' needs 3 more blocks but only 1 are free"):
        manager.allocate_slots("c", 5, new_token_ids=[0] * 5)
    with pytest.raises(ValueError, match="already running"):
        manager.get_computed_blocks("b", [1, 2])
    with pytest.raises(ValueError, match="new_token_ids"):
        manager.allocate_slots("b", 1)
    with pytest.raises(ValueError, match="2 new token ids for 1"):
        manager.allocate_slots("b", 1, new_token_ids=[1, 2])
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots("b", 0, new_token_ids=[])
    assert _manager_state(manager) == before


# --- property test: random allocate / append / fork / free against a model of what blocks hold ----

BLOCK_SIZE = 2
NUM_BLOCKS = 8


class PrefixCachingMachine(RuleBasedStateMachine):
    """Drives a KVCacheManager and tracks which tokens each physical block really holds."""

    requests = Bundle("requests")

    def __init__(self):
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.tokens: dict[int, list[int]] = {}     # request id -> its tokens
        self.contents: dict[int, tuple] = {}       # block id -> the whole prefix up to the end of that block
        self.next_id = 0

    def _record_writes(self, rid, start):
        # The model writes positions start.. of the request into its blocks; a block's "contents" is
        # the sequence prefix whose K/V it holds, which is what its hash must describe.
        table = self.manager.block_tables[rid]
        for p in range(start, len(self.tokens[rid])):
            block = table[p // BLOCK_SIZE]
            self.contents[block] = tuple(self.tokens[rid][:p // BLOCK_SIZE * BLOCK_SIZE + BLOCK_SIZE])

    def _admit(self, tokens):
        rid, before = self.next_id, _manager_state(self.manager)
        blocks, num_cached = self.manager.get_computed_blocks(rid, tokens)
        assert num_cached < len(tokens) and num_cached % BLOCK_SIZE == 0
        try:
            self.manager.allocate_slots(rid, len(tokens) - num_cached, blocks, new_token_ids=tokens[num_cached:])
        except MemoryError:
            assert _manager_state(self.manager) == before
            return None
        self.next_id += 1
        self.tokens[rid] = list(tokens)
        self._record_writes(rid, num_cached)
        return rid

    @rule(target=requests, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=7))
    def new_request(self, tokens):
        rid = self._admit(tokens)
        return rid if rid is not None else multiple()  # nothing added to the bundle

    @rule(target=requests, parent=requests, cut=st.integers(0, 8), suffix=st.lists(st.integers(0, 2), max_size=3))
    def fork(self, parent, cut, suffix):
        # A second request that repeats part of another's tokens: shares them through the cache.
        if parent not in self.tokens:
            return multiple()  # nothing added to the bundle
        tokens = self.tokens[parent][:cut] + suffix
        rid = self._admit(tokens or [0])
        return rid if rid is not None else multiple()  # nothing added to the bundle

    @rule(rid=requests, new=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def append(self, rid, new):
        if rid not in self.tokens:
            return
        before = _manager_state(self.manager)
        try:
            self.manager.allocate_slots(rid, len(new), new_token_ids=new)
        except MemoryError:
            assert _manager_state(self.manager) == before
            return
        start = len(self.tokens[rid])
        self.tokens[rid] += new
        self._record_writes(rid, start)

    @rule(rid=consumes(requests))
    def free(self, rid):
        if rid not in self.tokens:
            return
        self.manager.free(rid)
        del self.tokens[rid]
        before = _manager_state(self.manager)
        with pytest.raises(KeyError, match="already freed"):
            self.manager.free(rid)
        assert _manager_state(self.manager) == before

    @invariant()
    def blocks_are_accounted_for(self):
        pool = self.manager.block_pool
        assert pool.num_free_blocks + pool.num_used_blocks == NUM_BLOCKS
        holders = [0] * NUM_BLOCKS
        for table in self.manager.block_tables.values():
            for block in table:
                holders[block] += 1
        assert [b.ref_cnt for b in pool.blocks] == holders
        queued = pool.free_block_queue.block_ids()
        assert sorted(queued) == [i for i, n in enumerate(holders) if n == 0]
        assert len(queued) == pool.num_free_blocks

    @invariant()
    def every_hash_names_what_its_block_holds(self):
        pool = self.manager.block_pool
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash
            content = self.contents[block.block_id]
            assert block_hashes(content, BLOCK_SIZE)[-1] == block_hash
        assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached_block_hash_to_block)

    @invariant()
    def running_requests_hold_their_tokens(self):
        for rid, tokens in self.tokens.items():
            table = self.manager.block_tables[rid]
            assert self.manager.num_tokens[rid] == len(tokens)
            assert len(table) == -(-len(tokens) // BLOCK_SIZE)
            for i in range(len(tokens) // BLOCK_SIZE):
                assert self.contents[table[i]] == tuple(tokens[:(i + 1) * BLOCK_SIZE])



PrefixCachingMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestPrefixCachingMachine = PrefixCachingMachine.TestCase
