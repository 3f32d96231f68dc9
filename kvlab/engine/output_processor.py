"""From the scheduler's per-request tokens to what a caller reads (vLLM's v1/engine/output_processor.py).

    outputs, stopped = output_processor.process_outputs(engine_core_outputs)

The output processor keeps, per request the caller added, its completions (n > 1 runs as n child
requests, as in vLLM V1; a RequestOutput gathers them again, in order), turns token ids into text,
applies stop strings, and measures what only it sees: when each request's tokens reached the caller.

  * Detokenisation: a completion's text is its token ids decoded together (a character, or a byte-level
    BPE piece, may need several tokens). A request whose SamplingParams ask for FINAL_ONLY (LLM.generate)
    is decoded once, when it finishes.
  * Stop strings (SamplingParams.stop): the text ends where the first one begins, and the child is
    finished with reason "stop"; its id is returned in `stopped` so the engine frees its blocks. While a
    request runs, the tail that could still be the start of a stop string is held back, so text once
    shown never has to be taken back.
  * Latency (vLLM's histograms): time to first token, the time between token steps, end to end.
"""

import time
from dataclasses import dataclass, field

from kvlab.engine.metrics import RequestLatencies
from kvlab.engine.outputs import EngineCoreOutput
from kvlab.engine.request import FINISH_REASONS, CompletionOutput, RequestOutput, RequestStatus
from kvlab.engine.sampling_params import RequestOutputKind, SamplingParams


class StopStrings:
    """Cuts a completion's text at the first stop string; holds back a tail that could still begin one."""

    def __init__(self, stops):
        self.stops = [stops] if isinstance(stops, str) else list(stops or [])
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def check(self, text: str) -> tuple[str, bool]:
        """(text that is final so far, whether a stop string ended it)."""
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            return text[:cut], True
        return (text[:len(text) - self.hold] if self.hold else text), False


@dataclass(slots=True)
class CompletionState:
    """One child request as the caller sees it."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stopped_at: str | None = None           # the text cut at a stop string, once one appeared
    arrival_time: float = 0.0
    last_token_time: float = 0.0


@dataclass(slots=True)
class RequestState:
    """A caller's request: its prompt, parameters and completions (one per child)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[str]
    completions: list[CompletionState]
    stop: StopStrings | None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class OutputProcessor:
    """Request outputs from engine-core outputs: n > 1 gathered, text decoded, stop strings applied, latency timed."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}     # every request the caller added, by its id
        self.child_to_parent: dict[str, tuple[str, int]] = {}
        self.latencies = RequestLatencies()             # TTFT, inter-token and end-to-end, from arrival on
        self.num_prompt_tokens = 0                      # prompt tokens of requests that produced their first token
        self.num_generation_tokens = 0
        self.num_finished_requests = 0                  # finished by a stop or their length (aborts not counted)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    children: list[str], arrival_time: float | None = None) -> None:
        now = time.perf_counter() if arrival_time is None else arrival_time
        completions = [CompletionState(arrival_time=now, last_token_time=now) for _ in children]
        self.requests[request_id] = RequestState(request_id, prompt, list(prompt_token_ids), params, list(children),
                                                 completions, StopStrings(params.stop) if params.stop else None)
        for i, child in enumerate(children):
            self.child_to_parent[child] = (request_id, i)

    def decode(self, token_ids: list[int]) -> str:
        """Token ids as text ('' without a tokenizer)."""
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)

    def process_outputs(self, outputs: list[EngineCoreOutput],
                        now: float | None = None) -> tuple[list[RequestOutput], list[str]]:
        """(RequestOutputs of the requests that moved and that their caller wants now, child ids stopped by a stop
        string, which the scheduler must finish)."""
        now = time.perf_counter() if now is None else now
        moved: dict[str, None] = {}
        stopped = []
        for out in outputs:
            parent, index = self.child_to_parent[out.request_id]
            state = self.requests[parent]
            completion = state.completions[index]
            if completion.finish_reason is not None:  # already ended by a stop string
                continue
            if not completion.token_ids:
                self.num_prompt_tokens += len(state.prompt_token_ids)
                self.latencies.ttft.observe(now - completion.arrival_time)
            else:
                self.latencies.itl.observe(now - completion.last_token_time)
            completion.last_token_time = now
            completion.token_ids.extend(out.new_token_ids)
            self.num_generation_tokens += len(out.new_token_ids)
            if out.finished:
                completion.finish_reason = FINISH_REASONS.get(out.status)
            if state.stop is not None:
                text, hit = state.stop.check(self.decode(completion.token_ids))
                if hit:
                    completion.stopped_at = text
                    if not out.finished:
                        stopped.append(out.request_id)
                    completion.finish_reason = "stop"
            if completion.finish_reason is not None:
                self.num_finished_requests += 1
                self.latencies.e2e.observe(completion.last_token_time - completion.arrival_time)
            moved[parent] = None
        results = []
        for parent in moved:
            state = self.requests[parent]
            if state.params.output_kind is RequestOutputKind.FINAL_ONLY and not state.finished:
                continue
            results.append(self.output(parent))
        return results, stopped

    def abort(self, request_id: str) -> None:
        """Mark every unfinished completion of a request as aborted."""
        for completion in self.requests[request_id].completions:
            if completion.finish_reason is None:
                completion.finish_reason = "abort"

    def output(self, request_id: str) -> RequestOutput:
        """The request's RequestOutput now: one CompletionOutput per child, in order."""
        state = self.requests[request_id]
        completions = []
        for i, c in enumerate(state.completions):
            if c.stopped_at is not None:
                text = c.stopped_at
            else:
                text = self.decode(c.token_ids)
                if state.stop is not None and c.finish_reason is None:
                    text, _ = state.stop.check(text)  # hold back what could still begin a stop string
            completions.append(CompletionOutput(i, text, list(c.token_ids), c.finish_reason))
        return RequestOutput(request_id=request_id, prompt=state.prompt, prompt_token_ids=list(state.prompt_token_ids),
                             outputs=completions, finished=state.finished)


def finish_reason(status: RequestStatus) -> str | None:
    """A request status as OpenAI's finish_reason ("stop", "length", "abort"), None while it runs."""
    return FINISH_REASONS.get(status)
