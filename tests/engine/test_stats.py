"""What the engines report: a typed StepRecord per step, and the same counters for continuous and static batching."""

import dataclasses

import pytest

from kvlab import LLM, SamplingParams
from kvlab.baselines.static_batching import StaticBatchingEngine
from kvlab.engine.llm_engine import LLMEngine
from kvlab.engine.stats import EngineStats, StepRecord

PROMPTS = ["ROMEO.\n", "JULIET.\nO Romeo", "HAMLET.\nTo be"]


def _params(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_every_step_leaves_a_frozen_step_record_that_adds_up(embedded):
    model, tokenizer = embedded
    engine = LLMEngine(model, tokenizer, block_size=4, num_blocks=10, max_num_seqs=2, max_num_batched_tokens=8)
    for i, (prompt, n) in enumerate(zip(PROMPTS, (12, 5, 9))):
        engine.add_request(f"r{i}", prompt, _params(n))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.history and all(isinstance(r, StepRecord) for r in engine.history)
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.history[0].used_blocks = 0
    assert [r.step for r in engine.history] == list(range(1, engine.step_count + 1))
    for record in engine.history:
        assert record.batched_tokens == sum(record.tokens.values()) <= 8, "a step never exceeds the token budget"
        assert 0 <= record.used_blocks <= record.num_blocks == 10
        assert set(record.prefill) <= set(record.tokens), "a prefill is a request that computed tokens this step"
    stats = engine.stats()
    assert stats.num_tokens_computed == sum(r.batched_tokens for r in engine.history)
    assert stats.peak_used_blocks == max(r.used_blocks for r in engine.history)
    assert stats.num_preemptions == sum(len(r.preempted) for r in engine.history)
    assert stats.num_steps == engine.step_count and stats.num_tokens_wasted == 0


def test_static_and_continuous_engines_report_the_same_fields(embedded):
    model, tokenizer = embedded
    lengths = [20, 4, 12]
    static = StaticBatchingEngine(model, tokenizer, batch_size=3, block_size=8)
    static.generate(PROMPTS, [_params(n) for n in lengths])
    llm = LLM(model, tokenizer, block_size=8, num_blocks=32)
    llm.generate(PROMPTS, [_params(n) for n in lengths])
    a, b = static.stats(), llm.llm_engine.stats()
    assert isinstance(a, EngineStats) and isinstance(b, EngineStats)
    # The padded batch runs every member until the longest is done: 20 - 4 and 20 - 12 wasted decodes.
    assert a.num_tokens_wasted == (20 - 4) + (20 - 12)
    assert a.num_forward_passes == 20 and a.num_preemptions == 0
    assert b.num_tokens_wasted == 0, "continuous batching drops a finished request from the very next step"
    assert a.num_tokens_computed - a.num_tokens_wasted == b.num_tokens_computed, \
        "without preemption both compute every prompt token and every kept output token once"
