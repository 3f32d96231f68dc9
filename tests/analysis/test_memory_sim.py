"""Tests for the trace generators and the trace-driven KV memory simulator."""

from pathlib import Path

import numpy as np
import pytest

from kvlab.analysis.memory_sim import ALLOCATORS, CATEGORIES, simulate
from kvlab.analysis.traces import (
    TraceRequest,
    chat_trace,
    generate_trace,
    instruct_trace,
    load_trace,
    save_trace,
)

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "assets" / "traces" / "chat.csv"
NUM_SLOTS = 13_312  # the benchmark's arena: 6.5 x max_model_len
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def shipped():
    return load_trace(SHIPPED)


@pytest.fixture(scope="module")
def results(shipped):
    runs = {a: simulate(shipped, a, num_slots=NUM_SLOTS) for a in ("max", "pow2", "oracle")}
    for bs in (1, 16):
        runs[f"paged{bs}"] = simulate(shipped, "paged", num_slots=NUM_SLOTS, block_size=bs)
    return runs


def req(i, arrival, prompt, output):
    return TraceRequest(request_id=i, arrival_step=arrival, prompt_len=prompt, output_len=output)


def assert_accounted(result):
    """Every slot is in exactly one category at every step, and no count is negative."""
    total = sum(result.category(c) for c in CATEGORIES)
    assert (total == result.num_slots).all()
    for c in CATEGORIES:
        assert (result.category(c) >= 0).all(), c
    assert (result.external_strict <= result.external).all()
    shares = result.arena_shares()
    assert sum(shares.values()) == pytest.approx(1.0)


# --- traces ---------------------------------------------------------------------------------


def test_traces_are_reproducible_from_their_seed():
    assert chat_trace(50, seed=3) == chat_trace(50, seed=3)
    assert chat_trace(50, seed=3) != chat_trace(50, seed=4)
    assert instruct_trace(50, seed=3) == instruct_trace(50, seed=3)


def test_shipped_trace_is_the_documented_generator_call(shipped):
    assert shipped == chat_trace(num_requests=400, arrival_rate=0.1, max_model_len=2048, seed=0)


def test_trace_shape_and_clipping():
    for trace in (chat_trace(300, max_model_len=512), instruct_trace(300)):
        arrivals = [r.arrival_step for r in trace]
        assert arrivals == sorted(arrivals) and arrivals[0] == 0
        assert [r.request_id for r in trace] == list(range(300))
        assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in trace)
    assert max(r.final_len for r in chat_trace(300, max_model_len=512)) <= 512
    chat, instruct = chat_trace(400), instruct_trace(400)
    assert np.mean([r.prompt_len for r in chat]) > 4 * np.mean([r.prompt_len for r in instruct])
    assert np.mean([r.output_len for r in chat]) > 4 * np.mean([r.output_len for r in instruct])


def test_poisson_arrival_rate():
    trace = generate_trace(
        2000, arrival_rate=0.5, prompt_mean=10, prompt_sigma=0.5, output_mean=10,
        output_sigma=0.5, max_model_len=100, seed=1,
    )
    assert len(trace) / (trace[-1].arrival_step + 1) == pytest.approx(0.5, rel=0.1)


def test_save_and_load_round_trip(tmp_path):
    trace = instruct_trace(20, seed=7)
    path = tmp_path / "t.csv"
    save_trace(trace, path)
    assert load_trace(path) == trace


@pytest.mark.parametrize(
    "text",
    [
        "",
        "id,arrival,prompt,output\n0,0,5,5\n",
        "request_id,arrival_step,prompt_len,output_len\n0,0,5\n",
        "request_id,arrival_step,prompt_len,output_len\n0,0,five,5\n",
        "request_id,arrival_step,prompt_len,output_len\n0,0,0,5\n",
    ],
)
def test_load_rejects_malformed_csv(tmp_path, text):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError):
        load_trace(path)


def test_request_validates_its_fields():
    with pytest.raises(ValueError):
        req(0, 0, 0, 5)
    with pytest.raises(ValueError):
        req(0, -1, 5, 5)
    assert req(0, 0, 5, 7).final_len == 12


# --- accounting on hand-built scenarios -----------------------------------------------------


def four_requests_then_a_big_one():
    # Oracle in a 100-slot arena: ranges [0,30) [30,50) [50,80) [80,100) fill it at step 0.
    # The two 30-slot requests finish after step 1 and leave holes of 30 + 30 slots, while the
    # 50-slot request that arrived at step 1 waits for the 20-slot ones to finish after step 10.
    return [
        req(0, 0, 29, 1),
        req(1, 0, 10, 10),
        req(2, 0, 29, 1),
        req(3, 0, 10, 10),
        req(4, 1, 40, 10),
    ]


def test_external_fragmentation_occurs_with_holes_of_30_and_30():
    r = simulate(four_requests_then_a_big_one(), "oracle", num_slots=100, max_model_len=100)
    assert_accounted(r)
    assert list(r.steps[:3]) == [0, 1, 2]
    assert r.external[1] == 0 and r.free[1] == 0  # arena full: nothing free to strand
    assert (r.external[2:11] == 60).all()  # holes of 30 + 30 while 50 slots are needed
    assert (r.external_strict[2:11] == 60).all()  # 60 free would have held it, if contiguous
    assert (r.free[2:11] == 0).all()
    assert r.num_waiting[10] == 1 and r.num_waiting[11] == 0
    assert r.wait_steps[4] == 10  # waited at steps 1..10, admitted at step 11
    assert r.num_completed == 5
    assert (r.internal == 0).all()  # an oracle reserves exactly the final length


def test_tokens_and_reserved_follow_prefill_then_one_token_per_step():
    r = simulate([req(0, 0, 5, 3)], "max", num_slots=64, max_model_len=16)
    assert list(r.tokens) == [5, 6, 7, 8]
    assert list(r.reserved) == [3, 2, 1, 0]
    assert list(r.internal) == [8] * 4  # 16 reserved, 8 never used
    assert list(r.free) == [48] * 4  # nobody waits, so free rather than external
    assert r.num_steps == 4 and r.num_completed == 1


def test_pow2_internal_fragmentation():
    r = simulate([req(0, 0, 5, 4)], "pow2", num_slots=64, max_model_len=64)
    assert (r.internal == 16 - 9).all()


def test_fcfs_head_of_line_blocking():
    # r1 needs 50 slots with 40 free; r2 would fit but waits behind r1, as in an FCFS server.
    trace = [req(0, 0, 50, 10), req(1, 1, 40, 10), req(2, 1, 5, 5)]
    r = simulate(trace, "oracle", num_slots=100, max_model_len=100)
    assert_accounted(r)
    assert r.wait_steps[1] == r.wait_steps[2] == 10
    # Here the free total (40) can't hold r1 either: external, but not the strict kind.
    assert r.external[1] == 40 and r.external_strict[1] == 0


def test_max_policy_strands_the_tail_of_an_arena_that_is_not_a_multiple():
    trace = [req(i, 0, 10, 20) for i in range(5)]
    r = simulate(trace, "max", num_slots=250, max_model_len=100)
    assert_accounted(r)
    assert r.num_running[0] == 2
    assert r.external[0] == 50 and r.external_strict[0] == 0


def test_paged_allocates_one_block_at_a_time():
    r = simulate([req(0, 0, 5, 6)], "paged", num_slots=64, block_size=4)
    assert list(r.tokens) == [5, 6, 7, 8, 9, 10, 11]
    held = r.tokens + r.reserved + r.internal
    assert list(held) == [8, 8, 8, 8, 12, 12, 12]
    # Final length 11 fills 3 of the last block's 4 slots: 1 slot is internal fragmentation.
    assert list(r.internal) == [0, 0, 0, 0, 1, 1, 1]
    assert (r.external == 0).all()


def test_paged_tail_that_is_not_a_block_is_external_while_someone_waits():
    trace = [req(0, 0, 8, 8), req(1, 0, 8, 8), req(2, 0, 8, 8)]
    r = simulate(trace, "paged", num_slots=18, max_model_len=32, block_size=8)
    assert_accounted(r)
    assert r.num_waiting[0] == 1 and r.external[0] == 2  # 18 % 8 slots never form a block
    assert r.external[-1] == 0 and r.free[-1] == 2  # nobody waits at the end: idle instead
    assert r.num_completed == 3


def test_paged_preempts_the_youngest_and_recomputes():
    # Two requests fit at admission, but both grow past the pool: the younger one is evicted.
    trace = [req(0, 0, 4, 12), req(1, 0, 4, 12)]
    r = simulate(trace, "paged", num_slots=24, max_model_len=32, block_size=4)
    assert_accounted(r)
    assert r.num_preemptions >= 1
    assert r.num_completed == 2
    assert r.wait_steps[0] == 0 and r.wait_steps[1] > 0


def test_paged_request_that_cannot_grow_and_is_youngest_preempts_itself():
    # Two blocks of 4. r1 is admitted second and is the first to need a new block at step 1.
    trace = [req(0, 0, 3, 5), req(1, 0, 4, 4)]
    r = simulate(trace, "paged", num_slots=8, max_model_len=16, block_size=4)
    assert_accounted(r)
    assert r.num_preemptions == 1
    assert list(r.num_running[:3]) == [2, 1, 1]
    assert r.wait_steps == {0: 0, 1: 5}  # re-queued at steps 1..5, until r0 finishes
    assert r.tokens[6] == 4 and r.num_steps == 11  # recomputes its 4-token prompt at step 6


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_random_traces_account_every_slot(allocator):
    trace = generate_trace(
        120, arrival_rate=0.5, prompt_mean=40, prompt_sigma=1.0, output_mean=60,
        output_sigma=1.0, max_model_len=256, seed=5,
    )
    for block_size in (1, 7, 16):
        r = simulate(trace, allocator, num_slots=1000, max_model_len=256, block_size=block_size)
        assert_accounted(r)
        assert r.num_completed == len(trace)
        if allocator != "paged":
            break


def test_max_steps_truncates(shipped):
    r = simulate(shipped, "oracle", num_slots=NUM_SLOTS, max_steps=100)
    assert r.num_steps == 100 and r.num_completed < len(shipped)


def test_empty_trace():
    r = simulate([], "paged", num_slots=64)
    assert r.num_steps == 0 and r.token_share == 0.0 and r.num_completed == 0


# --- the shipped trace: Figure 2 of the paper ------------------------------------------------


def test_shipped_trace_every_slot_accounted_and_served(results, shipped):
    for r in results.values():
        assert_accounted(r)
        assert r.num_completed == len(shipped)


def test_paged_block_size_1_has_no_fragmentation(results):
    r = results["paged1"]
    assert (r.internal == 0).all() and (r.reserved == 0).all() and (r.external == 0).all()
    assert r.token_share == 1.0


def test_paged_block_size_16_holds_tokens_in_96_percent_of_used_memory(results):
    assert results["paged16"].token_share >= 0.96


def test_token_share_ranks_max_pow2_oracle_paged(results):
    shares = [results[k].token_share for k in ("max", "pow2", "oracle", "paged16")]
    assert shares == sorted(shares) and len(set(shares)) == 4


def test_contiguous_policies_are_under_memory_pressure(results):
    for k in ("max", "pow2", "oracle"):
        r = results[k]
        assert (r.num_waiting > 0).mean() > 0.8
        assert r.used_shares()["external"] > 0.05
    assert results["max"].used_shares()["internal"] > 0.5  # most of a 2048-slot range is unused
    assert results["oracle"].used_shares()["internal"] == 0.0


def test_paging_serves_the_trace_faster(results):
    assert results["paged16"].num_steps < results["oracle"].num_steps < results["max"].num_steps
    assert results["paged16"].mean_wait_steps < results["oracle"].mean_wait_steps


# --- the buddy allocator the paper's Orca baselines assume -------------------------------------


def test_a_buddy_arena_rounds_oracle_up_to_pow2_and_fragments_more_than_first_fit(shipped):
    buddy = {p: simulate(shipped, p, num_slots=NUM_SLOTS, arena="buddy") for p in ("oracle", "pow2")}
    for r in buddy.values():
        assert_accounted(r)
    assert buddy["oracle"].used_shares() == buddy["pow2"].used_shares(), \
        "a buddy block is the power of two at or above the final length: Oracle holds exactly Pow2's range"
    assert buddy["oracle"].used_shares()["internal"] > 0.15, "the rounding is held and never filled"
    first_fit = simulate(shipped, "oracle", num_slots=NUM_SLOTS)
    assert buddy["oracle"].num_steps > first_fit.num_steps, "rounding and alignment fit fewer Oracle requests"


def test_buddy_alignment_strands_free_slots_first_fit_would_use():
    # 64 slots. Four requests of 16 (no rounding); the 2nd and 3rd finish first, leaving [16, 48) free: one hole
    # for first fit, two 16-slot blocks that are not buddies for the buddy allocator, so a 32-slot request waits.
    trace = [req(0, 0, 14, 2), req(1, 0, 15, 1), req(2, 0, 15, 1), req(3, 0, 12, 4), req(4, 1, 31, 1)]
    waits = {a: simulate(trace, "oracle", num_slots=64, max_model_len=64, arena=a).mean_wait_steps
             for a in ("first-fit", "buddy")}
    assert waits["buddy"] > waits["first-fit"], waits


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(allocator="buddy", num_slots=100),
        dict(allocator="oracle", num_slots=100, arena="best-fit"),
        dict(allocator="oracle", num_slots=0),
        dict(allocator="paged", num_slots=100, block_size=0),
        dict(allocator="paged", num_slots=100, block_size=200),
        dict(allocator="oracle", num_slots=100, max_model_len=0),
        dict(allocator="oracle", num_slots=100, max_steps=-1),
    ],
)
def test_bad_simulator_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        simulate([req(0, 0, 5, 5)], **kwargs)


@pytest.mark.parametrize(
    "trace, allocator, num_slots",
    [
        ([req(0, 0, 2000, 49)], "oracle", 10_000),  # longer than max_model_len
        ([req(0, 0, 10, 10)], "max", 1000),  # a 2048-slot reservation never fits
        ([req(0, 0, 10, 10)], "paged", 16),  # needs 2 blocks of 16, the pool has 1
        ([req(0, 0, 5, 5), req(0, 1, 5, 5)], "oracle", 100),  # duplicate request_id
    ],
)
def test_requests_that_can_never_run_raise(trace, allocator, num_slots):
    with pytest.raises(ValueError):
        simulate(trace, allocator, num_slots=num_slots, max_model_len=2048, block_size=16)


def test_category_lookup_rejects_unknown_names(results):
    with pytest.raises(ValueError):
        results["max"].category("wasted")
    assert results["paged16"].label == "paged(bs=16)" and results["max"].label == "max"
