"""Chapter 6's scheduler, driven directly: who runs with how many tokens, who is preempted, and where they wait.

Greedy outputs do not depend on the order in which requests are scheduled, so the end-to-end tests
in test_engine.py cannot see a scheduler that preempts the wrong request or puts it back in the
wrong place. These tests drive Scheduler on a pool of a few blocks of 4 tokens, with no model:
`step` plays the model runner's part between schedule() and update_from_output() (a request whose
new tokens reach its end samples token 0). Prefix caching is off unless a test says otherwise, and
every prompt has its own tokens, so no two requests share a block.
"""

import itertools
import random

import kvlab.engine.scheduler as scheduler_module
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.engine.outputs import ModelRunnerOutput
from kvlab.engine.request import Request, RequestStatus
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.scheduler import Scheduler, choose_preemption_victims, next_chunk_size, split_token_budget

BLOCK_SIZE = 4
_fresh_tokens = itertools.count(1)


def make_scheduler(num_blocks, max_num_batched_tokens=64, max_num_seqs=8, preemption_mode="recompute",
                   num_cpu_blocks=8, enable_prefix_caching=False):
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, preemption_mode,
                     num_cpu_blocks if preemption_mode == "swap" else 0)


def add_request(sched, request_id, prompt_len):
    """Queue a request whose prompt_len prompt tokens appear in no other prompt."""
    prompt = [next(_fresh_tokens) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    request = Request(request_id, prompt, params, arrival=len(sched.waiting))
    sched.add_request(request)
    return request


def runner_output(sched, out) -> ModelRunnerOutput:
    """What a model runner would return, without a model: token 0 for every request whose new tokens reach its end."""
    ids = list(out.num_scheduled_tokens)
    sampled = [[0] if sched.requests[rid].num_computed_tokens + n >= sched.requests[rid].num_tokens else []
               for rid, n in out.num_scheduled_tokens.items()]
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled)


def step(sched):
    """One engine step without a model: schedule, the runner's part, then the scheduler's update."""
    out = sched.schedule()
    sched.update_from_output(out, runner_output(sched, out))
    return out


def finish(sched, request):
    sched.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)


def ids(queue):
    return [r.request_id for r in queue]


def tokens(out):
    return dict(out.num_scheduled_tokens)


# ----- the pure rules -----

def test_next_chunk_size_is_what_the_budget_left_allows():
    assert next_chunk_size(5, 0) == 0, "no budget left: no tokens"
    assert next_chunk_size(13, 5) == 5, "a prompt longer than the budget left gets a chunk of exactly the budget"
    assert next_chunk_size(5, 5) == 5, "an exact fit computes the whole prompt"
    assert next_chunk_size(1, 40) == 1, "a decode computes its one token, however large the budget"


def test_split_token_budget_serves_requests_in_admission_order():
    assert split_token_budget([], 10) == [], "nobody to serve"
    assert split_token_budget([3, 4], 0) == [0, 0], "a zero budget gives nobody anything"
    assert split_token_budget([10, 1], 4) == [4, 0], (
        "a budget smaller than the first request's chunk goes entirely to it; the later ones get nothing")
    assert split_token_budget([3, 4], 7) == [3, 4], "an exact fit serves everyone in full"
    assert split_token_budget([3, 4, 1], 7) == [3, 4, 0], "once the budget is spent, the later requests wait"
    assert split_token_budget([1, 1, 20, 1], 12) == [1, 1, 10, 0], (
        "decodes admitted earlier come first; a prompt gets what they leave, and a later decode waits")
    shares = split_token_budget([5, 2, 9], 64)
    assert shares == [5, 2, 9] and sum(shares) <= 64, "a roomy budget serves everyone in full"


def test_split_token_budget_leaves_its_input_unchanged():
    tokens_left = [4, 4, 4]
    split_token_budget(tokens_left, 6)
    assert tokens_left == [4, 4, 4], "the rule is pure: it must not consume its input"


def test_choose_preemption_victims_takes_the_most_recently_admitted_first():
    running = [("a", 3), ("b", 2), ("c", 2), ("d", 1)]
    needed = {"a": 1, "b": 2, "c": 0, "d": 0}
    assert choose_preemption_victims(running, 0, needed) == ["d", "c"], (
        "a needs 1 block: d, the last admitted, gives its 1 back; b needs 2: c, now the last, gives 2")
    assert running == [("a", 3), ("b", 2), ("c", 2), ("d", 1)] and needed == {"a": 1, "b": 2, "c": 0, "d": 0}, (
        "the rule is pure: its inputs are unchanged")


def test_choose_preemption_victims_edge_cases():
    assert choose_preemption_victims([], 0, {}) == [], "nobody running: nobody to preempt"
    assert choose_preemption_victims([("a", 1), ("b", 1)], 2, {"a": 1, "b": 1}) == [], (
        "needs that exactly fit the free blocks preempt nobody")
    assert choose_preemption_victims([("a", 2), ("b", 3)], 0, {"a": 0, "b": 4}) == ["b"], (
        "the request that needs blocks may be the last one running: then it is its own victim")
    assert choose_preemption_victims([("a", 1), ("b", 1), ("c", 1)], 0, {"a": 0, "b": 3, "c": 0}) == ["c", "b"], (
        "later requests go first, and the request itself only when nobody after it is left")
    assert choose_preemption_victims([("a", 1), ("b", 1)], 0, {"a": 5, "b": 0}) == ["b", "a"], (
        "the first request can take everyone down, itself last")
    assert choose_preemption_victims([("a", 1), ("b", 1), ("c", 1), ("d", 6)], 0,
                                     {"a": 1, "b": 1, "c": 1, "d": 0}) == ["d"], (
        "one victim's blocks can serve several earlier requests")
    assert choose_preemption_victims([(7, 4), (8, 0), (9, 2)], 1, {7: 3, 8: 1, 9: 1}) == [9, 8], (
        "a victim that frees no block does not help: the walk keeps preempting")
    assert choose_preemption_victims([("a", 1), ("b", 1), ("c", 1)], 0, {"a": 1, "b": 1, "c": 1}) == ["c", "b"], (
        "once the request itself is preempted the walk ends: nobody after it is left to serve")


def test_schedule_asks_the_pure_rules(monkeypatch):
    """Chapter 6's exercises are checked against these functions, so the engine must run exactly them."""
    calls = []
    for name in ("split_token_budget", "choose_preemption_victims", "next_chunk_size"):
        real = getattr(scheduler_module, name)
        monkeypatch.setattr(scheduler_module, name,
                            lambda *args, _real=real, _name=name: calls.append(_name) or _real(*args))
    sched = make_scheduler(num_blocks=8)
    add_request(sched, "a", 4)
    step(sched)
    add_request(sched, "b", 4)
    step(sched)
    assert {"split_token_budget", "choose_preemption_victims", "next_chunk_size"} <= set(calls), (
        f"Scheduler.schedule must call the pure rules every step, not a copy of them; it called {sorted(set(calls))}")


# ----- the token budget and admission -----

def test_running_requests_first_then_waiting_ones_in_queue_order():
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=6)
    for rid in "abc":
        add_request(sched, rid, 4)
    out = step(sched)
    assert tokens(out) == {"a": 4, "b": 2}, "a's prompt fits, b gets the 2 tokens left as a first chunk, c waits"
    assert out.admitted == ["a", "b"] and ids(sched.waiting) == ["c"], "admission is first come, first served"
    out = step(sched)
    assert tokens(out) == {"a": 1, "b": 2, "c": 3}, (
        "the running requests come first in admission order (a's decode, the rest of b's prompt), "
        "then c is admitted with what is left of the budget")
    assert list(out.num_scheduled_tokens) == ["a", "b", "c"], "the batch is in admission order"
    assert out.total_num_scheduled_tokens == 6, "the whole budget is used, never more"


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks():
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=5)
    request = add_request(sched, "long", 13)
    chunks = []
    while not request.output_token_ids:
        start = request.num_computed_tokens
        out = step(sched)
        assert out.total_num_scheduled_tokens <= 5, "no step computes more than max_num_batched_tokens"
        chunks.append((start, start + tokens(out)["long"]))
    assert chunks == [(0, 5), (5, 10), (10, 13)], (
        "a 13-token prompt under a budget of 5 runs as chunks of 5, 5 and 3 in three steps, each after the last")
    assert tokens(step(sched)) == {"long": 1}, "after its last chunk the request decodes one token per step"


def test_max_num_seqs_caps_the_running_requests():
    sched = make_scheduler(num_blocks=16, max_num_seqs=2)
    for rid in "abc":
        add_request(sched, rid, 2)
    out = step(sched)
    assert out.admitted == ["a", "b"] and ids(sched.waiting) == ["c"], "at most max_num_seqs requests run at once"
    finish(sched, sched.running[0])
    assert step(sched).admitted == ["c"], "a finished request's seat goes to the next waiting one"


def test_a_waiting_request_that_does_not_fit_holds_back_the_ones_behind_it():
    sched = make_scheduler(num_blocks=3)
    add_request(sched, "a", 4)
    step(sched)
    add_request(sched, "big", 12)   # 3 blocks: only 2 are free
    add_request(sched, "small", 1)  # 1 block would fit
    out = step(sched)
    assert out.admitted == [] and ids(sched.waiting) == ["big", "small"], (
        "admission is first come, first served: the request at the front waits for room and nobody overtakes it")


# ----- preemption -----

def three_requests_filling_the_pool(preemption_mode="recompute", num_cpu_blocks=8, waiting=0):
    """Three running requests of one full block each on a 3-block pool (plus `waiting` 1-token requests
    kept waiting by max_num_seqs=3): at the next step every decode needs a new block, and none is free."""
    sched = make_scheduler(num_blocks=3, max_num_seqs=3, preemption_mode=preemption_mode, num_cpu_blocks=num_cpu_blocks)
    for rid in "abc":
        add_request(sched, rid, BLOCK_SIZE)
    for i in range(waiting):
        add_request(sched, f"w{i}", 1)
    out = step(sched)
    assert tokens(out) == {"a": 4, "b": 4, "c": 4} and sched.kv.num_free_blocks == 0, "set-up: the pool is full"
    return sched


def test_preemption_takes_the_most_recently_admitted_request():
    sched = three_requests_filling_the_pool()
    out = step(sched)
    assert out.preempted_req_ids == ["c", "b"], (
        "a's decode needs a block: c, the last admitted, is preempted; then b needs one and is itself the last")
    assert ids(sched.running) == ["a"] and tokens(out) == {"a": 1}, (
        "the first admitted request keeps running: it has done the most work")
    assert sched.num_preemptions == 2


def test_recompute_preemption_puts_the_victims_back_at_the_front_of_the_waiting_queue():
    sched = three_requests_filling_the_pool(waiting=1)
    assert ids(sched.waiting) == ["w0"]
    step(sched)
    assert ids(sched.waiting) == ["b", "c", "w0"], (
        "preempted requests go back to the FRONT of the waiting queue, in their admission order, ahead of "
        "requests that never ran")
    for request in list(sched.waiting)[:2]:
        assert request.status is RequestStatus.PREEMPTED and request.num_computed_tokens == 0, (
            "recompute frees the K/V: the request will compute its prompt and outputs again")
        assert request.request_id not in sched.kv.block_tables, "a recompute-preempted request holds no block"


def test_swap_preemption_puts_the_victims_at_the_front_of_the_swapped_queue():
    sched = three_requests_filling_the_pool("swap", waiting=1)
    out = step(sched)
    assert out.swapped_out == ["c", "b"] and ids(sched.swapped) == ["b", "c"], (
        "each swapped-out request goes to the FRONT of the swapped queue, so the queue keeps admission order")
    assert ids(sched.waiting) == ["w0"], "swapping does not touch the waiting queue"
    for request in sched.swapped:
        assert request.status is RequestStatus.SWAPPED and request.num_computed_tokens == 4, (
            "a swapped request keeps its computed tokens: its K/V wait in the CPU pool")
        assert len(sched.cpu_blocks[request.request_id]) == 1
    assert sched.num_free_cpu_blocks == 8 - 2


def test_a_step_that_preempted_admits_nobody():
    # Budget 4 and 3 blocks: a (one block) runs; c is admitted with a 3-token chunk of its 8-token prompt.
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=4)
    add_request(sched, "a", 4)
    add_request(sched, "c", 8)
    assert tokens(step(sched)) == {"a": 4}
    assert tokens(step(sched)) == {"a": 1, "c": 3}
    out = step(sched)
    # c's next chunk needs a third block: c is preempted, which frees one block; 3 tokens of budget are left.
    assert out.preempted_req_ids == ["c"] and tokens(out) == {"a": 1}
    assert out.admitted == [] and ids(sched.waiting) == ["c"], (
        "a step that had to preempt admits nobody, even a request whose first chunk would fit the block just "
        "freed: the pool has no room to spare")
    out = step(sched)
    assert out.admitted == ["c"] and tokens(out) == {"a": 1, "c": 3}, "the next step admits it again"


def test_waiting_requests_wait_while_a_swapped_request_waits():
    sched = three_requests_filling_the_pool("swap", waiting=1)
    step(sched)                       # c and b swapped out; a keeps running with 2 blocks, 1 block is free
    assert sched.kv.num_free_blocks == 1
    out = step(sched)
    assert out.swapped_in == [], "b needs 2 blocks back (its block and its next token's), only 1 is free"
    assert out.admitted == [] and ids(sched.waiting) == ["w0"], (
        "w0 needs only 1 block, but a waiting request is never admitted while a swapped one still waits")
    finish(sched, sched.running[0])    # a leaves: 3 blocks free
    out = step(sched)
    assert out.swapped_in == ["b"] and out.admitted == ["b"], (
        "swapped requests come back first, from the front of the swapped queue")
    assert ids(sched.swapped) == ["c"] and ids(sched.waiting) == ["w0"], (
        "c does not fit after b, and w0 still waits behind the swapped c")


def test_a_full_cpu_pool_falls_back_to_recompute():
    sched = three_requests_filling_the_pool("swap", num_cpu_blocks=1)
    out = step(sched)
    assert out.preempted_req_ids == ["c", "b"] and out.swapped_out == ["c"], "c takes the only CPU block"
    assert ids(sched.swapped) == ["c"] and ids(sched.waiting) == ["b"], (
        "with the CPU pool full, b is preempted by recompute instead: to the front of the waiting queue")
    assert sched.waiting[0].status is RequestStatus.PREEMPTED and sched.waiting[0].num_computed_tokens == 0


def test_a_victim_sharing_a_block_frees_only_the_blocks_nobody_else_holds():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=True)
    add_request(sched, "a", BLOCK_SIZE)                        # 1 block
    b = add_request(sched, "b", 2 * BLOCK_SIZE)                # 2 blocks, both full: cached as they fill
    c = Request("c", b.prompt_token_ids[:BLOCK_SIZE] + [next(_fresh_tokens) for _ in range(BLOCK_SIZE)],
                b.params, arrival=2)        # b's first block, then its own
    sched.add_request(c)
    step(sched)
    tables = sched.kv.block_tables
    assert tables["c"][0] == tables["b"][0] and sched.kv.num_free_blocks == 0, "set-up: c shares b's first block"
    out = step(sched)
    # Every decode needs a new block. Preempting c returns only its own block (b still holds the shared one),
    # which a takes; b then needs one more and is itself the last running request.
    assert out.preempted_req_ids == ["c", "b"] and ids(sched.running) == ["a"], (
        "a victim that shares a block with an earlier request returns only its own blocks to the pool, "
        "so the preemption goes on until the blocks really are there")


def test_the_blocks_each_preemption_frees_stay_right_as_requests_share_grow_and_leave():
    """choose_preemption_victims is told, per running request, the blocks its preemption returns once every later
    one is gone: those no earlier running request holds. The scheduler keeps that count up to date rather than
    rebuilding every table each step, so check it against the tables at every step of a busy run: requests
    sharing cached prefixes, growing, finishing or aborted from the middle of the running list, and preempted."""
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=12, max_num_batched_tokens=12, max_num_seqs=6, enable_prefix_caching=True)
    prefixes = [[next(_fresh_tokens) for _ in range(4 * BLOCK_SIZE)] for _ in range(2)]
    seen = {"shared": 0, "aborted in the middle": 0}
    for i in range(400):
        if i < 60 and rng.random() < 0.6:
            prompt = rng.choice(prefixes)[:rng.randrange(1, 4 * BLOCK_SIZE + 1)] + \
                [next(_fresh_tokens) for _ in range(rng.randrange(1, 6))]
            sched.add_request(Request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(1, 20),
                                                                       ignore_eos=True), arrival=i))
        if len(sched.running) > 2 and rng.random() < 0.1:
            finish(sched, sched.running[1])
            seen["aborted in the middle"] += 1
        held, expected = set(), []
        for request in sched.running:
            own = set(sched.kv.get_block_ids(request.request_id)) - held
            expected.append(len(own))
            held |= own
        seen["shared"] += sum(len(sched.kv.get_block_ids(r.request_id)) - n for r, n in zip(sched.running, expected))
        assert sched._blocks_freed_by_preemption() == expected, (
            f"step {i}: the blocks each running request's preemption would free, {ids(sched.running)}: the "
            f"scheduler says {sched._blocks_freed_by_preemption()}, the block tables {expected}")
        step(sched)
    assert sched.num_preemptions and all(seen.values()) and not sched.has_unfinished_requests(), (
        f"set-up: the run must preempt ({sched.num_preemptions}), share blocks and abort from the middle ({seen}), "
        f"and finish every request")



# ----- behaviours a planted bug once slipped past: each at the layer that owns it -----

def test_a_recompute_preempted_request_reuses_the_cached_blocks_of_its_outputs():
    """Re-admission looks up prompt *and* outputs: the block its decodes filled is still cached."""
    sched = make_scheduler(num_blocks=3, max_num_seqs=2, enable_prefix_caching=True)
    a = add_request(sched, "a", BLOCK_SIZE)       # one full block
    b = add_request(sched, "b", 2)                # two prompt tokens: its outputs fill the rest of its block
    for _ in range(3):
        step(sched)
    assert (a.num_tokens, b.num_tokens, sched.kv.num_free_blocks) == (7, 5, 0), "set-up: the pool is full"
    out = step(sched)                             # b's next token needs a new block: b, the last admitted, goes
    assert out.preempted_req_ids == ["b"] and b.status is RequestStatus.PREEMPTED and b.recompute_until == 4
    finish(sched, a)
    out = step(sched)
    assert out.admitted == ["b"]
    assert sched.kv.num_cached_tokens["b"] == BLOCK_SIZE, (
        "b's first block holds its 2 prompt tokens and 2 outputs; cached when it filled, it must be hit on "
        "re-admission (a lookup of the prompt alone would find nothing)")
    assert out.num_scheduled_tokens["b"] == 5 - BLOCK_SIZE, "of its 5 tokens, only the one past the hit is recomputed"


def test_swap_in_copies_back_only_the_blocks_that_are_no_longer_cached():
    sched = make_scheduler(num_blocks=3, max_num_seqs=2, preemption_mode="swap", num_cpu_blocks=8,
                           enable_prefix_caching=True)
    a = add_request(sched, "a", BLOCK_SIZE)               # one full block
    b = add_request(sched, "b", BLOCK_SIZE + 1)           # a full block (cached) and one more
    step(sched)
    out = step(sched)                                     # a needs a block: b is swapped out, both its blocks copied
    assert out.swapped_out == ["b"] and len(out.blocks_to_swap_out) == 2
    cpu_ids = list(sched.cpu_blocks["b"])
    finish(sched, a)
    out = step(sched)
    assert out.swapped_in == ["b"]
    assert sched.kv.num_cached_tokens["b"] == BLOCK_SIZE, "set-up: b's first block was still cached on the device"
    table = sched.kv.get_block_ids("b")
    assert out.blocks_to_swap_in == [(cpu_ids[1], table[1])], (
        "the cached first block needs no copy: only the second comes back from the CPU pool, into b's new block")
    assert sched.num_free_cpu_blocks == 8, "every CPU block of the request is free again, copied or not"
    assert b.num_computed_tokens == BLOCK_SIZE + 1 + out.num_scheduled_tokens["b"]


def test_lookahead_slots_stop_at_the_longest_length_so_a_request_that_fills_the_pool_runs():
    """Without the cap, a request that exactly fills the pool asks for lookahead blocks past its end, is preempted and
    waits forever."""
    kv = KVCacheManager(3, BLOCK_SIZE, False)
    sched = Scheduler(kv, 4, 64, num_lookahead_tokens=3, num_speculative_tokens=3)
    request = Request("r", list(range(1, 9)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), 0)
    sched.add_request(request)                 # 8 + 4 = 12 tokens = the whole pool of 3 blocks of 4
    for _ in range(12):
        if not sched.has_unfinished_requests():
            break
        out = step(sched)
        assert not out.preempted_req_ids, "the request fits the pool; lookahead past its end must not evict it"
    assert request.status is RequestStatus.FINISHED_LENGTH and len(request.output_token_ids) == 4


def test_update_stops_exactly_at_max_tokens_even_with_tokens_to_spare():
    """A verification can emit more tokens than are left: the request keeps exactly max_tokens of them."""
    sched = make_scheduler(num_blocks=8)
    request = Request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), 0)
    sched.add_request(request)
    out = sched.schedule()
    results = sched.update_from_output(out, ModelRunnerOutput(["r"], [[7, 8, 9, 10, 11]]))
    assert request.output_token_ids == [7, 8, 9] and request.status is RequestStatus.FINISHED_LENGTH
    assert results[0].new_token_ids == [7, 8, 9] and results[0].finished
    assert sched.kv.num_free_blocks == 8, "a finished request gives its blocks back in the same update"
    one = Request("s", [1], SamplingParams(max_tokens=1), 1)
    one.append_output(4)
    assert one.status is RequestStatus.FINISHED_LENGTH and one.num_tokens == 2, "max_tokens=1: one token, no more"


def test_speculative_counters_count_only_steps_that_verified_drafts():
    sched = Scheduler(KVCacheManager(8, BLOCK_SIZE, False), 4, 64, num_speculative_tokens=3)
    request = Request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), 0)
    sched.add_request(request)
    out = sched.schedule()    # the prefill: no drafts to verify
    sched.update_from_output(out, ModelRunnerOutput(["r"], [[5]], spec_token_ids=[[]]))
    out = sched.schedule()    # a decode that proposed nothing
    sched.update_from_output(out, ModelRunnerOutput(["r"], [[6]], spec_token_ids=[[6, 7]]))
    stats = sched.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (0, 0, 0), (
        "steps without drafts verify nothing and must not count as drafts")
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"r": [6, 7]}
    sched.update_from_output(out, ModelRunnerOutput(["r"], [[6, 9]]))   # the first draft accepted, then 9
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 2, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]
    assert request.num_computed_tokens == 5 + 1, "the rejected draft's position does not count as computed"


def test_the_waiting_count_includes_preempted_and_swapped_requests():
    sched = three_requests_filling_the_pool("swap", num_cpu_blocks=1, waiting=1)
    step(sched)   # c swapped out, b preempted by recompute (the CPU pool is full)
    assert len(sched.swapped) == 1 and any(r.status is RequestStatus.PREEMPTED for r in sched.waiting)
    running, waiting = sched.get_request_counts()
    assert running == len(sched.running) == 1
    assert waiting == 3, "the never-run w0, the recompute-preempted b and the swapped-out c all wait"
