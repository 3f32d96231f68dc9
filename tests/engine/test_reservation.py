"""The paper's Orca baselines on kvlab's engine: blocks reserved at admission, outputs unchanged, fewer requests fit."""

import pytest

from kvlab import LLM, SamplingParams
from kvlab.engine.llm_engine import LLMEngine

PROMPTS = ["OTHELLO.\n", "HAMLET.\nTo be, or not", "ROMEO.\n", "JULIET.\nO Romeo"] * 2
LENS = [40, 25, 60, 10] * 2


def run(embedded, policy, num_blocks=48):
    model, tokenizer = embedded
    llm = LLM(model, tokenizer, block_size=16, num_blocks=num_blocks, reservation_policy=policy)
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in LENS])
    engine = llm.llm_engine
    peak = max(sum(s == "running" for s in h.status.values()) for h in engine.history)
    return [o.outputs[0].token_ids for o in outs], engine, peak


def test_reservations_change_who_runs_not_what_they_say(embedded):
    paged, engine, paged_peak = run(embedded, None)
    for policy, most in [("oracle", 8), ("pow2", 8), ("max", 3)]:
        outs, engine, peak = run(embedded, policy)
        assert outs == paged, f"{policy} reservation changed the tokens"
        assert engine.scheduler.num_preemptions == 0, "a reserved request never runs out of blocks"
        assert peak <= most, f"{policy}: {peak} requests ran at once in 48 blocks"
        assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    assert run(embedded, "max")[2] < paged_peak, "reserving the whole context must fit fewer requests than paging"


def test_a_reservation_that_can_never_fit_is_refused(embedded):
    model, tokenizer = embedded
    engine = LLMEngine(model, tokenizer, block_size=16, num_blocks=8, reservation_policy="max")
    with pytest.raises(ValueError, match="can never fit"):
        engine.add_request("r", "ROMEO.\n", SamplingParams(max_tokens=4))  # 4 tokens, but Max reserves 256
    with pytest.raises(ValueError, match="reservation_policy"):
        LLMEngine(model, tokenizer, reservation_policy="orca")


def test_on_the_papers_buddy_arena_the_same_tokens_come_out_and_fewer_requests_run(embedded):
    model, tokenizer = embedded
    paged, _, _ = run(embedded, None)
    llm = LLM(model, tokenizer, block_size=16, num_blocks=24, reservation_policy="oracle", reservation_arena="buddy")
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in LENS])
    engine = llm.llm_engine
    peak = max(sum(s == "running" for s in h.status.values()) for h in engine.history)
    assert [o.outputs[0].token_ids for o in outs] == paged, "where a reservation lives changes no token"
    assert peak < run(embedded, "oracle", num_blocks=24)[2], \
        "rounded, aligned ranges fit fewer requests than the pool's blocks"
    assert engine.kv_cache_manager.arena.num_free_slots == 24, "every range back in the arena at the end"
    small = LLMEngine(model, tokenizer, block_size=16, num_blocks=12, reservation_policy="oracle",
                      reservation_arena="buddy")
    with pytest.raises(ValueError, match="can never fit: .* but the buddy arena's largest range is 8 blocks"):
        small.add_request("r", "ROMEO.\n", SamplingParams(max_tokens=150))  # 10 blocks; the arena is 8 + 4
    with pytest.raises(ValueError, match="give reservation_policy too"):
        LLMEngine(model, tokenizer, reservation_arena="buddy")
