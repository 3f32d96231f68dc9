"""min_tokens as vLLM has it: before a request has that many new tokens its stop tokens cannot be drawn (the
logits are masked, at every position speculative decoding verifies too) and its stop strings are not looked for."""

import pytest
import torch

from conftest import make_tiny_model
from kvlab import LLM, SamplingParams
from kvlab.baselines.transformers_generate import reference_generate
from kvlab.engine.output_processor import OutputProcessor
from kvlab.engine.outputs import EngineCoreOutput
from kvlab.engine.request import Request, RequestStatus
from kvlab.engine.sampler import apply_min_tokens

NEG_INF = float("-inf")


@pytest.mark.parametrize("fields, message", [
    (dict(min_tokens=-1), "min_tokens must be an integer >= 0, got -1"),
    (dict(min_tokens=2.5), "min_tokens must be an integer >= 0, got 2.5"),
    (dict(min_tokens=True), "min_tokens must be an integer >= 0, got True"),
    (dict(max_tokens=4, min_tokens=5), r"min_tokens \(5\) must not exceed max_tokens \(4\)"),
])
def test_bad_min_tokens_are_refused_saying_what_is_wrong(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4, "min_tokens == max_tokens is allowed"


def test_the_mask_covers_eos_and_stop_token_ids_only_while_the_count_is_short():
    logits = torch.zeros(4, 6)
    params = [SamplingParams(min_tokens=2, stop_token_ids=[4]), SamplingParams(min_tokens=2, stop_token_ids=[4]),
              SamplingParams(min_tokens=2, ignore_eos=True), SamplingParams()]
    masked = apply_min_tokens(logits, [1, 2, 0, 0], params, eos_token_ids=[1, 5])
    assert masked[0].tolist() == [0, NEG_INF, 0, 0, NEG_INF, NEG_INF], "1 output of 2: EOS ids and stop ids masked"
    assert masked[1].tolist() == [0.0] * 6, "2 outputs of 2: nothing masked any more"
    assert masked[2].tolist() == [0.0] * 6, "ignore_eos: the EOS ids do not stop it, so they stay drawable"
    assert masked[3].tolist() == [0.0] * 6 and logits.eq(0).all(), "no min_tokens: untouched; the input is not changed"
    assert apply_min_tokens(logits, [0], [SamplingParams()], [1]) is logits, "nothing to mask: no copy is made"


def test_the_stop_check_waits_for_min_tokens():
    request = Request("r", [3], SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=[6]), 0, eos_token_ids=[7])
    for token in (7, 6):
        request.append_output(token)
        assert not request.status.finished, "a stop token that arrives before min_tokens does not end the request"
    request.append_output(7)
    assert request.status is RequestStatus.FINISHED_STOPPED, "from the min_tokens-th token on, EOS stops it"


@pytest.fixture(scope="module")
def early_eos():
    """A tiny model whose greedy continuation of the prompt hits its EOS id at the 3rd token."""
    model = make_tiny_model("llama")
    prompt = [5, 9, 13, 2]
    free = reference_generate(model, prompt, 12)
    assert free[2] not in free[:2]
    model.generation_config.eos_token_id = free[2]
    return model, prompt, free[2]


def test_greedy_output_that_ends_early_gets_at_least_min_tokens(early_eos):
    model, prompt, eos = early_eos
    llm = LLM(model, None, block_size=4, num_blocks=32)
    short = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert len(short.token_ids) == 3 and short.finish_reason == "stop", "without min_tokens it stops at its EOS"
    got = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=8))[0].outputs[0]
    assert len(got.token_ids) >= 8 and eos not in got.token_ids[:8], (
        f"min_tokens=8: at least 8 tokens and no EOS among them (the sampler cannot draw it); got {got.token_ids}")
    assert got.token_ids[:2] == short.token_ids[:2], "the mask changes nothing before the EOS would have come"


def test_every_completion_of_n_holds_min_tokens(early_eos):
    model, prompt, eos = early_eos
    llm = LLM(model, None, block_size=4, num_blocks=64)
    outs = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=12, min_tokens=6))[0].outputs
    assert len(outs) == 4
    for c in outs:
        assert len(c.token_ids) >= 6 and eos not in c.token_ids[:6], f"completion {c.index}: {c.token_ids}"


def test_speculative_decoding_cannot_slip_a_drafted_eos_in_before_min_tokens():
    """The n-gram proposer drafts the EOS id (the prompt pairs every token with it) where the target wants it too."""
    model = make_tiny_model("llama")
    eos = 92
    model.generation_config.eos_token_id = eos
    prompt = sum([[t, eos] for t in range(0, 96, 3) if t != eos][:28], []) + [11, 4, 20]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}

    def run(min_tokens, speculative):
        llm = LLM(model, None, block_size=4, num_blocks=64, **({"speculative_config": spec} if speculative else {}))
        drafted = []
        if speculative:
            drafter = llm.llm_engine.model_runner.drafter
            propose = drafter.propose

            def recording(token_ids, k):
                drafts = propose(token_ids, k)
                drafted.extend((len(token_ids) - len(prompt) + j, t) for j, t in enumerate(drafts))
                return drafts

            drafter.propose = recording
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, min_tokens=min_tokens))[0]
        return out.outputs[0].token_ids, drafted

    free, _ = run(0, True)
    assert free[-1] == eos and len(free) < 10, "setup: without min_tokens the target itself ends early at EOS"
    plain, _ = run(10, False)
    got, drafted = run(10, True)
    assert any(t == eos and position < 10 for position, t in drafted), "setup: EOS was drafted before min_tokens"
    assert eos not in got[:10] and len(got) >= 10, (
        f"every verified position before min_tokens masks EOS, so a drafted EOS is rejected there; got {got}")
    assert got == plain, "with the mask at every verified position, greedy speculation still equals greedy decoding"


class Letters:
    def decode(self, ids):
        return "".join(chr(97 + i) for i in ids)


def test_stop_strings_are_not_looked_for_in_the_first_min_tokens():
    o = OutputProcessor(Letters())
    o.add_request("r", None, [0], SamplingParams(stop=["b"], min_tokens=3), ["r"])
    outs, stopped = o.process_outputs([EngineCoreOutput("r", [1, 0], RequestStatus.RUNNING)])        # "ba"
    assert outs[0].outputs[0].text == "ba" and not stopped, "'b' among the first 3 tokens does not stop it"
    outs, stopped = o.process_outputs([EngineCoreOutput("r", [0, 1, 1], RequestStatus.RUNNING)])     # "baabb"
    assert outs[0].outputs[0].text == "baa" and stopped == ["r"], (
        "the 4th token is past min_tokens: its 'b' ends the text there (one step brought tokens on both sides)")
    assert outs[0].outputs[0].stop_reason == "b"


def test_a_stop_string_that_begins_inside_the_first_min_tokens_and_ends_after_them_counts():
    o = OutputProcessor(Letters())
    o.add_request("r", None, [0], SamplingParams(stop=["ab"], min_tokens=1), ["r"])
    o.process_outputs([EngineCoreOutput("r", [0], RequestStatus.RUNNING)])                           # "a"
    outs, stopped = o.process_outputs([EngineCoreOutput("r", [1], RequestStatus.RUNNING)])           # "ab"
    assert outs[0].outputs[0].text == "" and stopped == ["r"], "vLLM's rule: the stop string must end after them"


def test_static_batching_holds_min_tokens_too(early_eos):
    from kvlab.baselines.static_batching import StaticBatchingEngine

    model, prompt, eos = early_eos
    engine = StaticBatchingEngine(model, None, batch_size=2, block_size=4)
    short, held = engine.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=12),
                                                     SamplingParams(temperature=0, max_tokens=12, min_tokens=8)])
    assert len(short.outputs[0].token_ids) == 3, "the baseline stops at the EOS without min_tokens"
    got = held.outputs[0].token_ids
    assert len(got) >= 8 and eos not in got[:8], f"static batching masks the EOS before min_tokens too; got {got}"
