"""The server's parts without a server: request schemas, the chat template, the Prometheus export, error bodies."""

import json

import pytest
from pydantic import ValidationError

from kvlab.engine.input_processor import RequestRejected
from kvlab.engine.metrics import Counter, Gauge, Histogram, HistogramRecorder, Vector
from kvlab.entrypoints.openai.chat_template import render_chat
from kvlab.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvlab.entrypoints.openai.serving_engine import OpenAIError
from kvlab.entrypoints.prometheus import exposition

# ----- request schemas -----


def test_completion_defaults_are_vllms():
    body = CompletionRequest(prompt="hi")
    assert (body.max_tokens, body.n, body.stream) == (16, 1, False), "OpenAI's defaults for completions"
    assert (body.temperature, body.top_p, body.top_k) == (None, None, None), (
        "left unset, as vLLM leaves them, so the server applies its defaults (temperature 1, top_p 1, top_k off)")
    assert body.stop == [] and body.ignore_eos is False and body.unsupported() == [] and body.ignored() == []


# What vllm bench serve's completions client sends (vllm/benchmarks/lib/endpoint_request_func.py).
VLLM_BENCH_COMPLETION = {"model": "m", "prompt": "a", "repetition_penalty": 1.0, "max_tokens": 8, "logprobs": None,
                         "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


def test_vllm_bench_payloads_are_accepted_as_they_are():
    body = CompletionRequest(**VLLM_BENCH_COMPLETION)
    assert body.unsupported() == [] and body.ignored() == [], "repetition_penalty 1.0 asks for nothing: no warning"
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                                 max_completion_tokens=8, stream=True, stream_options={"include_usage": True},
                                 ignore_eos=True)
    assert chat.messages[0].text == "a" and chat.unsupported() == [] and chat.ignored() == []
    assert CompletionRequest(prompt="a", stream=True, stream_options={}).stream_options.include_usage is True, (
        "vLLM's StreamOptions includes usage by default once stream_options is sent")


def test_fields_kvlab_does_not_apply_are_named_for_the_warning():
    body = CompletionRequest(prompt="a", repetition_penalty=1.2, min_p=0.05, presence_penalty=0.0,
                             logit_bias={}, my_own_field=1, stream=True, stream_options={"include_usage": True,
                                                                                        "future_option": 2})
    assert body.ignored() == ["repetition_penalty=1.2", "min_p=0.05", "my_own_field", "stream_options.future_option"], (
        "neutral values (presence_penalty 0, an empty logit_bias) change nothing and are not worth a warning")
    assert CompletionRequest(prompt="a", min_tokens=4).ignored() == [], "min_tokens is honoured, not ignored"


@pytest.mark.parametrize("fields, where", [
    (dict(prompt="a", logprobs=1), "logprobs"),
    (dict(prompt="a", logprobs=0), "logprobs"),
    (dict(prompt="a", n=1, best_of=2), "best_of"),
    (dict(prompt="a", suffix="end"), "suffix"),
    (dict(prompt="a", use_beam_search=True), "use_beam_search"),
    (dict(prompt="a", response_format={"type": "json_object"}), "response_format"),
])
def test_answers_kvlab_cannot_give_are_named(fields, where):
    assert [f for f, _ in CompletionRequest(**fields).unsupported()] == [where]


def test_chat_answers_kvlab_cannot_give_are_named():
    msgs = [{"role": "user", "content": "hi"}]
    assert [f for f, _ in ChatCompletionRequest(messages=msgs, logprobs=True).unsupported()] == ["logprobs"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert [f for f, _ in ChatCompletionRequest(messages=msgs, tools=tools).unsupported()] == ["tool_choice"], (
        "tools without tool_choice mean 'auto', which needs a tool-call parser")
    assert ChatCompletionRequest(messages=msgs, tools=tools, tool_choice="none").unsupported() == []
    assert CompletionRequest(prompt="a", n=2, best_of=2).unsupported() == [], "best_of equal to n asks for nothing"


@pytest.mark.parametrize("fields, where", [
    (dict(prompt="a", max_tokens=0), "max_tokens"),
    (dict(prompt="a", max_tokens=-3), "max_tokens"),
    (dict(prompt="a", temperature=-0.5), "temperature"),
    (dict(prompt="a", temperature="warm"), "temperature"),
    (dict(prompt="a", top_p=0), "top_p"),
    (dict(prompt="a", top_k=-2), "top_k"),
    (dict(prompt="a", n=0), "n"),
    (dict(prompt="a", stop=[""]), "stop"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=5), "prompt"),
    (dict(prompt=[1, "a"]), "prompt"),
    (dict(prompt="a", logprobs=-1), "logprobs"),
    (dict(prompt="a", repetition_penalty=0), "repetition_penalty"),
    (dict(prompt="a", min_p=1.5), "min_p"),
    (dict(prompt="a", presence_penalty=3), "presence_penalty"),
    (dict(prompt="a", min_tokens=-1), "min_tokens"),
    (dict(prompt="a", max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(prompt="a", stream_options={"include_usage": True}), "stream_options"),
    (dict(prompt="a", stream=True, stream_options={"include_usage": "yes please"}), "include_usage"),
])
def test_malformed_completion_fields_are_refused(fields, where):
    with pytest.raises(ValidationError) as err:
        CompletionRequest(**fields)
    assert where in str(err.value)


def test_prompt_forms_and_stop_normalisation():
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompt == [[1, 2], [3]]
    assert CompletionRequest(prompt=["a", "b"]).prompt == ["a", "b"]
    assert CompletionRequest(prompt="a", stop="x").stop == ["x"], "one stop string becomes a list of one"
    assert CompletionRequest(prompt="a", stop=["a", "b", "c", "d", "e"]).stop == ["a", "b", "c", "d", "e"], (
        "vLLM takes any number of stop strings (OpenAI's limit of 4 is not vLLM's)")


def test_chat_requests():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5)
    assert body.max_completion_tokens == 5 and body.max_tokens is None
    for messages, where in [([], "messages"), ([{"role": "king", "content": "x"}], "role"),
                            ([{"role": "user"}], "needs content"), ([{"role": "user", "content": 5}], "content"),
                            ([{"role": "user", "content": []}], "empty list"),
                            ([{"role": "user", "content": [{"type": "text"}]}], "needs a 'text' string"),
                            ([{"role": "user", "content": ["hi"]}], "must be an object with a 'type'"),
                            ([{"role": "user", "content": [{"type": "sound", "text": "x"}]}], "unknown content part"),
                            ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                             "text-only")]:
        with pytest.raises(ValidationError, match=where):
            ChatCompletionRequest(messages=messages)


def test_content_parts_become_one_text_per_message():
    body = ChatCompletionRequest(messages=[
        {"role": "developer", "content": [{"type": "text", "text": "A court."}]},
        {"role": "user", "content": [{"type": "text", "text": "Speak."}, {"type": "input_text", "text": "Now."}]},
        {"role": "assistant", "content": None, "tool_calls": []}])
    assert [m.text for m in body.messages] == ["A court.", "Speak.\nNow.", ""], (
        "text parts are joined with newlines, as vLLM joins them for a text-only model; an assistant may have none")


# ----- the chat template -----

def test_the_embedded_template_writes_a_play():
    prompt = render_chat([{"role": "system", "content": "A court."}, {"role": "user", "content": "Speak."}], None)
    assert prompt == "SYSTEM.\nA court.\n\nUSER.\nSpeak.\n\nASSISTANT.\n", "each message a speech; the assistant next"


def test_a_tokenizer_with_a_chat_template_uses_its_own():
    class Hub:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and tokenize
            return [len(m["content"]) for m in messages]

    assert render_chat([{"role": "user", "content": "four", "name": "x"}], Hub()) == [4], (
        "a hub model's template gets role and content only, and returns token ids")


# ----- the Prometheus export -----

def test_histogram_buckets_are_cumulative_in_the_export():
    recorder = HistogramRecorder("vllm:time_to_first_token_seconds", (0.1, 0.5, 1.0))
    for seconds in (0.05, 0.05, 0.3, 0.7, 2.0):
        recorder.observe(seconds)
    assert recorder.counts == [2, 1, 1, 1], "the recorder keeps a count per bucket"
    text = exposition([recorder.metric()], "m").decode()
    buckets = {line.split('le="')[1].split('"')[0]: float(line.split()[-1])
               for line in text.splitlines() if line.startswith("vllm:time_to_first_token_seconds_bucket")}
    assert buckets == {"0.1": 2.0, "0.5": 3.0, "1.0": 4.0, "+Inf": 5.0}, (
        f"Prometheus buckets count every observation at or below their bound: cumulative, got {buckets}")
    assert 'vllm:time_to_first_token_seconds_count{model_name="m"} 5.0' in text
    assert 'vllm:time_to_first_token_seconds_sum{model_name="m"} 3.1' in text


def test_counters_gauges_and_vectors_in_the_export():
    text = exposition([Counter("vllm:prompt_tokens", 7), Gauge("vllm:num_requests_waiting", 2),
                       Vector("vllm:spec_decode_num_accepted_tokens_per_pos", [3, 1]),
                       Histogram("vllm:e2e_request_latency_seconds", 0, buckets=(1.0,), counts=(0, 0))], "m").decode()
    assert 'vllm:prompt_tokens_total{model_name="m"} 7.0' in text, "counters get Prometheus' _total suffix"
    assert 'vllm:num_requests_waiting{model_name="m"} 2.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0' in text
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in text


# ----- error bodies -----

def test_an_engine_refusal_becomes_a_400_naming_its_field():
    err = OpenAIError.rejected(RequestRejected("the prompt of 300 tokens leaves no room", "prompt"))
    body = json.loads(err.response().body)
    assert err.status == 400 and body == {"error": {"message": "the prompt of 300 tokens leaves no room",
                                                    "type": "BadRequestError", "param": "prompt",
                                                    "code": 400}}, "vLLM's error body: code is the HTTP status"
    assert OpenAIError(404, "no such model").body()["error"]["type"] == "NotFoundError"
