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


def test_completion_defaults_are_openais():
    body = CompletionRequest(prompt="hi")
    assert (body.max_tokens, body.temperature, body.top_p, body.n, body.stream) == (16, 1.0, 1.0, 1, False)
    assert body.stop is None and body.top_k == 0 and body.ignore_eos is False


@pytest.mark.parametrize("fields, where", [
    (dict(prompt="a", best_of=2), "best_of"),          # unknown fields are refused, not ignored
    (dict(prompt="a", max_tokens=0), "max_tokens"),
    (dict(prompt="a", temperature=2.5), "temperature"),
    (dict(prompt="a", top_p=0), "top_p"),
    (dict(prompt="a", top_k=-2), "top_k"),
    (dict(prompt="a", n=17), "n"),
    (dict(prompt="a", stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(prompt="a", stop=[""]), "stop"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt="a", echo=True), "echo"),
    (dict(prompt="a", logprobs=1), "logprobs"),
])
def test_bad_completion_fields_are_refused(fields, where):
    with pytest.raises(ValidationError) as err:
        CompletionRequest(**fields)
    assert where in str(err.value)


def test_prompt_forms_and_stop_normalisation():
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompt == [[1, 2], [3]]
    assert CompletionRequest(prompt=["a", "b"]).prompt == ["a", "b"]
    assert CompletionRequest(prompt="a", stop="x").stop == ["x"], "one stop string becomes a list of one"


def test_chat_requests():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5)
    assert body.max_completion_tokens == 5 and body.max_tokens is None
    for messages, where in [([], "messages"), ([{"role": "king", "content": "x"}], "role"),
                            ([{"role": "user"}], "content")]:
        with pytest.raises(ValidationError, match=where):
            ChatCompletionRequest(messages=messages)


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
                                                    "type": "invalid_request_error", "param": "prompt",
                                                    "code": None}}
