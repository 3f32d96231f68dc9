"""kvlab serve takes the requests real clients send: the openai client's typed content parts, vllm bench serve's exact
payloads, vLLM's extra sampling fields and stream options; what is really malformed is still a 400 in vLLM's shape."""

import json
import logging

import httpx
import pytest
from openai import BadRequestError, OpenAI
from serving_helpers import serve_embedded, wait_idle

from kvlab import LLM, SamplingParams, load_model

served = pytest.fixture(scope="module")(serve_embedded)
MODEL = "kvlab-embedded"
PROMPT = "HAMLET.\nTo be, or not"


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline():
    """Greedy texts from LLM.generate, the reference every server answer below is held to."""
    model, tokenizer = load_model()
    llm = LLM(model, tokenizer, block_size=16, num_blocks=64)

    def greedy(prompt: str, max_tokens: int) -> str:
        return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0].text
    return greedy


def sse(response) -> list[dict]:
    """The JSON events of a server-sent stream, split the way vllm bench serve's client splits them (blank lines)."""
    body = response.read().decode() if hasattr(response, "read") else response.text
    events = [m.strip() for m in body.split("\n\n") if m.strip()]
    assert events[-1] == "data: [DONE]", f"a stream ends with data: [DONE], got {events[-1]!r}"
    assert all(m.startswith("data: ") for m in events), "every event is a data: line"
    return [json.loads(m[6:]) for m in events[:-1]]


# ----- the openai client, typed content parts -----

def test_chat_with_typed_text_parts_is_the_chat_with_a_string(client, offline):
    parts = [{"type": "text", "text": "Speak,"}, {"type": "text", "text": "speak."}]
    typed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                           max_completion_tokens=16, temperature=0)
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Speak,\nspeak."}],
                                           max_completion_tokens=16, temperature=0)
    assert typed.choices[0].message.content == plain.choices[0].message.content, (
        "text parts are the message's text joined by newlines, as vLLM joins them")
    assert typed.choices[0].message.content == offline("USER.\nSpeak,\nspeak.\n\nASSISTANT.\n", 16), (
        "the chat prompt is the embedded template around the joined parts, and greedy text equals LLM.generate's")
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                            max_completion_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == typed.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 16 and not chunks[-1].choices


def test_system_and_developer_parts_and_an_assistant_turn(client):
    messages = [{"role": "developer", "content": [{"type": "text", "text": "A court."}]},
                {"role": "user", "content": [{"type": "text", "text": "Speak."}]},
                {"role": "assistant", "content": [{"type": "text", "text": "I will."}]},
                {"role": "user", "content": "Now."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert out.choices[0].finish_reason == "length" and len(out.choices[0].message.content) == 6
    assert out.usage.prompt_tokens == len("DEVELOPER.\nA court.\n\nUSER.\nSpeak.\n\nASSISTANT.\nI will.\n\n"
                                          "USER.\nNow.\n\nASSISTANT.\n"), "every turn reaches the prompt"


def test_completions_with_vllms_extra_fields_through_the_client(client, offline):
    extra = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "ignore_eos": True, "min_tokens": 12,
             "skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": False}
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, user="learner",
                                    seed=3, extra_body=extra)
    assert out.choices[0].text == offline(PROMPT, 12) and out.usage.completion_tokens == 12
    events = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=extra))
    assert "".join(e.choices[0].text for e in events if e.choices) == offline(PROMPT, 12)
    assert events[-1].usage.completion_tokens == 12


def test_a_media_part_is_a_clear_400(client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=4,
                                       messages=[{"role": "user", "content": [{"type": "text", "text": "Look"},
                                                                              image]}])
    error = err.value.body
    assert "text-only" in error["message"] and error["param"] == "messages.0.content.1", error
    assert err.value.status_code == 400 and error["code"] == 400 and error["type"] == "BadRequestError"


# ----- raw payloads in the exact shapes vllm bench serve and vLLM's documentation send -----

def test_vllm_bench_serve_completions_payload(served):
    """async_request_openai_completions' body, as it is: repetition_penalty 1.0, logprobs null, stream_options."""
    body = {"model": MODEL, "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": 20, "logprobs": None,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", served[0] + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        events = sse(response)
    with_choices = [e for e in events if e.get("choices")]
    assert len(with_choices) >= 2, "the client times TTFT at the first chunk with choices and ITL between them"
    assert events[-1]["usage"]["completion_tokens"] == 20 and events[-1]["usage"]["prompt_tokens"] == len(PROMPT)


def test_vllm_bench_serve_chat_payload(served):
    """async_request_openai_chat_completions' body: content as a list of text parts, max_completion_tokens, and no
    temperature (so the server's default, 1.0, samples)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Speak."}]}],
            "max_completion_tokens": 20, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    with httpx.stream("POST", served[0] + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        events = sse(response)
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert deltas[0]["role"] == "assistant" and len("".join(d.get("content") or "" for d in deltas)) == 20, (
        "the embedded model's 20 tokens are 20 characters")
    assert events[-1]["usage"] == {"prompt_tokens": len("USER.\nSpeak.\n\nASSISTANT.\n"), "completion_tokens": 20,
                                   "total_tokens": len("USER.\nSpeak.\n\nASSISTANT.\n") + 20}
    assert events[-1]["choices"] == []


def test_continuous_usage_stats_put_usage_on_every_chunk(served):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse(httpx.post(served[0] + "/v1/completions", json=body, timeout=60))
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert all("usage" in e for e in events), "vLLM's continuous_usage_stats: usage on every chunk"
    assert counts == sorted(counts) and counts[-1] == 10 and counts[0] >= 1, counts
    assert {e["usage"]["prompt_tokens"] for e in events} == {len(PROMPT)}
    plain = sse(httpx.post(served[0] + "/v1/completions", timeout=60,
                           json=dict(body, stream_options={"include_usage": True})))
    assert all("usage" not in e for e in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 10


def test_vllm_docs_sampling_extras_are_accepted(served, offline):
    """The extra_body fields vLLM's documentation shows (top_k, min_p, repetition_penalty, stop_token_ids ...)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "top_k": 50, "min_p": 0.0,
            "repetition_penalty": 1.0, "length_penalty": 1.0, "truncate_prompt_tokens": None, "priority": 0,
            "add_special_tokens": True, "return_tokens_as_token_ids": False, "request_id": "docs-1",
            "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": {}, "best_of": 1, "echo": False}
    response = httpx.post(served[0] + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == offline(PROMPT, 12), "greedy with top_k 50 is still greedy"


def test_fields_kvlab_does_not_apply_are_logged(served, caplog):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "repetition_penalty": 1.3, "my_field": True}
    with caplog.at_level(logging.WARNING, logger="kvlab.entrypoints.openai"):
        assert httpx.post(served[0] + "/v1/completions", json=body, timeout=60).status_code == 200
        assert httpx.post(served[0] + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                                "repetition_penalty": 1.0}).status_code == 200
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvlab.entrypoints.openai"]
    assert len(warnings) == 1, f"one warning, for the request that set something kvlab ignores: {warnings}"
    assert "repetition_penalty=1.3" in warnings[0] and "my_field" in warnings[0]


def test_honoured_extras_stop_token_ids_include_stop_str_and_echo(served, offline):
    base, async_llm = served
    full = offline(PROMPT, 24)
    tokenizer = async_llm.engine.tokenizer
    stop_char = full[5]
    stop_ids = tokenizer(stop_char, add_special_tokens=False)["input_ids"]
    assert len(stop_ids) == 1, "the embedded tokenizer has one token per character"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    out = httpx.post(base + "/v1/completions", json=dict(body, stop_token_ids=stop_ids), timeout=60).json()
    assert out["choices"][0]["finish_reason"] == "stop", out
    assert out["choices"][0]["text"] == full[:full.index(stop_char) + 1], (
        "stop_token_ids end the completion at the first stop token, which stays in the text (vLLM's rule)")
    stop = full[6:9]
    kept = httpx.post(base + "/v1/completions", timeout=60,
                      json=dict(body, stop=[stop], include_stop_str_in_output=True)).json()["choices"][0]
    assert kept["text"] == full[:full.index(stop)] + stop and kept["finish_reason"] == "stop"
    streamed = sse(httpx.post(base + "/v1/completions", timeout=60,
                              json=dict(body, stop=[stop], include_stop_str_in_output=True, stream=True)))
    assert "".join(e["choices"][0]["text"] for e in streamed) == kept["text"]
    echoed = httpx.post(base + "/v1/completions", json=dict(body, echo=True), timeout=60).json()["choices"][0]
    assert echoed["text"] == PROMPT + full, "echo puts the prompt before the completion"
    wait_idle(async_llm)


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/v1/completions", {"prompt": "a", "logprobs": 1}, 400, "logprobs", "log-probabilities"),
    ("/v1/completions", {"prompt": "a", "suffix": "x"}, 400, "suffix", "suffix"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n", "greater than or equal to 1"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "only be given when stream is true"),
    ("/v1/completions", {"prompt": "a", "stream": True, "stream_options": {"include_usage": 3}}, 400,
     "stream_options.include_usage", "boolean"),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": -1}, 400, "repetition_penalty", "greater than 0"),
    ("/v1/completions", {"prompt": {"text": "a"}}, 400, "prompt", "prompt must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400, "messages.0.content", "string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]}, 400,
     "messages.0.content.0", "needs a 'text' string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "input_audio",
                                                                          "input_audio": {}}]}]}, 400,
     "messages.0.content.0", "text-only"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True}, 400, "logprobs",
     "log-probabilities"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice",
     "tool calls"),
])
def test_malformed_or_unanswerable_requests_get_vllms_error_body(served, path, body, status, param, words):
    response = httpx.post(served[0] + path, json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param and words in error["message"] and error["code"] == status, error


def test_several_served_model_names():
    from kvlab.engine.llm_engine import LLMEngine
    from kvlab.entrypoints.background import BackgroundServer

    model, tokenizer = load_model()
    engine = LLMEngine(model, tokenizer, block_size=16, num_blocks=16, max_num_seqs=2)
    with BackgroundServer(engine, model_name=["shakespeare", "kvlab-embedded"]) as named:
        ids = [m["id"] for m in httpx.get(named.base_url + "/v1/models", timeout=30).json()["data"]]
        assert ids == ["shakespeare", "kvlab-embedded"], "every --served-model-name is listed"
        for name in ids:
            out = httpx.post(named.base_url + "/v1/completions", timeout=60,
                             json={"model": name, "prompt": "ROMEO.\n", "max_tokens": 2}).json()
            assert out["model"] == "shakespeare", "any listed name is accepted; answers carry the first, as vLLM's"
        missing = httpx.post(named.base_url + "/v1/completions", timeout=60, json={"model": "x", "prompt": "a"})
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
        assert named.model_name == "shakespeare"
    assert not named.running, "the server thread ends when the with block does"
