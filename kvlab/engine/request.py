"""Chapter 6's request: its tokens, how many of them the cache holds, and where it is in the scheduler.

The scheduler owns every Request (vLLM's v1/request.py): it alone changes num_computed_tokens, the
outputs and the status, in schedule() and update_from_output(). The model runner keeps its own
copy of what it needs (kvlab.engine.model_runner.CachedRequestState), fed by the scheduler's output.
"""

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvlab.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"          # not admitted yet
    WAITING_FOR_REMOTE_KVS = "waiting for remote KVs"  # holds blocks a KV connector's load is filling
    RUNNING = "running"          # admitted: holds blocks, prefilling in chunks or decoding
    PREEMPTED = "preempted"      # blocks freed (recompute): back at the front of the waiting queue
    SWAPPED = "swapped"          # blocks copied to the CPU pool (swap): waits to be copied back
    FINISHED_STOPPED = "finished (stop token)"
    FINISHED_LENGTH = "finished (length)"
    FINISHED_ABORTED = "finished (aborted)"

    def __init__(self, label: str):
        # A plain attribute rather than a property: the scheduler asks it of every request at every step.
        self.finished: bool = label.startswith("finished")


class Request:
    """One sequence the engine serves: prompt plus outputs, of which num_computed_tokens have K/V in the cache."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival: int,
                 eos_token_ids: Iterable[int] | int | None = (), prompt: str | None = None,
                 max_model_len: int | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.arrival = arrival               # order of add_request calls: breaks ties, keeps outputs in order
        # A model may list several end-of-sequence ids (Llama 3's generation config does): any of them stops it.
        self.eos_token_ids = frozenset(() if eos_token_ids is None else
                                       (eos_token_ids,) if isinstance(eos_token_ids, int) else eos_token_ids)
        self.max_model_len = max_model_len
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0         # tokens whose K/V are in the cache
        self.num_preemptions = 0
        self.recompute_until = 0             # tokens whose K/V a recompute preemption threw away
        # Speculative decoding: tokens a proposer guessed after the last sampled one, verified next step.
        self.spec_token_ids: list[int] = []
        # Tokens whose blocks are reserved at admission (an Orca-style baseline); 0: blocks as tokens come (paging).
        self.reserved_len = 0
        # A KV connector's params from the client (vLLM reads them from sampling_params.extra_args too).
        self.kv_transfer_params: dict | None = (params.extra_args or {}).get("kv_transfer_params")

    @property
    def max_len(self) -> int:
        """The most tokens (prompt + outputs) this request can reach: its max_tokens, within the model's length."""
        longest = len(self.prompt_token_ids) + self.params.max_tokens
        return longest if self.max_model_len is None else min(longest, self.max_model_len)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens start .. end - 1 of prompt plus outputs, without building the whole sequence (a decode reads one)."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt_len]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens not yet in the cache: the rest of the prompt (or of a recompute), or 1 for a decode."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens the next step may compute up to: the sequence plus its unverified draft tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + len(self.spec_token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_tokens_to_compute > 1 or not self.output_token_ids

    def append_output(self, token: int, max_model_len: int | None = None) -> None:
        """Add a sampled token and finish the request if it hit a stop token, max_tokens or the model's length.

        Before min_tokens outputs a stop token does not stop it: the sampler never draws one then, and this
        check (vLLM's check_stop in v1/core/sched/utils.py) guards every other way a token can arrive.
        """
        self.output_token_ids.append(token)
        p = self.params
        if len(self.output_token_ids) >= p.min_tokens and (
                token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
            self.status = RequestStatus.FINISHED_STOPPED
        elif len(self.output_token_ids) >= p.max_tokens \
                or len(self.prompt_token_ids) + len(self.output_token_ids) >= self.max_len \
                or (max_model_len is not None and self.num_tokens >= max_model_len):
            self.status = RequestStatus.FINISHED_LENGTH


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a request (n > 1 gives several): its new token ids and text."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", or None while running
    cumulative_logprob: float | None = None  # beam search: the beam's (length-penalised) score
    stop_reason: str | None = None  # the stop string that ended it (vLLM's name; a stop token shows in token_ids)


@dataclass(slots=True)
class RequestOutput:
    """What the engine returns for a request, shaped as vLLM's RequestOutput."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    kv_transfer_params: dict | None = None  # what a KV connector tells a peer (a prefill server's block ids, say)


FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                  RequestStatus.FINISHED_ABORTED: "abort"}
