"""Online serving's engine: requests arrive while the engine steps, and each one's tokens stream out (vLLM's AsyncLLM).

    async_llm = AsyncLLM(LLMEngine(model, tokenizer, ...))
    async for out in async_llm.generate("OTHELLO.\\n", SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].text)          # the whole text so far (CUMULATIVE, the default), after every step
                                            # that moved it; output_kind=DELTA gives only the new text

One thread owns the engine. Every call into it (add a request, abort one, step, read the metrics)
runs on that thread, one after another, so the engine needs no locks and the event loop never waits
on a step: a step runs while the loop accepts connections and streams other requests' tokens. The
engine loop steps while any request is unfinished and sleeps until the next one arrives. A consumer
that stops reading (a client that disconnected, a cancelled task) aborts its request at once, which
frees its blocks.
"""

import asyncio
import concurrent.futures
import itertools
from collections.abc import AsyncIterator

from kvlab.engine.llm_engine import LLMEngine
from kvlab.engine.request import RequestOutput
from kvlab.engine.sampling_params import SamplingParams


class AsyncLLM:
    """An LLMEngine driven by an asyncio loop: generate() streams RequestOutputs; abort() stops a request."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlab-engine")
        self._streams: dict[str, asyncio.Queue] = {}
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._ids = itertools.count()
        self.num_aborted = 0
        self.errored: BaseException | None = None  # an exception the engine loop died of

    async def run(self, fn, *args):
        """fn(*args) on the engine's thread, in order with the steps; awaits its result."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._engine_loop(), name="kvlab-engine-loop")

    def _step_if_busy(self) -> list[RequestOutput] | None:
        """One engine step, or None when no request is unfinished: one hand-off to the engine's thread per step."""
        return self.engine.step() if self.engine.has_unfinished_requests() else None

    async def _engine_loop(self) -> None:
        try:
            while True:
                self._wake.clear()  # before the check: a request added after it sets the event again
                outputs = await self.run(self._step_if_busy)
                if outputs is None:
                    await self._wake.wait()
                    continue
                for out in outputs:
                    queue = self._streams.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
        except Exception as err:  # a bug in a step: every stream hears of it instead of hanging
            self.errored = err
            for queue in self._streams.values():
                queue.put_nowait(err)
            raise

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its RequestOutput after every step that gave it tokens, the finished one last.

        A bad request raises ValueError before anything is yielded (and the engine serves on).
        """
        if self.errored is not None:
            raise RuntimeError(f"the engine loop has stopped: {self.errored!r}")
        request_id = f"req-{next(self._ids)}" if request_id is None else str(request_id)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        finished = False
        try:
            await self.run(self.engine.add_request, request_id, prompt, params)
            self._ensure_loop()
            self._wake.set()
            while True:
                out = await queue.get()
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
        queue = self._streams.get(str(request_id))
        if queue is not None:
            queue.put_nowait(await self.run(self.engine.output, str(request_id)))

    async def get_metrics(self) -> list:
        """The engine's metrics, read on its thread between steps (kvlab.engine.metrics)."""
        return await self.run(self.engine.get_metrics)

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        self._executor.shutdown(wait=True)
