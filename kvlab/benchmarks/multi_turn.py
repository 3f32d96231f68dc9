"""A multi-turn chat workload and what a KV offloading tier saves on it.

Each conversation is a run of user turns cut from the shipped Shakespeare text; turn k's prompt is the whole
conversation so far (every earlier user turn and the model's answer to it) plus the new user turn, so each
prompt's leading blocks are the previous prompt's: a prefix hit, if its K/V is still anywhere.

    conversations = multi_turn_conversations(tokenizer, num_conversations=8, max_model_len=256)
    result = run_conversations(engine, conversations, answer_tokens=12)

Several conversations are interleaved (each sends its next turn as soon as its last answer is out), so a GPU
pool smaller than all their contexts evicts one conversation's blocks while the others run: the case for a CPU
or disk tier behind it. run_conversations reports, per run, the prompt tokens served from the GPU prefix cache
and from each tier, the prefill tokens computed, the bytes loaded per tier, and each turn's TTFT (from the turn's
arrival to its first token, wall clock).
"""

import time
from dataclasses import dataclass, field

from kvlab.engine.sampling_params import SamplingParams
from kvlab.paths import ASSETS_DIR


def multi_turn_conversations(tokenizer, num_conversations: int, max_model_len: int, num_turns: int = 4,
                             answer_tokens: int = 12, user_tokens: int | None = None) -> list[list[list[int]]]:
    """Per conversation, its user turns' token ids: num_turns turns of user_tokens each (by default what makes the
    last turn's prompt plus its answer fill max_model_len), each conversation from its own part of the text."""
    for name, value in (("num_conversations", num_conversations), ("num_turns", num_turns),
                        ("answer_tokens", answer_tokens), ("max_model_len", max_model_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if user_tokens is None:
        user_tokens = max_model_len // num_turns - answer_tokens
    if user_tokens < 1 or num_turns * (user_tokens + answer_tokens) > max_model_len:
        raise ValueError(f"user_tokens={user_tokens}: {num_turns} turns of user_tokens + answer_tokens "
                         f"({answer_tokens}) must fit max_model_len={max_model_len}")
    text = (ASSETS_DIR / "text" / "shakespeare.txt").read_text(encoding="utf-8")
    ids = tokenizer(text[:200_000])["input_ids"]
    per_conversation = num_turns * user_tokens
    stride = (len(ids) - per_conversation) // num_conversations
    if stride < per_conversation:
        raise ValueError(f"the text holds too few tokens for {num_conversations} conversations of "
                         f"{per_conversation} user tokens")
    conversations = []
    for c in range(num_conversations):
        start = c * stride
        conversations.append([ids[start + t * user_tokens:start + (t + 1) * user_tokens] for t in range(num_turns)])
    return conversations


@dataclass
class MultiTurnResult:
    """What one run of the workload cost and saved; token counts are prompt tokens unless named otherwise."""

    prompt_tokens: int = 0            # every turn's whole prompt, summed
    gpu_hit_tokens: int = 0           # served by the GPU prefix cache (re-admissions after preemption excluded)
    cpu_hit_tokens: int = 0           # loaded from the CPU tier
    disk_hit_tokens: int = 0          # loaded from the disk tier
    prefill_tokens_computed: int = 0  # run through the model for prompts (recomputes included)
    cpu_bytes_loaded: int = 0
    disk_bytes_loaded: int = 0
    num_preemptions: int = 0
    num_failed_loads: int = 0
    ttft_s: list[float] = field(default_factory=list)  # per turn
    wall_s: float = 0.0

    @property
    def prefill_tokens_saved(self) -> int:
        return self.gpu_hit_tokens + self.cpu_hit_tokens + self.disk_hit_tokens

    def percentile_ttft(self, q: float) -> float:
        """The q-quantile (0..1) of the turns' TTFT, nearest rank."""
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_conversations(engine, conversations: list[list[list[int]]], answer_tokens: int = 12,
                      timeout_s: float = 600.0) -> MultiTurnResult:
    """Serve every conversation to its end, interleaved, greedy; what it cost (MultiTurnResult)."""
    params = SamplingParams(temperature=0, max_tokens=answer_tokens, ignore_eos=True)
    history = [[] for _ in conversations]   # per conversation, its tokens so far (user turns and answers)
    next_turn = [0] * len(conversations)
    arrived: dict[str, float] = {}
    result = MultiTurnResult()
    connector = engine.kv_connector
    computed_before, generated = engine.num_tokens_computed, 0

    def send(c: int) -> None:
        prompt = history[c] + conversations[c][next_turn[c]]
        rid = f"c{c}t{next_turn[c]}"
        history[c] = list(prompt)
        next_turn[c] += 1
        result.prompt_tokens += len(prompt)
        arrived[rid] = time.perf_counter()
        engine.add_request(rid, prompt, params)

    start = time.perf_counter()
    for c in range(len(conversations)):
        send(c)
    while engine.has_unfinished_requests() or engine.has_pending_kv_transfers():
        if time.perf_counter() - start > timeout_s:
            raise RuntimeError(f"the conversations did not finish in {timeout_s} s")
        if not engine.has_schedulable_requests():
            time.sleep(0.0005)  # only loads in flight
        for out in engine.step():
            rid = out.request_id
            if rid in arrived and out.outputs[0].token_ids:
                result.ttft_s.append(time.perf_counter() - arrived.pop(rid))
            if out.finished:
                c = int(rid[1:rid.index("t")])
                answer = list(out.outputs[0].token_ids)
                generated += len(answer)
                history[c] += answer
                if next_turn[c] < len(conversations[c]):
                    send(c)
    result.wall_s = time.perf_counter() - start
    manager = engine.kv_cache_manager
    result.gpu_hit_tokens = manager.hits
    result.num_preemptions = engine.scheduler.num_preemptions
    result.num_failed_loads = engine.scheduler.num_failed_loads
    # Each answer's first token comes with its prompt's last chunk; every later one is one computed token.
    num_turns = sum(len(turns) for turns in conversations)
    result.prefill_tokens_computed = engine.num_tokens_computed - computed_before - (generated - num_turns)
    if connector is not None:
        size, per_block = engine.block_size, engine.block_bytes
        result.cpu_hit_tokens = connector.num_loaded_blocks * size
        result.cpu_bytes_loaded = connector.num_loaded_blocks * per_block
        result.disk_hit_tokens = getattr(connector, "num_disk_loaded_blocks", 0) * size
        result.disk_bytes_loaded = getattr(connector, "num_disk_loaded_blocks", 0) * per_block
    return result
