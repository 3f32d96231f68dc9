"""Online serving's engine: requests arrive while the engine steps, and each one's tokens stream out (vLLM's AsyncLLM).

    async_llm = AsyncLLM(LLMEngine(model, tokenizer, ...))
    async for out in async_llm.generate("OTHELLO.\\n", SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].text)          # the whole text so far (CUMULATIVE, the default), after every step
                                            # that moved it; output_kind=DELTA gives only the new text

One thread owns the engine and runs its busy loop, as vLLM's EngineCore does in a process of its own
(vllm/v1/engine/core.py): take in the calls that arrived (add a request, abort one, read the metrics),
step while any request is unfinished, hand each step's outputs to the event loop, and sleep only when
there is nothing to do. Calls run on that thread between two steps, one after another, so the engine
needs no locks; the next step starts as soon as the last one ends, never waiting for the event loop
to schedule it, while the loop accepts connections and streams the tokens of the step before. A
consumer that stops reading (a client that disconnected, a cancelled task) aborts its request at
once, which frees its blocks.
"""

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator

from kvlab.engine.llm_engine import LLMEngine
from kvlab.engine.request import CompletionOutput, RequestOutput
from kvlab.engine.sampling_params import RequestOutputKind, SamplingParams

_STOP = object()  # asks the engine thread to end
_POLL_S = 0.002  # how often an idle engine steps while a KV connector's copy is in flight


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if not future.done():  # its awaiting task may have been cancelled meanwhile
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


class RequestOutputCollector:
    """One request's outputs on their way to its consumer: a single slot, never a backlog (vLLM's class of the name,
    vllm/v1/engine/output_processor.py).

    When the engine gets ahead of the consumer (a busy event loop), a DELTA output is merged into the one
    still waiting (texts and token ids joined), and any other kind replaces it (the newer cumulative text
    holds the older). So a stream that falls behind catches up in one piece, one server-sent event, rather
    than one event per step it missed.
    """

    __slots__ = ("aggregate", "output", "ready")

    def __init__(self, output_kind: RequestOutputKind):
        self.aggregate = output_kind is RequestOutputKind.DELTA
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | BaseException) -> None:
        if self.output is None or isinstance(output, BaseException):
            self.output = output
            self.ready.set()
        elif isinstance(self.output, BaseException):
            return  # the failure stays what the consumer hears
        elif self.aggregate:
            self.output = merge_deltas(self.output, output)
        else:
            self.output = output

    async def get(self) -> RequestOutput | BaseException:
        while self.output is None:
            await self.ready.wait()
        output, self.output = self.output, None
        self.ready.clear()
        return output


def merge_deltas(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two successive DELTA outputs of a request as one: each completion's text and token ids joined."""
    outputs = [CompletionOutput(b.index, a.text + b.text, a.token_ids + b.token_ids, b.finish_reason,
                                stop_reason=b.stop_reason or a.stop_reason)
               for a, b in zip(first.outputs, then.outputs)]
    return RequestOutput(then.request_id, then.prompt, then.prompt_token_ids, outputs, then.finished)


class AsyncLLM:
    """An LLMEngine stepped by a thread of its own for an asyncio loop: generate() streams RequestOutputs."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._calls: queue.SimpleQueue = queue.SimpleQueue()   # (fn, args, future) for the engine thread
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None     # where outputs are delivered
        self._streams: dict[str, RequestOutputCollector] = {}
        self._ids = itertools.count()
        self.num_aborted = 0
        self.errored: BaseException | None = None  # an exception the engine loop died of

    async def run(self, fn, *args):
        """fn(*args) on the engine's thread, between two steps; awaits its result."""
        if self.errored is not None:
            raise RuntimeError(f"the engine loop has stopped: {self.errored!r}")
        self._loop = asyncio.get_running_loop()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._busy_loop, name="kvlab-engine", daemon=True)
            self._thread.start()
        future = self._loop.create_future()
        self._calls.put((fn, args, future))
        return await future

    def _busy_loop(self) -> None:
        """The engine thread: calls that arrived, then a step while any request is unfinished; sleep when idle."""
        engine = self.engine
        while True:
            busy = engine.has_schedulable_requests()
            # Only a KV connector's copy in flight: poll it every couple of milliseconds rather than spin.
            polling = not busy and engine.has_pending_kv_transfers()
            try:
                item = self._calls.get(block=not busy, timeout=_POLL_S if polling else None)
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    return
                fn, args, future = item
                try:
                    result, error = fn(*args), None
                except BaseException as err:  # the caller's to handle (a bad request): the engine serves on
                    result, error = None, err
                self._post(future.get_loop(), _settle, future, result, error)
                try:
                    item = self._calls.get_nowait()
                except queue.Empty:
                    item = None
            if not engine.has_schedulable_requests() and not engine.has_pending_kv_transfers():
                continue
            try:
                outputs = engine.step()
            except Exception as err:  # a bug in a step: every stream and every later call hears of it
                self.errored = err
                self._post(self._loop, self._fail_all, err)
                return
            if outputs:
                self._post(self._loop, self._dispatch, outputs)

    @staticmethod
    def _post(loop: asyncio.AbstractEventLoop | None, fn, *args) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except (AttributeError, RuntimeError):  # no loop, or it has closed: nobody is listening any more
            pass

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _fail_all(self, err: BaseException) -> None:
        for stream in self._streams.values():
            stream.put(err)
        while True:  # calls that will never run
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                _settle(item[2], None, RuntimeError(f"the engine loop has stopped: {err!r}"))

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its RequestOutput after every step that gave it tokens, the finished one last.

        Steps that ended while the consumer was busy come as one output (RequestOutputCollector). A bad
        request raises ValueError before anything is yielded (and the engine serves on).
        """
        if self.errored is not None:
            raise RuntimeError(f"the engine loop has stopped: {self.errored!r}")
        request_id = f"req-{next(self._ids)}" if request_id is None else str(request_id)
        kind = params.output_kind if isinstance(params, SamplingParams) else RequestOutputKind.CUMULATIVE
        stream = RequestOutputCollector(kind)
        self._streams[request_id] = stream
        finished = False
        try:
            await self.run(self.engine.add_request, request_id, prompt, params)
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise RuntimeError("the engine loop failed") from out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            del self._streams[request_id]
            if not finished:  # the consumer went away (or add_request failed): free what it holds, now
                await asyncio.shield(self._abort_if_running(request_id))

    async def _abort_if_running(self, request_id: str) -> None:
        if self.errored is not None:  # the engine thread has ended: there is nothing left to free
            return

        def abort():
            if self.engine.is_running(request_id):
                self.engine.abort_request(request_id)
                return True
            return False

        if await self.run(abort):
            self.num_aborted += 1

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (its stream ends with an aborted output)."""
        await self._abort_if_running(str(request_id))
        stream = self._streams.get(str(request_id))
        if stream is not None:
            stream.put(await self.run(self.engine.output, str(request_id)))

    async def get_metrics(self) -> list:
        """The engine's metrics, read on its thread between steps (kvlab.engine.metrics)."""
        return await self.run(self.engine.get_metrics)

    async def shutdown(self) -> None:
        """End the engine thread (after the step it is in); the engine keeps its state."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._calls.put(_STOP)
            await asyncio.get_running_loop().run_in_executor(None, thread.join)
        self._thread = None
