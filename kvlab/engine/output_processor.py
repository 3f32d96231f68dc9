"""From the scheduler's per-request tokens to what a caller reads (vLLM's v1/engine/output_processor.py).

    outputs, stopped = output_processor.process_outputs(engine_core_outputs)

The output processor keeps, per request the caller added, its completions (n > 1 runs as n child
requests, as in vLLM V1; a RequestOutput gathers them again, in order), turns token ids into text,
applies stop strings, and measures what only it sees: when each request's tokens reached the caller.

  * Detokenisation: a completion's text is its token ids decoded together (a character, or a byte-level
    BPE piece, may need several tokens), without clean-up of spaces (kvlab.engine.detokenizer). A request
    whose caller hears of every step (CUMULATIVE: the whole text so far; DELTA: only what is new, as a
    stream sends it) or that has stop strings is detokenised incrementally: each step decodes a short
    window of recent tokens, not the whole completion again. A FINAL_ONLY request without stop strings
    (LLM.generate) is decoded once, when it finishes.
  * Stop strings (SamplingParams.stop): the text ends where the first one begins, and the child is
    finished with reason "stop"; its id is returned in `stopped` so the engine frees its blocks. Each step
    searches only the new text and the few characters before it that a stop string could start in, and
    only once min_tokens tokens are out (the text of the first min_tokens tokens is not searched), as
    vLLM's detokenizer does. While a request runs, the tail that could still be the start of a stop
    string is held back, so text once shown never has to be taken back.
  * Latency (vLLM's histograms): time to first token, the time between token steps, end to end.
"""

import time
from dataclasses import dataclass, field

from kvlab.engine.detokenizer import IncrementalDetokenizer, TextDecoder
from kvlab.engine.metrics import RequestLatencies
from kvlab.engine.outputs import EngineCoreOutput
from kvlab.engine.request import FINISH_REASONS, CompletionOutput, RequestOutput, RequestStatus
from kvlab.engine.sampling_params import RequestOutputKind, SamplingParams


class StopStrings:
    """Cuts a completion's text at the first stop string; holds back a tail that could still begin one."""

    def __init__(self, stops):
        self.stops = [stops] if isinstance(stops, str) else list(stops or [])
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def find(self, text: str, new_from: int = 0) -> tuple[int, str] | None:
        """(where the earliest stop string begins, which one) among those that end after text[new_from], or None.

        A stop string that ends before new_from was there when text was new_from characters long: searching
        only from len(stop) - 1 characters before new_from finds every one that the new text completes.
        """
        best = None
        for stop in self.stops:
            i = text.find(stop, max(0, new_from - len(stop) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def check(self, text: str) -> tuple[str, bool]:
        """(text that is final so far, whether a stop string ended it)."""
        hit = self.find(text)
        if hit is not None:
            return text[:hit[0]], True
        return self.visible(text), False

    def visible(self, text: str) -> str:
        """What may be shown of a running completion's text: all but a tail that could begin a stop string."""
        return text[:len(text) - self.hold] if self.hold else text


@dataclass(slots=True)
class CompletionState:
    """One child request as the caller sees it."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None          # the stop string that ended it
    text: str | None = None                 # the final text, once known (cut at a stop string, or decoded at the end)
    detok: IncrementalDetokenizer | None = None   # for every request but a FINAL_ONLY one without stop strings
    stop_from: int = 0                      # stop strings are searched only in the text from here on (min_tokens)
    sent_chars: int = 0                     # DELTA: the text and tokens already handed to the caller
    sent_tokens: int = 0
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
    kv_transfer_params: dict | None = None  # a KV connector's params for a peer, once the request finished

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class OutputProcessor:
    """Request outputs from engine-core outputs: n > 1 gathered, text decoded, stop strings applied, latency timed."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoder = None if tokenizer is None else TextDecoder(tokenizer)
        self.requests: dict[str, RequestState] = {}     # every request the caller added, by its id
        self.child_to_parent: dict[str, tuple[str, int]] = {}
        self.latencies = RequestLatencies()             # TTFT, inter-token and end-to-end, from arrival on
        self.num_prompt_tokens = 0                      # prompt tokens of requests that produced their first token
        self.num_generation_tokens = 0
        self.num_finished_requests = 0                  # finished by a stop or their length (aborts not counted)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    children: list[str], arrival_time: float | None = None) -> None:
        now = time.perf_counter() if arrival_time is None else arrival_time
        incremental = self.decoder is not None and (params.output_kind is not RequestOutputKind.FINAL_ONLY
                                                    or bool(params.stop))
        completions = [CompletionState(arrival_time=now, last_token_time=now,
                                       detok=IncrementalDetokenizer(decoder=self.decoder) if incremental else None)
                       for _ in children]
        self.requests[request_id] = RequestState(request_id, prompt, list(prompt_token_ids), params, list(children),
                                                 completions, StopStrings(params.stop) if params.stop else None)
        for i, child in enumerate(children):
            self.child_to_parent[child] = (request_id, i)

    def decode(self, token_ids: list[int]) -> str:
        """Token ids as text ('' without a tokenizer): the tokenizer's decode, without clean-up of spaces."""
        return "" if self.decoder is None else self.decoder.decode(token_ids)

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
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params
            if completion.finish_reason is not None:  # already ended by a stop string
                continue
            if not completion.token_ids:
                self.num_prompt_tokens += len(state.prompt_token_ids)
                self.latencies.ttft.observe(now - completion.arrival_time)
            else:
                self.latencies.itl.observe(now - completion.last_token_time)
            completion.last_token_time = now
            new_from = self._detokenize(completion, out.new_token_ids, state.params.min_tokens, out.finished)
            self.num_generation_tokens += len(out.new_token_ids)
            if out.finished:
                completion.finish_reason = FINISH_REASONS.get(out.status)
            if state.stop is not None and len(completion.token_ids) > state.params.min_tokens:
                hit = state.stop.find(completion.detok.text, new_from)
                if hit is not None:
                    completion.text, completion.stop_reason = completion.detok.text[:hit[0]], hit[1]
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

    @staticmethod
    def _detokenize(completion: CompletionState, new_token_ids: list[int], min_tokens: int, finished: bool) -> int:
        """Append a step's tokens (and their text); returns where the text a stop string may end in begins."""
        before = len(completion.token_ids)
        completion.token_ids.extend(new_token_ids)
        detok = completion.detok
        if detok is None:
            return 0
        new_from = len(detok.text)
        if before < min_tokens:
            # The text of the first min_tokens tokens is never searched for stop strings (vLLM's rule), even when
            # one step brings tokens on both sides of that line (speculative decoding).
            inside = min_tokens - before
            detok.step(new_token_ids[:inside])
            completion.stop_from = new_from = len(detok.text)
            new_token_ids = new_token_ids[inside:]
        if new_token_ids:
            detok.step(new_token_ids)
        if finished:
            detok.finish()
        return max(new_from, completion.stop_from)

    def set_kv_transfer_params(self, params: dict[str, dict], outputs: list[RequestOutput]) -> None:
        """Attach a connector's params (by child id) to their requests, and to those requests' outputs in outputs."""
        for child, value in params.items():
            parent = self.child_to_parent[child][0]
            self.requests[parent].kv_transfer_params = value
            for output in outputs:
                if output.request_id == parent:
                    output.kv_transfer_params = value

    def abort(self, request_id: str) -> None:
        """Mark every unfinished completion of a request as aborted."""
        for completion in self.requests[request_id].completions:
            if completion.finish_reason is None:
                completion.finish_reason = "abort"
                if completion.detok is not None:
                    completion.detok.finish()

    def output(self, request_id: str) -> RequestOutput:
        """The request's RequestOutput now: one CompletionOutput per child, in order (for DELTA, what is new since
        the last one: text and token ids)."""
        state = self.requests[request_id]
        delta = state.params.output_kind is RequestOutputKind.DELTA
        completions = []
        for i, c in enumerate(state.completions):
            if c.text is not None:
                text = c.text
            elif c.detok is None:
                text = self.decode(c.token_ids)
                if c.finish_reason is not None:
                    c.text = text  # decoded once
            elif c.finish_reason is None and state.stop is not None:
                text = state.stop.visible(c.detok.text)  # hold back what could still begin a stop string
            else:
                text = c.detok.text
            token_ids = c.token_ids
            if delta:
                text, token_ids = text[c.sent_chars:], token_ids[c.sent_tokens:]
                c.sent_chars += len(text)
                c.sent_tokens += len(token_ids)
            completions.append(CompletionOutput(i, text, list(token_ids), c.finish_reason, stop_reason=c.stop_reason))
        return RequestOutput(request_id=request_id, prompt=state.prompt, prompt_token_ids=list(state.prompt_token_ids),
                             outputs=completions, finished=state.finished,
                             kv_transfer_params=state.kv_transfer_params)


def finish_reason(status: RequestStatus) -> str | None:
    """A request status as OpenAI's finish_reason ("stop", "length", "abort"), None while it runs."""
    return FINISH_REASONS.get(status)
