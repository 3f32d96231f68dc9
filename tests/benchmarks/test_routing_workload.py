"""The live routing workload: its conversations, its bound on prompt lengths, and the figures it reads off a server."""

import asyncio
import collections
import sys
from pathlib import Path

import httpx
import pytest

from kvlab import load_model
from kvlab.benchmarks.routing_workload import (
    build_routing_workload,
    longest_prompt_len,
    parse_metrics,
    prompt_len,
    run_workload,
)
from kvlab.entrypoints.openai.chat_template import render_chat

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints"))
from serving_helpers import start_server, wait_idle  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return load_model()[1]


@pytest.fixture(scope="module")
def workload(tokenizer):
    return build_routing_workload(tokenizer, num_conversations=20, num_turns=4, num_system_prompts=4, hot_share=0.75,
                                  seed=3)


def prompt_ids(workload, tokenizer, c, turn, answers):
    return tokenizer(render_chat(workload.messages(c, turn, answers), tokenizer))["input_ids"]


def test_system_prompts_are_shared_and_one_is_hot(workload):
    assert len(set(workload.system_prompts)) == 4, "the system prompts must differ from each other"
    uses = collections.Counter(c.system_prompt for c in workload.conversations)
    assert uses[0] == 15, f"hot_share 0.75 of 20 conversations is 15 on the hot prompt, got {uses[0]}"
    assert sorted(uses) == [0, 1, 2, 3] and all(uses[s] >= 1 for s in (1, 2, 3)), f"every prompt is used: {uses}"
    assert uses.most_common(1)[0][0] == 0
    users = [m for c in workload.conversations for m in c.user_messages]
    assert len(set(users)) == len(users) == 80, "every user message is a different passage"
    assert all(len(c.user_messages) == 4 for c in workload.conversations)


def test_the_workload_is_a_function_of_its_seed(tokenizer, workload):
    again = build_routing_workload(tokenizer, num_conversations=20, num_turns=4, num_system_prompts=4,
                                   hot_share=0.75, seed=3)
    assert again == workload
    other = build_routing_workload(tokenizer, num_conversations=20, num_turns=4, num_system_prompts=4,
                                   hot_share=0.75, seed=4)
    assert other.system_prompts != workload.system_prompts
    assert [c.system_prompt for c in other.conversations] != [c.system_prompt for c in workload.conversations]


def test_each_turn_extends_the_previous_prompt_and_answer(workload, tokenizer):
    """Under the chat template, turn t+1's token ids start with turn t's prompt followed by its answer."""
    answers = ["What is the ", "O, my lord!", "Ay", "Nay, s"]
    for c in (0, 7, 19):
        for turn in range(3):
            before = prompt_ids(workload, tokenizer, c, turn, answers[:turn])
            after = prompt_ids(workload, tokenizer, c, turn + 1, answers[:turn + 1])
            assert after[:len(before)] == before, f"conversation {c} turn {turn + 1} does not extend turn {turn}"
            answer = tokenizer(answers[turn])["input_ids"]
            assert after[len(before):len(before) + len(answer)] == answer, "the answer follows the prompt"
    system = workload.system_prompts[0]
    hot = [c for c, conv in enumerate(workload.conversations) if conv.system_prompt == 0][:2]
    first, second = (prompt_ids(workload, tokenizer, c, 0, []) for c in hot)
    shared = len(tokenizer("SYSTEM.\n" + system + "\n\n")["input_ids"])
    assert first[:shared] == second[:shared] and shared >= 64, "two hot conversations share the system prompt"


def test_every_turn_fits_the_context(tokenizer):
    workload = build_routing_workload(tokenizer, num_conversations=6, num_turns=4, max_tokens=8, seed=1)
    longest = longest_prompt_len(workload, tokenizer)
    assert longest + workload.max_tokens <= workload.max_model_len == 256
    # An answer is at most max_tokens tokens; no turn with such answers is longer than the bound.
    for c, conv in enumerate(workload.conversations):
        answers = ["x" * 8] * len(conv.user_messages)
        assert all(prompt_len(workload, tokenizer, c, t, answers) <= longest for t in range(len(conv.user_messages)))
    with pytest.raises(ValueError, match="max_model_len=256"):
        build_routing_workload(tokenizer, num_turns=6)
    with pytest.raises(ValueError, match="max_model_len=200"):
        build_routing_workload(tokenizer, max_model_len=200)


@pytest.mark.parametrize("kwargs, field", [
    ({"num_conversations": 0}, "num_conversations"), ({"num_turns": 2.0}, "num_turns"),
    ({"num_system_prompts": -1}, "num_system_prompts"), ({"max_tokens": True}, "max_tokens"),
    ({"hot_share": 1.5}, "hot_share"), ({"hot_share": "most"}, "hot_share"), ({"seed": "0"}, "seed"),
    ({"num_system_prompts": 1, "hot_share": 0.5}, "num_system_prompts=1"),
    ({"num_conversations": 5000}, "fewer than"),
])
def test_bad_workload_arguments_are_named(tokenizer, kwargs, field):
    with pytest.raises(ValueError, match=field):
        build_routing_workload(tokenizer, **kwargs)


def test_bad_turns_and_run_arguments_are_named(workload):
    with pytest.raises(ValueError, match="turn must be in 0..3"):
        workload.messages(0, 4, ["a"] * 4)
    with pytest.raises(ValueError, match="needs the answers"):
        workload.messages(0, 2, ["a"])
    for kwargs, field in (({"arrival": "burst"}, "arrival"), ({"conversation_rate": 0}, "conversation_rate"),
                          ({"think_time_s": -1.0}, "think_time_s")):
        with pytest.raises(ValueError, match=field):
            asyncio.run(run_workload(workload, "http://127.0.0.1:9", **kwargs))


@pytest.fixture(scope="module")
def server():
    server = start_server(block_size=16, num_blocks=64, max_num_seqs=8)
    yield server
    server.stop()


def test_parse_metrics_reads_a_served_metrics_page(server):
    httpx.post(server.base_url + "/v1/completions", json={"model": server.model_name, "prompt": "OTHELLO.\nO my",
                                                           "max_tokens": 3, "temperature": 0}).raise_for_status()
    wait_idle(server.async_llm)
    text = httpx.get(server.base_url + "/metrics").text
    parsed = parse_metrics(text)
    engine = {m.name: m.value for m in server.engine.get_metrics() if isinstance(m.value, (int, float))}
    for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens",
                 "vllm:request_success", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert parsed[name] == pytest.approx(engine[name]), f"{name}: parsed {parsed.get(name)} vs {engine[name]}"
    assert parsed["vllm:prompt_tokens"] >= 13 and parsed["vllm:request_success"] >= 1
    assert not any(name.endswith(("_total", "_bucket", "_sum", "_count")) for name in parsed), sorted(parsed)
    # A label that splits one counter (vLLM's finished_reason) is summed over.
    for family in ("vllm:request_success_total", "vllm:request_success"):
        labelled = (f'# TYPE {family} counter\nvllm:request_success_total{{finished_reason="stop"}} 2.0\n'
                    'vllm:request_success_total{finished_reason="length"} 3.0\n'
                    'vllm:request_success_created{finished_reason="length"} 1.7e9\n')
        assert parse_metrics(labelled) == {"vllm:request_success": 5.0}


def test_a_run_against_one_server_counts_what_it_sent(server, tokenizer):
    workload = build_routing_workload(tokenizer, num_conversations=4, num_turns=3, num_system_prompts=2,
                                      hot_share=0.5, max_tokens=6, seed=5)
    result = asyncio.run(run_workload(workload, server.base_url, conversation_rate=float("inf")))
    assert len(result.requests) == workload.num_requests == 12
    (replica,) = result.replicas
    assert replica.requests == 12, "the server's finished requests over the run are the client's"
    assert replica.prompt_tokens == sum(r.prompt_tokens for r in result.requests) == result.prompt_tokens
    for r in result.requests:
        answers = [result.answers[(r.conversation, t)] for t in range(r.turn)]
        assert r.prompt_tokens == prompt_len(workload, tokenizer, r.conversation, r.turn, answers)
        assert 0 < r.ttft_s <= r.e2e_s
    # Turns 1 and 2 find at least the blocks their previous turn's prompt filled (the pool holds all of them).
    floor = sum(16 * (prompt_len(workload, tokenizer, r.conversation, r.turn - 1, [result.answers[
        (r.conversation, t)] for t in range(r.turn - 1)]) // 16) for r in result.requests if r.turn)
    assert result.prefix_cache_hits >= floor > 0
    assert result.prefill_tokens_computed == result.prompt_tokens - result.prefix_cache_hits
    assert 0 < result.hit_rate < 1 and result.ttft_percentile(0.5) <= result.ttft_percentile(0.99)
    assert result.summary()["replica_requests"] == [12] and result.router_stats is None
