"""The server's streams as vLLM's: DELTA outputs from the engine (no re-slicing of the whole text), min_tokens
honoured, the stop string added back when asked, and each choice's finish reported exactly once."""

import json

import httpx
import pytest
from serving_helpers import serve_embedded

from kvlab import LLM, SamplingParams, load_model
from kvlab.engine.sampling_params import RequestOutputKind

served = pytest.fixture(scope="module")(serve_embedded)
PROMPT = "OTHELLO.\n"


@pytest.fixture(scope="module")
def offline():
    model, tokenizer = load_model()
    llm = LLM(model, tokenizer, block_size=16, num_blocks=64)

    def generate(**params):
        return llm.generate(PROMPT, SamplingParams(temperature=0, **params))[0].outputs

    return generate


def sse(base, body) -> list[dict]:
    with httpx.stream("POST", base + "/v1/completions", json={"prompt": PROMPT, "temperature": 0, "stream": True,
                                                              **body}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_the_server_asks_the_engine_for_deltas_when_streaming_and_one_output_otherwise(served):
    from kvlab.entrypoints.openai.protocol import CompletionRequest
    from kvlab.entrypoints.openai.serving_engine import OpenAIServing

    serving = OpenAIServing(served[1], "kvlab-embedded")
    for stream, kind in ((True, RequestOutputKind.DELTA), (False, RequestOutputKind.FINAL_ONLY)):
        _, params = serving.prepare(CompletionRequest(prompt=PROMPT, stream=stream), [PROMPT], 8)
        assert params[0].output_kind is kind, f"stream={stream}: vLLM's server asks for {kind.name} too"


def test_min_tokens_outlasts_an_early_stop_string_over_http(served, offline):
    full = offline(max_tokens=40)[0].text
    stop = full[2]  # a character the greedy text has near its start
    early = offline(max_tokens=40, stop=[stop])[0]
    held = offline(max_tokens=40, stop=[stop], min_tokens=20)[0]
    assert len(early.token_ids) < 5 and len(held.token_ids) > 20, "setup: min_tokens moves the stop past 20 tokens"
    plain = httpx.post(served[0] + "/v1/completions", timeout=60, json={
        "prompt": PROMPT, "temperature": 0, "max_tokens": 40, "stop": [stop], "min_tokens": 20}).json()
    assert plain["choices"][0]["text"] == held.text and plain["usage"]["completion_tokens"] == len(held.token_ids), (
        "the server honours min_tokens: no stop string is looked for in the first 20 tokens")
    events = sse(served[0], {"max_tokens": 40, "stop": [stop], "min_tokens": 20, "include_stop_str_in_output": True})
    streamed = "".join(e["choices"][0]["text"] for e in events)
    assert streamed == held.text + stop, "include_stop_str_in_output puts back the stop string that ended it"
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "stop"


def test_each_choice_of_n_finishes_exactly_once(served):
    events = sse(served[0], {"max_tokens": 30, "n": 3, "temperature": 1.0, "seed": 3, "stop": ["e"],
                             "stream_options": {"include_usage": True}})
    finishes = [(e["choices"][0]["index"], e["choices"][0]["finish_reason"]) for e in events
                if e["choices"] and e["choices"][0]["finish_reason"]]
    ends = [i for i, e in enumerate(events) if e["choices"] and e["choices"][0]["finish_reason"]]
    assert any(e["choices"] and e["choices"][0]["text"] for e in events[ends[0] + 1:]), (
        "setup: text still streams after the first choice finished (its siblings run on)")
    assert sorted(i for i, _ in finishes) == [0, 1, 2], (
        f"one finish chunk per choice, however long its siblings run on; got {finishes}")
    texts = ["".join(e["choices"][0]["text"] for e in events if e["choices"] and e["choices"][0]["index"] == i)
             for i in range(3)]
    assert all(texts), "every choice streams its own text"
