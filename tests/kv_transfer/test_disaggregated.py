"""Disaggregated prefill/decode with real processes on 127.0.0.1: `kvlab serve` as producer and as consumer, and
`kvlab proxy` in front (kvlab.entrypoints.disagg starts all three); plus the proxy's errors, in process."""

import json
import re
import socket
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from kvlab.entrypoints.disagg import DisaggregatedServers, free_port
from kvlab.entrypoints.disagg_proxy import build_proxy_app, prefill_request

SERVE_ARGS = ["--block-size", "16", "--num-blocks", "64", "--max-num-seqs", "8"]
PROMPT = "KING LEAR.\nNothing will come of nothing. Speak again.\nCORDELIA.\nUnhappy that I am, I cannot heave"
CHAT = [{"role": "user", "content": "Speak again, Cordelia, and mend your speech a little."}]
SEND_TIMEOUT_S = 4.0


def completion(n=12, **extra):
    return {"model": "default", "prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True, **extra}


def chat(n=10, **extra):
    return {"model": "default", "messages": CHAT, "max_tokens": n, "temperature": 0, "ignore_eos": True, **extra}


def post(url, path, body, timeout=60):
    return httpx.post(url + path, json=body, timeout=timeout)


def text_of(reply: httpx.Response, is_chat: bool) -> str:
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return choice["message"]["content"] if is_chat else choice["text"]


def streamed_text(url, path, body, is_chat: bool) -> str:
    pieces = []
    with httpx.stream("POST", url + path, json=dict(body, stream=True), timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                pieces.append(choice["delta"].get("content", "") if is_chat else choice["text"])
    return "".join(pieces)


def kv_usage(url) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M).group(1))


def wait_usage_zero(url, within_s) -> float:
    """Seconds until the server's KV usage is 0 (fails after within_s)."""
    start = time.monotonic()
    while kv_usage(url) > 0:
        assert time.monotonic() - start < within_s, f"{url} still holds blocks after {within_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def servers():
    pair = DisaggregatedServers("default", serve_args=SERVE_ARGS, kv_send_timeout_s=SEND_TIMEOUT_S,
                                kv_pull_timeout_s=10, start_timeout_s=120)
    try:
        yield pair
    finally:
        pair.stop()


def test_completions_and_chat_through_the_proxy_equal_one_engine_and_free_the_prefill_blocks(servers):
    for path, body, is_chat in (("/v1/completions", completion(), False), ("/v1/chat/completions", chat(), True)):
        # The prefill server as one plain engine (the decode server must not see the prompt first: it would find it
        # in its prefix cache and pull nothing).
        alone = text_of(post(servers.prefill_url, path, body), is_chat)
        assert alone, "a greedy answer of a few tokens"
        through = post(servers.proxy_url, path, body)
        assert text_of(through, is_chat) == alone, f"{path}: the disaggregated answer differs from one engine's"
        assert through.json()["usage"]["completion_tokens"] == body["max_tokens"]
        # The decode side has pulled (it could not finish otherwise); the producer frees at its next poll, long
        # before its send timeout would.
        assert wait_usage_zero(servers.prefill_url, within_s=SEND_TIMEOUT_S / 2) < SEND_TIMEOUT_S / 2
        # Streamed, the same prompt again: the decode server has it cached now, pulls nothing and releases the
        # producer's blocks at once.
        assert streamed_text(servers.proxy_url, path, body, is_chat) == alone, f"{path}: streamed through the proxy"
        assert wait_usage_zero(servers.prefill_url, within_s=SEND_TIMEOUT_S / 2) < SEND_TIMEOUT_S / 2
    assert "failed" not in servers.log_tail("decode"), "every pull succeeded: " + servers.log_tail("decode")


def test_the_prefill_server_answers_with_block_ids_and_frees_them_after_the_send_timeout(servers):
    reply = post(servers.prefill_url, "/v1/completions", prefill_request(completion(), chat=False))
    params = reply.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_port"] > 0 and params["remote_block_ids"]
    assert kv_usage(servers.prefill_url) > 0, "held for a decode server that never comes"
    waited = wait_usage_zero(servers.prefill_url, within_s=SEND_TIMEOUT_S + 5)
    assert waited > SEND_TIMEOUT_S / 2, f"freed by the timeout, not before ({waited:.2f} s)"


def test_a_decode_request_naming_an_unknown_remote_request_recomputes(servers):
    params = post(servers.prefill_url, "/v1/completions", prefill_request(completion(), chat=False)).json()[
        "kv_transfer_params"]
    expected = text_of(post(servers.prefill_url, "/v1/completions", completion(prompt=PROMPT + " it")), False)
    bogus = dict(params, remote_request_id="never-was")
    reply = post(servers.decode_url, "/v1/completions", completion(prompt=PROMPT + " it", kv_transfer_params=bogus))
    assert text_of(reply, False) == expected
    assert "unknown here" in servers.log_tail("decode"), "the refusal is logged with its reason"
    wait_usage_zero(servers.decode_url, within_s=5)


def test_a_dead_prefill_server_means_a_recompute_or_the_fallback():
    with DisaggregatedServers("default", serve_args=SERVE_ARGS, kv_pull_timeout_s=10,
                              fallback_local_prefill=True, start_timeout_s=120) as pair:
        expected = text_of(post(pair.prefill_url, "/v1/completions", completion()), False)
        params = post(pair.prefill_url, "/v1/completions", prefill_request(completion(), chat=False)).json()[
            "kv_transfer_params"]
        pair.kill("prefill")  # after answering, before the decode server pulled
        reply = post(pair.decode_url, "/v1/completions", completion(kv_transfer_params=params))
        assert text_of(reply, False) == expected, "the decode server recomputes the prompt: the same tokens"
        assert "failed" in pair.log_tail("decode") and "recomputed" in pair.log_tail("decode")
        wait_usage_zero(pair.decode_url, within_s=5)  # and frees what it reserved for the pull
        assert text_of(post(pair.proxy_url, "/v1/completions", completion()), False) == expected, \
            "--fallback-local-prefill: the decode server alone answers"
        assert httpx.get(pair.proxy_url + "/health").status_code == 200, "healthy: the fallback covers the prefill"


def test_the_proxy_without_fallback_answers_502_and_504_naming_the_prefill_server():
    dead = f"http://127.0.0.1:{free_port()}"
    with TestClient(build_proxy_app(dead, dead)) as client:
        reply = client.post("/v1/completions", json=completion())
        assert reply.status_code == 502, reply.text
        assert "prefill server" in reply.json()["error"]["message"] and dead in reply.json()["error"]["message"]
        assert client.get("/health").status_code == 503
    with socket.socket() as silent:  # accepts connections and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with TestClient(build_proxy_app(url, dead, prefill_timeout_s=0.3)) as client:
            reply = client.post("/v1/chat/completions", json=chat())
            assert reply.status_code == 504 and "did not answer" in reply.json()["error"]["message"], reply.text


def test_the_proxy_refuses_bad_settings_and_bodies():
    with pytest.raises(ValueError, match="prefill must be a server's base URL"):
        build_proxy_app("localhost:8100", "http://127.0.0.1:8200")
    with pytest.raises(ValueError, match="prefill_timeout_s must be a positive"):
        build_proxy_app("http://a", "http://b", prefill_timeout_s=0)
    with TestClient(build_proxy_app("http://127.0.0.1:1", "http://127.0.0.1:1")) as client:
        assert client.post("/v1/completions", content=b"{oops").status_code == 400
    body = prefill_request(chat(stream=True, stream_options={"include_usage": True}, min_tokens=3, n=2), chat=True)
    assert body["max_tokens"] == body["max_completion_tokens"] == body["n"] == 1 and body["stream"] is False
    assert "stream_options" not in body and body["min_tokens"] == 1
    assert body["kv_transfer_params"] == {"do_remote_decode": True}
