"""Input and output processing, the components every front end shares: checks before anything runs, text, stop
strings, n > 1 completions gathered, when outputs reach the caller, and end-of-sequence ids as a set."""

import pytest
import torch

from conftest import make_tiny_model
from kvlab import LLM, SamplingParams
from kvlab.baselines.transformers_generate import reference_generate
from kvlab.engine.input_processor import InputProcessor, RequestRejected
from kvlab.engine.llm_engine import LLMEngine
from kvlab.engine.output_processor import OutputProcessor, StopStrings
from kvlab.engine.outputs import EngineCoreOutput
from kvlab.engine.request import Request, RequestStatus
from kvlab.engine.sampling_params import RequestOutputKind


class CharTokenizer:
    """One character, one token (as the embedded model's tokenizer), enough for the processors."""

    def __call__(self, text, verbose=True):
        return {"input_ids": [ord(c) % 97 for c in text]}

    def decode(self, ids):
        return "".join(chr(97 + (i % 26)) for i in ids)


def processor(**kwargs):
    args = dict(tokenizer=CharTokenizer(), vocab_size=97, max_model_len=32, block_size=4, num_blocks=6)
    return InputProcessor(**(args | kwargs))


# ----- input -----

@pytest.mark.parametrize("prompt, params, message, param", [
    ("", None, "the request has an empty prompt", "prompt"),
    ([3, 200], None, "token id 200 outside the vocabulary of 97", "prompt"),
    ("x" * 32, None, "the prompt of 32 tokens leaves no room for a new token within max_model_len 32", "prompt"),
    ("abc", SamplingParams(max_tokens=30), "can never fit: prompt and max_tokens need up to 32 tokens = 8 blocks",
     "max_tokens"),
    ([1.5], None, "a prompt is a string or a list of token ids", "prompt"),
    ("abc", {"temperature": 0}, "params must be a SamplingParams", None),
])
def test_a_request_the_engine_cannot_serve_is_refused_with_the_field_at_fault(prompt, params, message, param):
    with pytest.raises(RequestRejected, match=message) as err:
        processor().process(prompt, params)
    assert err.value.param == param and isinstance(err.value, ValueError), "a RequestRejected is a ValueError too"


def test_a_request_id_is_named_in_the_message():
    with pytest.raises(RequestRejected, match="request 'r7' has an empty prompt"):
        processor().process([], None, "r7")


def test_what_fits_passes_and_text_or_ids_or_tensors_all_work():
    p = processor()
    assert p.process("abc")[:2] == ("abc", [97 % 97, 98 % 97, 99 % 97])
    assert p.process([5, 6])[:2] == (None, [5, 6])
    assert p.process(torch.tensor([5, 6]))[:2] == (None, [5, 6])
    assert p.process([5] * 8, SamplingParams(max_tokens=16))[1] == [5] * 8, "24 tokens = 6 blocks: the whole pool"


def test_the_servers_context_rule():
    p = processor()
    p.check_context(20, 12)
    with pytest.raises(RequestRejected, match="maximum context length is 32 tokens; you asked for 33") as err:
        p.check_context(20, 13)
    assert err.value.param == "max_tokens"


def test_a_reservation_baseline_must_fit_its_reservation():
    p = processor(reservation_policy="max")
    with pytest.raises(RequestRejected, match="can never fit"):
        p.process("ab", SamplingParams(max_tokens=2))  # Max reserves the whole context: 32 tokens = 8 blocks
    assert processor().reserved_len(2, 2) == 0 and processor(reservation_policy="oracle").reserved_len(2, 2) == 4


# ----- output -----

def out(rid, tokens, status=RequestStatus.RUNNING):
    return EngineCoreOutput(rid, tokens, status)


def test_stop_strings_cut_the_text_hold_back_a_possible_start_and_finish_the_request():
    stops = StopStrings(["cd"])
    assert stops.check("abc") == ("ab", False), "'c' might begin 'cd': held back"
    assert stops.check("abcde") == ("ab", True)
    o = OutputProcessor(CharTokenizer())
    o.add_request("r", "p", [1], SamplingParams(stop=["cd"]), ["r"])
    outputs, stopped = o.process_outputs([out("r", [0, 1, 2])])          # "abc"
    assert outputs[0].outputs[0].text == "ab" and not outputs[0].finished and stopped == []
    outputs, stopped = o.process_outputs([out("r", [3, 4])])             # "abcde"
    assert outputs[0].outputs[0].text == "ab" and outputs[0].outputs[0].finish_reason == "stop"
    assert outputs[0].finished and stopped == ["r"], "the engine must free a request its stop string ended"
    assert o.process_outputs([out("r", [5])]) == ([], []), "tokens after the stop are ignored"


def test_n_completions_are_gathered_in_order():
    o = OutputProcessor(CharTokenizer())
    o.add_request("r", None, [1], SamplingParams(n=2), ["0_r", "1_r"])
    outputs, _ = o.process_outputs([out("1_r", [1], RequestStatus.FINISHED_LENGTH), out("0_r", [0])])
    assert len(outputs) == 1 and [c.index for c in outputs[0].outputs] == [0, 1]
    assert [c.token_ids for c in outputs[0].outputs] == [[0], [1]] and not outputs[0].finished
    assert [c.finish_reason for c in outputs[0].outputs] == [None, "length"]


def test_final_only_outputs_arrive_once_and_are_decoded_once():
    decoded = []
    tokenizer = CharTokenizer()
    real = tokenizer.decode
    tokenizer.decode = lambda ids: decoded.append(list(ids)) or real(ids)
    o = OutputProcessor(tokenizer)
    o.add_request("r", None, [1], SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY), ["r"])
    assert o.process_outputs([out("r", [0])]) == ([], [])
    assert o.process_outputs([out("r", [1])]) == ([], [])
    outputs, _ = o.process_outputs([out("r", [2], RequestStatus.FINISHED_STOPPED)])
    assert outputs[0].outputs[0].text == "abc" and outputs[0].outputs[0].finish_reason == "stop"
    assert decoded == [[0, 1, 2]], "offline generation detokenises each completion once, at the end"


def test_latencies_and_counters():
    o = OutputProcessor(CharTokenizer())
    o.add_request("r", None, [1, 2, 3], SamplingParams(), ["r"], arrival_time=10.0)
    o.process_outputs([out("r", [0])], now=10.5)
    o.process_outputs([out("r", [1, 2])], now=10.75)
    o.process_outputs([out("r", [3], RequestStatus.FINISHED_LENGTH)], now=11.0)
    assert (o.latencies.ttft.count, o.latencies.ttft.sum) == (1, 0.5)
    assert (o.latencies.itl.count, o.latencies.itl.sum) == (2, 0.5), "one gap per step that gave tokens"
    assert (o.latencies.e2e.count, o.latencies.e2e.sum) == (1, 1.0)
    assert (o.num_prompt_tokens, o.num_generation_tokens, o.num_finished_requests) == (3, 4, 1)


# ----- end-of-sequence ids are a set -----

def test_a_request_stops_at_any_of_its_models_eos_ids():
    request = Request("r", [1, 2], SamplingParams(max_tokens=10), 0, eos_token_ids=[7, 9])
    request.append_output(5)
    request.append_output(9)
    assert request.status is RequestStatus.FINISHED_STOPPED, "9 is an end-of-sequence id as much as 7 is"
    ignoring = Request("s", [1], SamplingParams(max_tokens=10, ignore_eos=True), 0, eos_token_ids=[7, 9])
    ignoring.append_output(9)
    assert not ignoring.status.finished


def test_the_engine_and_beam_search_stop_at_either_of_two_eos_ids():
    """A model whose generation config lists two EOS ids (as Llama 3's does) stops at whichever comes first."""
    from kvlab import BeamSearchParams

    model = make_tiny_model("llama")
    prompt = [5, 9, 13, 2]
    free = reference_generate(model, prompt, 12)
    # `first` ends the free run at position 3; `second` is listed first but comes later (or never).
    first = free[3]
    second = next((t for t in free[4:] if t not in free[:4]), 96)
    assert first not in free[:3], "pick a prompt whose free run has no repeat before position 3"
    model.generation_config.eos_token_id = [second, first]
    llm = LLM(model, None, block_size=4, num_blocks=16)
    got = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert got.token_ids == free[:4] and got.finish_reason == "stop", (
        "the engine must stop at the first of the EOS ids, whichever position the list gives it")
    beams = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=12))[0].outputs
    for beam in beams:
        if beam.token_ids and beam.token_ids[-1] in (first, second):
            assert beam.finish_reason == "stop"
        assert not set(beam.token_ids[:-1]) & {first, second}, "a beam ends at its first EOS id"


def test_static_batching_takes_its_prompts_through_the_same_processors(embedded):
    from kvlab.baselines.static_batching import StaticBatchingEngine

    model, tokenizer = embedded
    engine = StaticBatchingEngine(model, tokenizer, batch_size=2)
    with pytest.raises(RequestRejected, match="maximum context length is 256"):
        engine.generate(["ROMEO.\n"], SamplingParams(max_tokens=300))
    outs = engine.generate(["ROMEO.\n"], SamplingParams(temperature=0, max_tokens=8, stop=["O"]))
    assert "O" not in outs[0].outputs[0].text and outs[0].outputs[0].text == tokenizer.decode(
        outs[0].outputs[0].token_ids).split("O")[0]


def test_llm_stop_strings_free_the_request(embedded):
    model, tokenizer = embedded
    llm = LLM(model, tokenizer, num_blocks=32)
    full = llm.generate("OTHELLO.\n", SamplingParams(temperature=0, max_tokens=30))[0].outputs[0].text
    stop = full[8:11]
    got = llm.generate("OTHELLO.\n", SamplingParams(temperature=0, max_tokens=30, stop=[stop]))[0].outputs[0]
    assert got.text == full[:full.index(stop)] and got.finish_reason == "stop"
    assert len(got.token_ids) < 30, "the request stops soon after its stop string, not at max_tokens"
    engine: LLMEngine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks and not engine.has_unfinished_requests()
