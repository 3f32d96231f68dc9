"""A live multi-turn chat workload for routing across replicas, and what each replica's cache saved on it.

    workload = build_routing_workload(tokenizer, num_conversations=24, num_turns=4, seed=0)
    result = asyncio.run(run_workload(workload, router_url, replica_urls=replica_urls, router_url=router_url))
    result.hit_rate, result.prefill_tokens_computed, result.ttft_percentile(0.9), result.replicas[0].requests

The workload: num_system_prompts system prompts cut from the shipped text, the first of them "hot" (a share
hot_share of the conversations use it, the rest are spread over the others); num_conversations conversations of
num_turns user messages each. Turn t of a conversation sends, through the chat template, its system prompt, every
earlier user message and the answer it got, then the new user message. With the embedded model's template

    SYSTEM.\\n{system}\\n\\nUSER.\\n{user 0}\\n\\nASSISTANT.\\n{answer 0}\\n\\nUSER.\\n{user 1}\\n\\nASSISTANT.\\n

each turn's prompt token ids start with the previous turn's prompt and its answer: a replica that served the
previous turn holds a prefix of this one (if it has not evicted it), and every replica that served any
conversation of the same system prompt holds at least that prompt's full blocks.

The client (httpx, streaming chat completions, temperature 0, max_tokens answer tokens) starts conversations at
Poisson or evenly spaced arrival times and runs each conversation's turns in order, the next one when the previous
answer is complete. Per request it measures TTFT (sent to the first chunk that carries a choice) and end-to-end
latency on its own clock. Before and after the run it reads every replica's /metrics: the differences give the
prefix-cache hit rate (vllm:prefix_cache_hits / vllm:prefix_cache_queries), the prefill tokens computed
(vllm:prompt_tokens - vllm:prefix_cache_hits) and each replica's load (requests finished, prompt tokens); and the
router's GET /router/stats when a router_url is given.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from kvlab.benchmarks.datasets import poisson_arrivals
from kvlab.entrypoints.openai.chat_template import render_chat
from kvlab.paths import ASSETS_DIR

TEXT_PATH = ASSETS_DIR / "text" / "shakespeare.txt"
# Counters read from each replica's /metrics (Prometheus family names, without the _total suffix).
COUNTERS = ("vllm:request_success", "vllm:prompt_tokens", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:generation_tokens", "vllm:num_preemptions")
REPLICA_HEADER = "x-kvlab-replica"  # kvlab router's answers name the replica that served them


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class Conversation:
    """One conversation: which system prompt it uses and its user messages, one per turn."""

    system_prompt: int               # index into RoutingWorkload.system_prompts (0 is the hot one)
    user_messages: tuple[str, ...]   # (num_turns,)


@dataclass(frozen=True)
class RoutingWorkload:
    """System prompts, conversations and the answer length: everything a run sends except the answers themselves."""

    system_prompts: tuple[str, ...]          # (num_system_prompts,); [0] is the hot one
    conversations: tuple[Conversation, ...]  # (num_conversations,)
    max_tokens: int                          # answer tokens per turn
    max_model_len: int                       # the served model's context, which every turn fits
    seed: int

    @property
    def num_requests(self) -> int:
        return sum(len(c.user_messages) for c in self.conversations)

    def messages(self, conversation: int, turn: int, answers: list[str] | tuple[str, ...]) -> list[dict]:
        """The chat messages of one turn: system prompt, then each earlier user message with its answer, then the
        turn's user message; answers holds the answers to turns 0..turn-1 of that conversation."""
        conv = self.conversations[conversation]
        if not 0 <= turn < len(conv.user_messages):
            raise ValueError(f"turn must be in 0..{len(conv.user_messages) - 1}, got {turn}")
        if len(answers) < turn:
            raise ValueError(f"turn {turn} needs the answers to the {turn} turns before it, got {len(answers)}")
        out = [{"role": "system", "content": self.system_prompts[conv.system_prompt]}]
        for t in range(turn):
            out += [{"role": "user", "content": conv.user_messages[t]}, {"role": "assistant", "content": answers[t]}]
        out.append({"role": "user", "content": conv.user_messages[turn]})
        return out


def _passages(tokenizer, count: int, num_tokens: int, rng: random.Random) -> list[str]:
    """count different passages of the shipped text, num_tokens tokens each, whitespace folded to single spaces."""
    text = TEXT_PATH.read_text(encoding="utf-8")
    window = 4 * num_tokens + 64  # characters enough for num_tokens tokens of the folded text; checked below
    starts = list(range(0, len(text) - window, window))
    if len(starts) < count:
        raise ValueError(f"the shipped text holds {len(starts)} passages of {num_tokens} tokens, fewer than {count}")
    out = []
    for start in rng.sample(starts, count):
        folded = " ".join(text[start:start + window].split()[1:])  # from the first whole word
        ids = tokenizer(folded, verbose=False)["input_ids"][:num_tokens]
        passage = tokenizer.decode(ids)
        if len(ids) < num_tokens or len(tokenizer(passage)["input_ids"]) != num_tokens:
            raise ValueError(f"a passage at character {start} does not give {num_tokens} tokens that re-tokenize "
                             "to themselves; the workload needs a tokenizer such as the embedded model's")
        out.append(passage)
    return out


def prompt_len(workload: RoutingWorkload, tokenizer, conversation: int, turn: int, answers) -> int:
    """Tokens of one turn's prompt as the server renders it (the chat template, then the tokenizer)."""
    rendered = render_chat(workload.messages(conversation, turn, answers), tokenizer)
    return len(rendered) if isinstance(rendered, list) else len(tokenizer(rendered)["input_ids"])


def longest_prompt_len(workload: RoutingWorkload, tokenizer) -> int:
    """The longest prompt any turn can send: every conversation's last turn, each earlier answer max_tokens long."""
    filler = tokenizer.decode(tokenizer("a" * workload.max_tokens)["input_ids"][:workload.max_tokens])
    return max(prompt_len(workload, tokenizer, c, len(conv.user_messages) - 1, [filler] * len(conv.user_messages))
               for c, conv in enumerate(workload.conversations))


def build_routing_workload(tokenizer, num_conversations: int = 24, num_turns: int = 4, num_system_prompts: int = 4,
                           hot_share: float = 0.6, system_tokens: int = 64, user_tokens: int = 16,
                           max_tokens: int = 8, max_model_len: int = 256, seed: int = 0) -> RoutingWorkload:
    """A seeded workload whose every turn, with answers of max_tokens tokens, fits max_model_len with its answer.

    round(hot_share * num_conversations) conversations use the hot system prompt (0); the others take prompts
    1..num_system_prompts-1 in turn; the order of conversations is shuffled by the seed.
    """
    for name, value in (("num_conversations", num_conversations), ("num_turns", num_turns),
                        ("num_system_prompts", num_system_prompts), ("system_tokens", system_tokens),
                        ("user_tokens", user_tokens), ("max_tokens", max_tokens), ("max_model_len", max_model_len)):
        _positive_int(name, value)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if isinstance(hot_share, bool) or not isinstance(hot_share, (int, float)) or not 0 <= hot_share <= 1:
        raise ValueError(f"hot_share must be a fraction in [0, 1], got {hot_share!r}")
    num_hot = round(hot_share * num_conversations)
    if num_system_prompts == 1 and num_hot < num_conversations:
        raise ValueError(f"hot_share={hot_share} leaves conversations without a system prompt: with "
                         "num_system_prompts=1 every conversation uses the hot one (hot_share=1.0)")
    rng = random.Random(seed)
    passages = _passages(tokenizer, num_system_prompts + num_conversations * num_turns,
                         max(system_tokens, user_tokens), rng)
    system_prompts = tuple(tokenizer.decode(tokenizer(p)["input_ids"][:system_tokens])
                           for p in passages[:num_system_prompts])
    users = [tokenizer.decode(tokenizer(p)["input_ids"][:user_tokens]) for p in passages[num_system_prompts:]]
    choice = [0] * num_hot + [1 + i % (num_system_prompts - 1) for i in range(num_conversations - num_hot)]
    rng.shuffle(choice)
    conversations = tuple(Conversation(s, tuple(users[c * num_turns:(c + 1) * num_turns]))
                          for c, s in enumerate(choice))
    workload = RoutingWorkload(system_prompts, conversations, max_tokens, max_model_len, seed)
    longest = longest_prompt_len(workload, tokenizer)
    if longest + max_tokens > max_model_len:
        raise ValueError(f"the last turn's prompt ({longest} tokens) plus max_tokens ({max_tokens}) exceeds "
                         f"max_model_len={max_model_len}: lower num_turns, system_tokens, user_tokens or max_tokens")
    return workload


# The measurements.

def parse_metrics(text: str) -> dict[str, float]:
    """Counters and gauges of a Prometheus text exposition, by family name (no _total suffix), summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type not in ("counter", "gauge", "unknown"):
            continue
        for sample in family.samples:
            # A counter's creation time (_created) is no count; its value sample may or may not carry _total.
            if sample.name.endswith("_created"):
                continue
            name = sample.name.removesuffix("_total")
            values[name] = values.get(name, 0.0) + sample.value
    return values


@dataclass
class ReplicaFigures:
    """One replica's counters over a run (after minus before), from its /metrics."""

    url: str
    requests: int = 0                # vllm:request_success
    prompt_tokens: int = 0           # vllm:prompt_tokens
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0

    @property
    def prefill_tokens_computed(self) -> int:
        return self.prompt_tokens - self.prefix_cache_hits


@dataclass
class RequestRecord:
    """One turn as the client saw it (seconds on its monotonic clock)."""

    conversation: int
    turn: int
    prompt_tokens: int = 0     # the server's usage.prompt_tokens
    replica: str | None = None # the replica a router names in its x-kvlab-replica header (None: no router)
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    answer: str = ""


def _percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1), nearest rank."""
    if not values:
        raise ValueError("no values to take a percentile of")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@dataclass
class RoutingRunResult:
    """What one run of the workload cost: per request, per replica, and the router's own count."""

    requests: list[RequestRecord] = field(default_factory=list)
    replicas: list[ReplicaFigures] = field(default_factory=list)
    router_stats_before: dict | None = None
    router_stats: dict | None = None    # GET /router/stats after the run
    wall_s: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.replicas)

    @property
    def prefix_cache_hits(self) -> int:
        return sum(r.prefix_cache_hits for r in self.replicas)

    @property
    def prefix_cache_queries(self) -> int:
        return sum(r.prefix_cache_queries for r in self.replicas)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from a prefix cache per prompt token looked up, over all replicas."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def prefill_tokens_computed(self) -> int:
        return self.prompt_tokens - self.prefix_cache_hits

    def ttft_percentile(self, q: float) -> float:
        return _percentile([r.ttft_s for r in self.requests], q)

    def e2e_percentile(self, q: float) -> float:
        return _percentile([r.e2e_s for r in self.requests], q)

    @property
    def answers(self) -> dict[tuple[int, int], str]:
        """(conversation, turn) -> the answer's text."""
        return {(r.conversation, r.turn): r.answer for r in self.requests}

    def summary(self) -> dict:
        """The run's figures as plain numbers (milliseconds for latencies), for a table or JSON."""
        out = {"requests": len(self.requests), "prompt_tokens": self.prompt_tokens, "hit_rate": self.hit_rate,
               "prefix_cache_hits": self.prefix_cache_hits, "prefill_tokens_computed": self.prefill_tokens_computed,
               "wall_s": self.wall_s, "replica_requests": [r.requests for r in self.replicas],
               "replica_prompt_tokens": [r.prompt_tokens for r in self.replicas],
               "preemptions": sum(r.num_preemptions for r in self.replicas)}
        for q in (50, 90, 99):
            out[f"ttft_p{q}_ms"] = 1e3 * self.ttft_percentile(q / 100)
            out[f"e2e_p{q}_ms"] = 1e3 * self.e2e_percentile(q / 100)
        return out


async def _read_counters(http, url: str) -> dict[str, float]:
    reply = await http.get(url + "/metrics")
    reply.raise_for_status()
    values = parse_metrics(reply.text)
    missing = [name for name in COUNTERS[:4] if name not in values]
    if missing:
        raise RuntimeError(f"{url}/metrics has no {', '.join(missing)}; is it a kvlab or vLLM server?")
    return values


async def _read_router_stats(http, router_url: str) -> dict:
    reply = await http.get(router_url + "/router/stats")
    reply.raise_for_status()
    return reply.json()


async def _one_turn(http, url: str, model: str, messages: list[dict], max_tokens: int,
                    record: RequestRecord) -> None:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = None
    pieces = []
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"conversation {record.conversation} turn {record.turn}: HTTP {response.status_code} "
                               f"{(await response.aread())[:300]!r}")
        record.replica = response.headers.get(REPLICA_HEADER)
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line[6:] == "[DONE]":
                break
            event = json.loads(line[6:])
            if event.get("error"):
                raise RuntimeError(f"conversation {record.conversation} turn {record.turn}: {event['error']}")
            if event.get("choices"):
                first = first or time.perf_counter()
                pieces.append(event["choices"][0]["delta"].get("content") or "")
            if event.get("usage"):
                record.prompt_tokens = event["usage"]["prompt_tokens"]
    if first is None:
        raise RuntimeError(f"conversation {record.conversation} turn {record.turn}: the stream carried no token")
    record.e2e_s = time.perf_counter() - sent
    record.ttft_s = first - sent
    record.answer = "".join(pieces)


async def run_workload(workload: RoutingWorkload, base_url: str, replica_urls: list[str] | tuple = (),
                       router_url: str | None = None, conversation_rate: float = 4.0, arrival: str = "poisson",
                       think_time_s: float = 0.0, model: str | None = None,
                       timeout_s: float = 300.0) -> RoutingRunResult:
    """Send every conversation to base_url (a router or one replica), timed; the replicas' and router's figures.

    Conversations start at conversation_rate per second (arrival "poisson": exponential gaps seeded by the
    workload's seed; "fixed": evenly spaced; rate inf: all at once); a conversation waits think_time_s after
    each answer before its next turn. replica_urls default to [base_url] (one replica, no router).
    """
    import httpx

    if arrival not in ("poisson", "fixed"):
        raise ValueError(f"arrival must be 'poisson' or 'fixed', got {arrival!r}")
    if isinstance(conversation_rate, bool) or not isinstance(conversation_rate, (int, float)) \
            or not conversation_rate > 0:
        raise ValueError(f"conversation_rate must be > 0 conversations per second, got {conversation_rate!r}")
    if isinstance(think_time_s, bool) or not isinstance(think_time_s, (int, float)) or think_time_s < 0:
        raise ValueError(f"think_time_s must be >= 0 seconds, got {think_time_s!r}")
    urls = [u.rstrip("/") for u in (replica_urls or [base_url])]
    base_url = base_url.rstrip("/")
    num = len(workload.conversations)
    if arrival == "poisson":
        starts = poisson_arrivals(num, conversation_rate, workload.seed)
    else:
        starts = [0.0 if conversation_rate == float("inf") else i / conversation_rate for i in range(num)]
    limits = httpx.Limits(max_connections=num + 8, max_keepalive_connections=num + 8)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
        if model is None:
            reply = await http.get(base_url + "/v1/models")
            reply.raise_for_status()
            model = reply.json()["data"][0]["id"]
        before = await asyncio.gather(*(_read_counters(http, u) for u in urls))
        result = RoutingRunResult()
        if router_url is not None:
            result.router_stats_before = await _read_router_stats(http, router_url.rstrip("/"))

        async def conversation(c: int, origin: float) -> list[RequestRecord]:
            await asyncio.sleep(max(0.0, origin + starts[c] - time.perf_counter()))
            records, answers = [], []
            for turn in range(len(workload.conversations[c].user_messages)):
                if turn and think_time_s:
                    await asyncio.sleep(think_time_s)
                record = RequestRecord(c, turn)
                await _one_turn(http, base_url, model, workload.messages(c, turn, answers), workload.max_tokens,
                                record)
                answers.append(record.answer)
                records.append(record)
            return records

        origin = time.perf_counter()
        per_conversation = await asyncio.wait_for(
            asyncio.gather(*(conversation(c, origin) for c in range(num))), timeout_s)
        result.wall_s = time.perf_counter() - origin
        result.requests = [r for records in per_conversation for r in records]
        after = await asyncio.gather(*(_read_counters(http, u) for u in urls))
        if router_url is not None:
            result.router_stats = await _read_router_stats(http, router_url.rstrip("/"))
    for url, b, a in zip(urls, before, after):
        delta = {name: round(a.get(name, 0.0) - b.get(name, 0.0)) for name in COUNTERS}
        result.replicas.append(ReplicaFigures(url, delta["vllm:request_success"], delta["vllm:prompt_tokens"],
                                              delta["vllm:prefix_cache_queries"], delta["vllm:prefix_cache_hits"],
                                              delta["vllm:generation_tokens"], delta["vllm:num_preemptions"]))
    return result
