"""kvlab serve's OpenAI API, driven by the real openai client and by raw HTTP."""

import asyncio
import json
import os
import random

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from serving_helpers import serve_embedded, wait_idle

from kvlab import LLM, SamplingParams, load_model

served = pytest.fixture(scope="module")(serve_embedded)
MODEL = "kvlab-embedded"
PROMPTS = ["OTHELLO.\n", "HAMLET.\nTo be, or not", "ROMEO.\n", "JULIET.\nO Romeo", "MACBETH.\nIs this a dagger",
           "PORTIA.\n", "KING LEAR.\nNothing", "PROSPERO.\n"]


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served[0] + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def greedy_texts():
    model, tokenizer = load_model()
    llm = LLM(model, tokenizer, block_size=16, num_blocks=64)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, llm.generate(PROMPTS, SamplingParams(temperature=0,
                                                                                                 max_tokens=24)))}


def assert_pool_empty(async_llm):
    wait_idle(async_llm)
    engine = async_llm.engine
    assert not engine.has_unfinished_requests(), "a request is still running after its client finished"
    manager = engine.kv_cache_manager
    assert manager.num_free_blocks == engine.num_blocks, f"{engine.num_blocks - manager.num_free_blocks} blocks held"


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(served[0] + "/health").status_code == 200


def test_completion_equals_the_offline_engine(served, client, greedy_texts):
    for prompt in PROMPTS[:3]:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert out.choices[0].text == greedy_texts[prompt], "the server's greedy text differs from LLM.generate's"
        assert out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == len(prompt)
    assert_pool_empty(served[1])


def test_streaming_gives_the_same_text_and_usage(served, client, greedy_texts):
    events = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(e.choices[0].text for e in events if e.choices)
    assert text == greedy_texts[PROMPTS[1]]
    assert len([e for e in events if e.choices]) > 2, "the text must arrive in pieces, not at the end"
    assert events[-1].usage.completion_tokens == 24 and not events[-1].choices
    finals = [e.choices[0].finish_reason for e in events if e.choices]
    assert finals[-1] == "length" and set(finals[:-1]) == {None}


def test_raw_sse_ends_with_done(served):
    body = {"model": MODEL, "prompt": "ROMEO.\n", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", served[0] + "/v1/completions", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert not any('"usage"' in line for line in lines), "usage only when stream_options.include_usage asks for it"


def test_chat_completion_and_its_stream(served, client):
    messages = [{"role": "system", "content": "A play."}, {"role": "user", "content": "Speak, speak."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert out.choices[0].message.role == "assistant" and len(out.choices[0].message.content) == 20
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content


def test_stop_strings_end_the_text_and_free_the_request(served, client, greedy_texts):
    full = greedy_texts[PROMPTS[0]]
    stop = full[5:8]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].text == full[:full.index(stop)] and out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(e.choices[0].text for e in streamed if e.choices) == full[:full.index(stop)]
    assert_pool_empty(served[1])


def test_n_seeded_samples(served, client):
    out = client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=12, temperature=1.0, n=3, seed=7)
    again = client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=12, temperature=1.0, n=3, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [c.text for c in again.choices], "a seed must make samples repeatable"
    assert out.usage.completion_tokens == 36


@pytest.mark.parametrize("body, status, words", [
    ("{not json", 400, "not valid JSON"),
    ({"model": MODEL, "prompt": "a", "best_of": 2}, 400, "best_of: kvlab does not rank completions"),
    ({"model": "gpt-9", "prompt": "a"}, 404, "does not exist"),
    ({"model": MODEL, "prompt": "a", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "temperature": "warm"}, 400, "temperature"),
    ({"model": MODEL, "prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "a", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "a", "logprobs": 2}, 400, "logprobs"),
    ({"model": MODEL, "prompt": []}, 400, "prompt"),
    ({"model": MODEL, "prompt": [5, 999]}, 400, "outside the vocabulary"),
    ({"model": MODEL, "prompt": "x" * 300}, 400, "max_model_len"),
    ({"model": MODEL, "prompt": "ROMEO.\n", "max_tokens": 2000}, 400, "maximum context length is 256"),
    ({"model": MODEL, "prompt": "a", "stop": ["", "b"]}, 400, "stop"),
    ({"model": MODEL}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors_and_the_server_serves_on(served, client, body, status, words):
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(served[0] + "/v1/completions", content=content,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"], error
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, (
        f"vLLM's error body has message, type, param and code (the HTTP status), got {error}")
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=3).choices[0].text


def test_bad_chat_requests(served):
    for body, words in [({"model": MODEL, "messages": []}, "messages"),
                        ({"model": MODEL, "messages": [{"role": "king", "content": "x"}]}, "role"),
                        ({"model": MODEL, "messages": [{"role": "user"}]}, "content")]:
        response = httpx.post(served[0] + "/v1/chat/completions", json=body)
        assert response.status_code == 400 and words in response.json()["error"]["message"], response.text


def test_sixteen_concurrent_streams_queue_and_finish(served, greedy_texts):
    async def run():
        client = AsyncOpenAI(base_url=served[0] + "/v1", api_key="unused")

        async def one(prompt):
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                     stream=True)
            return prompt, "".join([e.choices[0].text async for e in stream if e.choices])

        results = await asyncio.gather(*(one(PROMPTS[i % len(PROMPTS)]) for i in range(20)))
        await client.close()
        return results

    engine = served[1].engine
    before = len(engine.history)
    for prompt, text in asyncio.run(run()):
        assert text == greedy_texts[prompt], f"a concurrent stream of {prompt!r} got the wrong text"
    waiting = max(sum(s == "waiting" for s in h.status.values()) for h in engine.history[before:])
    assert waiting > 0, "20 streams on max_num_seqs=8: the overflow must queue"
    assert_pool_empty(served[1])


def test_a_client_that_disconnects_frees_its_blocks(served):
    base, async_llm = served
    aborted = async_llm.num_aborted
    body = {"model": MODEL, "prompt": "OTHELLO.\n", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    # Not streaming: the client gives up long before 3 x 200 tokens (at least 200 steps) are done.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(base + "/v1/completions", json=dict(body, stream=False, n=3), timeout=0.05)
    assert_pool_empty(async_llm)
    assert async_llm.num_aborted >= aborted + 2, "both requests must be aborted when their clients go away"


def test_metrics_in_prometheus_format(served, client):
    client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=4)
    text = httpx.get(served[0] + "/metrics").text
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_sum"]:
        assert f"{name}{{" in text, f"{name} is missing from /metrics"
    assert '# TYPE vllm:time_to_first_token_seconds histogram' in text
    metrics = {m.name: m.value for m in served[1].engine.get_metrics()}
    line = next(x for x in text.splitlines() if x.startswith("vllm:generation_tokens_total{"))
    assert float(line.split()[-1]) <= metrics["vllm:generation_tokens"], "one registry: the same counters"


def test_soak_with_random_aborts(served):
    """Many requests, some given up on at random moments: every block comes back, and no request is lost."""
    base, async_llm = served
    rng = random.Random(0)
    num = int(os.environ.get("KVLAB_SOAK_REQUESTS", "120"))  # the long soak: KVLAB_SOAK_REQUESTS=1000

    async def run():
        done, aborted = [], []
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            async def one(i):
                body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": rng.randint(1, 12),
                        "temperature": 0.8, "seed": i, "stream": True}
                give_up_after = rng.randint(1, 6) if rng.random() < 0.3 else None
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    seen = 0
                    async for line in response.aiter_lines():
                        if line == "data: [DONE]":
                            done.append(i)
                            return
                        seen += bool(line)
                        if give_up_after is not None and seen >= give_up_after:
                            aborted.append(i)
                            return
                done.append(i)

            await asyncio.gather(*(one(i) for i in range(num)))
        return done, aborted

    done, aborted = asyncio.run(run())
    assert sorted(done + aborted) == list(range(num)), "every request ends, finished or given up on"
    assert_pool_empty(async_llm)
