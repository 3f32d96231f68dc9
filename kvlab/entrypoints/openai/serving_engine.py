"""What the OpenAI endpoints share (vLLM's entrypoints/openai/serving_engine.py): checking a request against the
engine, running its prompts through AsyncLLM, collecting or streaming the completions, OpenAI's error body.

A request is checked whole before any of its prompts runs: the model name (404), the context (400: prompt
plus max_tokens beyond max_model_len, as vLLM answers), then every prompt through the engine's own
InputProcessor, whose refusal (a RequestRejected naming the field) becomes the 400's message and param
as it is. Stop strings, n > 1 and detokenisation are the engine's output processing; an endpoint only
turns RequestOutputs into OpenAI's JSON. A client that goes away, streaming or not, aborts its request,
which frees its blocks at once.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from kvlab.engine.async_llm import AsyncLLM
from kvlab.engine.input_processor import RequestRejected
from kvlab.engine.sampling_params import SamplingParams

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


class OpenAIError(Exception):
    """An error to answer with OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    @classmethod
    def rejected(cls, err: RequestRejected) -> "OpenAIError":
        """The engine's refusal as a 400, its message and field as they are."""
        return cls(400, err.message, param=err.param)

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": self.message, "type": self.type, "param": self.param, "code": self.code}})


def validation_error(err: RequestValidationError) -> OpenAIError:
    """pydantic's first complaint about a request body, as a 400."""
    first = err.errors()[0] if err.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return OpenAIError(400, "the request body is not valid JSON")
    if first.get("type") == "extra_forbidden":
        return OpenAIError(400, f"unknown field {'.'.join(loc)!r}: kvlab does not support it", param=".".join(loc))
    return OpenAIError(400, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}",
                       param=".".join(loc) or None)


# One completion's progress: (text so far, finish reason or None, tokens generated).
Row = tuple[str, str | None, int]


class OpenAIServing:
    """One served model: request checks, and running prompts to a result or a stream of server-sent events."""

    def __init__(self, async_llm: AsyncLLM, model_name: str):
        self.async_llm = async_llm
        self.engine = async_llm.engine
        self.model_name = model_name

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                              param="model", code="model_not_found")

    def prepare(self, body, prompts, max_tokens: int | None) -> tuple[list[list[int]], list[SamplingParams]]:
        """Token ids and params per prompt, every one checked against the engine's limits before any runs."""
        processor = self.engine.input_processor
        ids, params = [], []
        try:
            for prompt in prompts:
                _, prompt_ids = processor.tokenize(prompt)
                limit = max(1, processor.max_model_len - len(prompt_ids)) if max_tokens is None else max_tokens
                if len(prompt_ids) < processor.max_model_len:  # a prompt too long on its own is refused below
                    processor.check_context(len(prompt_ids), limit)
                try:
                    sampling = SamplingParams(n=body.n, temperature=body.temperature, top_p=body.top_p,
                                              top_k=body.top_k, max_tokens=limit, seed=body.seed,
                                              ignore_eos=body.ignore_eos, stop=body.stop or [])
                except ValueError as err:
                    raise OpenAIError(400, str(err)) from None
                processor.process(prompt_ids, sampling)
                ids.append(prompt_ids)
                params.append(sampling)
        except RequestRejected as err:
            raise OpenAIError.rejected(err) from None
        return ids, params

    async def run_prompt(self, prompt_ids, params: SamplingParams, request_id: str) -> AsyncIterator[list[Row]]:
        """Per step that moved it: one Row per completion of the prompt."""
        try:
            async for out in self.async_llm.generate(prompt_ids, params, request_id):
                yield [(c.text, c.finish_reason if c.finish_reason in ("stop", "length") else None, len(c.token_ids))
                       for c in out.outputs]
        except RequestRejected as err:
            raise OpenAIError.rejected(err) from None
        except ValueError as err:  # e.g. a request id already in use
            raise OpenAIError(400, str(err)) from None

    async def collect(self, prompt_ids, params, base_id: str) -> list[list[Row]]:
        """The final Rows of every prompt, all prompts running at once."""
        async def last(i):
            rows = None
            async for rows in self.run_prompt(prompt_ids[i], params[i], f"{base_id}-{i}"):
                pass
            return rows

        return await asyncio.gather(*(last(i) for i in range(len(prompt_ids))))

    async def until_disconnected(self, request: Request, coro):
        """coro's result, or CancelledError when the client goes away first (its request is then aborted)."""
        task = asyncio.ensure_future(coro)
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not done and await request.is_disconnected():
                    task.cancel()
                    break
            return await task
        finally:
            if not task.done():
                task.cancel()

    @staticmethod
    def usage(prompt_ids, finals) -> dict:
        prompt_tokens = sum(len(p) for p in prompt_ids)
        completion = sum(n for rows in finals for _, _, n in rows)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    async def stream(self, prompt_ids, params, base_id: str, chunk: Callable,
                     include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events: chunk(index, delta, finish_reason) per new piece of text, then usage (only when
        stream_options.include_usage asks for it, OpenAI's rule), then [DONE]."""
        queue: asyncio.Queue = asyncio.Queue()
        n = params[0].n

        async def pump(i):
            sent = [0] * n
            try:
                async for rows in self.run_prompt(prompt_ids[i], params[i], f"{base_id}-{i}"):
                    for j, (text, reason, tokens) in enumerate(rows):
                        if len(text) > sent[j] or reason:
                            await queue.put((i * n + j, text[sent[j]:], reason, tokens))
                            sent[j] = len(text)
            except OpenAIError as err:
                await queue.put(err)
            finally:
                await queue.put(None)

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(prompt_ids))]
        finals: dict[int, int] = {}
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, OpenAIError):
                    yield f"data: {json.dumps({'error': {'message': item.message, 'type': item.type}})}\n\n".encode()
                    continue
                index, delta, reason, tokens = item
                if reason:
                    finals[index] = tokens
                yield f"data: {json.dumps(chunk(index, delta, reason))}\n\n".encode()
        finally:
            for task in tasks:  # a client that left cancels this generator: every prompt's request aborts
                task.cancel()
        if include_usage:
            stats = {"prompt_tokens": sum(map(len, prompt_ids)), "completion_tokens": sum(finals.values())}
            stats["total_tokens"] = stats["prompt_tokens"] + stats["completion_tokens"]
            yield f"data: {json.dumps(chunk(None, None, None, usage=stats))}\n\n".encode()
        yield b"data: [DONE]\n\n"
