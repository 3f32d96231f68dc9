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
