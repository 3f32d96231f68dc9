"""Chapter 6's static-batching baseline: same outputs as generate, but batches wait for their longest member."""

import pytest

from kvlab import SamplingParams
from kvlab.baselines.static_batching import StaticBatchingEngine
from kvlab.baselines.transformers_generate import reference_generate
from kvlab.engine.llm import LLM

PROMPTS = ["OTHELLO.\n", "HAMLET.\nTo be", "KING LEAR.\nNothing will come", "ROMEO.\n", "JULIET.\nO Romeo",
           "MACBETH.\n"]
MAX_TOKENS = [10, 60, 25, 40, 5, 33]


def test_outputs_equal_generate_and_waste_is_counted(embedded):
    model, tokenizer = embedded
    engine = StaticBatchingEngine(model, tokenizer, batch_size=4, block_size=16)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outs = engine.generate(PROMPTS, params)
    for p, n, out in zip(PROMPTS, MAX_TOKENS, outs):
        assert out.outputs[0].token_ids == reference_generate(model, tokenizer(p)["input_ids"], n)
        assert out.finished and out.outputs[0].finish_reason == "length" and out.prompt == p
    # Batch 1 (10, 60, 25, 40 new tokens) runs 60 passes and batch 2 (5, 33) 33: finished members keep computing.
    assert engine.num_forward_passes == 60 + 33
    assert engine.num_tokens_wasted == (60 - 10) + (60 - 25) + (60 - 40) + (33 - 5)
    prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in PROMPTS)
    assert engine.num_tokens_computed == prompt_tokens + sum(MAX_TOKENS) - len(PROMPTS) + engine.num_tokens_wasted


def test_continuous_batching_runs_fewer_passes(embedded):
    model, tokenizer = embedded
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    static = StaticBatchingEngine(model, tokenizer, batch_size=4)
    static.generate(PROMPTS, params)
    llm = LLM(model, tokenizer, max_num_seqs=4, num_blocks=64)
    llm.generate(PROMPTS, params)
    assert llm.llm_engine.model_runner.num_forward_passes < static.num_forward_passes, (
        "a finished request's place is refilled at once, so the same work takes fewer steps")


def test_bad_input(embedded):
    model, tokenizer = embedded
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        StaticBatchingEngine(model, tokenizer, batch_size=0)
    engine = StaticBatchingEngine(model, tokenizer, batch_size=2)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate(["OTHELLO.\n", ""], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="maximum context length is 256"):
        engine.generate(["OTHELLO.\n"], SamplingParams(max_tokens=400))
    with pytest.raises(ValueError, match="n = 1 only"):
        engine.generate(["OTHELLO.\n"], SamplingParams(n=2, max_tokens=4))
