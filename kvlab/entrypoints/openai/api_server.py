"""kvlab's OpenAI-compatible server on FastAPI and uvicorn, the stack `vllm serve` uses.

    GET  /health                 200 while the engine loop is alive
    GET  /v1/models              the one served model
    POST /v1/completions         text or token-id prompts; stream: true sends server-sent events
    POST /v1/chat/completions    messages through the chat template (chat_template.py)
    GET  /metrics                Prometheus text, vLLM's metric names

Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with a 4xx status:
malformed JSON, unknown fields, wrong types and out-of-range values (400), an unknown model (404),
a prompt beyond the context (400). One bad request never stops the others. A client that goes away,
streaming or not, aborts its request, which frees its blocks at once.
"""

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvlab.engine.async_llm import AsyncLLM
from kvlab.engine.sampling_params import SamplingParams
from kvlab.entrypoints.openai.chat_template import render_chat
from kvlab.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvlab.entrypoints.prometheus import exposition

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


class OpenAIError(Exception):
    """An error to answer with OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": self.message, "type": self.type, "param": self.param, "code": self.code}})


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    first = err.errors()[0] if err.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") == "extra_forbidden":
        return f"unknown field {'.'.join(loc)!r}: kvlab does not support it", ".".join(loc) or None
    return f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}", ".".join(loc) or None


class StopStrings:
    """Cuts a completion's text at the first stop string; holds back a tail that could still begin one."""

    def __init__(self, stops: list[str]):
        self.stops = [stops] if isinstance(stops, str) else list(stops or [])
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def check(self, text: str) -> tuple[str, bool]:
        """(text that is final so far, whether a stop string ended it)."""
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            return text[:cut], True
        return (text[:len(text) - self.hold] if self.hold else text), False


def build_app(async_llm: AsyncLLM, model_name: str, tokenizer) -> FastAPI:
    """The FastAPI app serving async_llm's engine under model_name."""
    app = FastAPI(title="kvlab", description="kvlab's OpenAI-compatible server")
    engine = async_llm.engine
    app.state.async_llm = async_llm

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        message, param = _validation_message(err)
        return OpenAIError(400, message, param=param).response()

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, err: OpenAIError):
        return err.response()

    @app.get("/health")
    async def health():
        if async_llm.errored is not None:
            return JSONResponse(status_code=503, content={"error": {"message": repr(async_llm.errored),
                                                                    "type": "internal_error"}})
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "kvlab", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        body = exposition(await async_llm.get_metrics(), model_name)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                              param="model", code="model_not_found")

    def tokenize(prompt) -> list[int]:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise OpenAIError(400, "this server has no tokenizer: send token ids", param="prompt")
            return list(tokenizer(prompt, verbose=False)["input_ids"])  # too long is a 400 below, not a warning
        return list(prompt)

    def sampling_params(body, prompt_len: int, max_tokens: int | None) -> SamplingParams:
        if max_tokens is None:  # chat without a limit: up to the context, as vLLM does
            max_tokens = max(1, engine.max_model_len - prompt_len)
        elif prompt_len + max_tokens > engine.max_model_len and prompt_len < engine.max_model_len:
            raise OpenAIError(400, f"this model's maximum context length is {engine.max_model_len} tokens; you asked "
                                   f"for {prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to "
                                   f"generate)", param="max_tokens")
        try:
            return SamplingParams(n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                  max_tokens=max_tokens, seed=body.seed, ignore_eos=body.ignore_eos)
        except ValueError as err:
            raise OpenAIError(400, str(err)) from None

    def finish_reason(output, stopped: bool) -> str | None:
        return "stop" if stopped else output.finish_reason if output.finish_reason in ("stop", "length") else None

    async def run_prompt(prompt_ids, params, stops: StopStrings, request_id: str) -> AsyncIterator[list]:
        """Per step: one (text_so_far, finish_reason or None, num_tokens) per completion of the prompt."""
        stopped = [False] * params.n
        try:
            async for out in async_llm.generate(prompt_ids, params, request_id):
                row = []
                for i, c in enumerate(out.outputs):
                    text, hit = stops.check(c.text)
                    if c.finish_reason is not None and not hit:
                        text = c.text  # finished by length or EOS: nothing held back any more
                    stopped[i] = stopped[i] or hit
                    row.append((text, finish_reason(c, stopped[i]), len(c.token_ids)))
                yield row
                if all(s or c.finish_reason for s, c in zip(stopped, out.outputs)):
                    return  # every completion met a stop string: the generator's close aborts the rest
        except ValueError as err:
            raise OpenAIError(400, str(err), param="prompt") from None

    async def prepare(body, prompts) -> tuple[list[list[int]], list[SamplingParams]]:
        """Token ids and params per prompt, every one checked against the engine's limits before any runs."""
        ids = [tokenize(p) for p in prompts]
        limit = body.max_tokens if not isinstance(body, ChatCompletionRequest) \
            else (body.max_completion_tokens or body.max_tokens)
        params = [sampling_params(body, len(p), limit) for p in ids]
        for p, sp in zip(ids, params):
            try:
                engine.check_request(p, sp)
            except ValueError as err:
                message = str(err).replace("request 'request': its prompt", "the prompt")
                raise OpenAIError(400, message.replace("request 'request'", "the request"), param="prompt") from None
        return ids, params

    async def until_disconnected(request: Request, coro):
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

    def usage(prompt_ids, finals) -> dict:
        prompt_tokens = sum(len(p) for p in prompt_ids)
        completion = sum(n for rows in finals for _, _, n in rows)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    async def collect(prompt_ids, params, stops, base_id) -> list[list]:
        async def last(i):
            rows = None
            async for rows in run_prompt(prompt_ids[i], params[i], stops, f"{base_id}-{i}"):
                pass
            return rows

        return await asyncio.gather(*(last(i) for i in range(len(prompt_ids))))

    async def stream(prompt_ids, params, stops, base_id, chunk, include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events: chunk(index, delta, finish_reason) per new piece of text, then usage (only when
        stream_options.include_usage asks for it, OpenAI's rule), then [DONE]."""
        queue: asyncio.Queue = asyncio.Queue()
        n = params[0].n

        async def pump(i):
            sent = [0] * n
            try:
                async for rows in run_prompt(prompt_ids[i], params[i], stops, f"{base_id}-{i}"):
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
        stats = {"prompt_tokens": sum(map(len, prompt_ids)), "completion_tokens": sum(finals.values())}
        stats["total_tokens"] = stats["prompt_tokens"] + stats["completion_tokens"]
        if include_usage:
            yield f"data: {json.dumps(chunk(None, None, None, usage=stats))}\n\n".encode()
        yield b"data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompt_ids, params = await prepare(body, prompts)
        stops, base_id, created = StopStrings(body.stop), f"cmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        if body.stream:
            def chunk(index, delta, reason, usage=None):
                if usage is not None:
                    return {"id": base_id, "object": "text_completion", "created": created, "model": model_name,
                            "choices": [], "usage": usage}
                return {"id": base_id, "object": "text_completion", "created": created, "model": model_name,
                        "choices": [{"index": index, "text": delta, "logprobs": None, "finish_reason": reason}]}
            return StreamingResponse(stream(prompt_ids, params, stops, base_id, chunk, include_usage),
                                     media_type="text/event-stream")
        finals = await until_disconnected(request, collect(prompt_ids, params, stops, base_id))
        n = params[0].n
        choices = [{"index": i * n + j, "text": text, "logprobs": None, "finish_reason": reason}
                   for i, rows in enumerate(finals) for j, (text, reason, _) in enumerate(rows)]
        return {"id": base_id, "object": "text_completion", "created": created, "model": model_name,
                "choices": choices, "usage": usage(prompt_ids, finals)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        prompt = render_chat([m.model_dump() for m in body.messages], tokenizer)
        prompt_ids, params = await prepare(body, [prompt])
        stops, base_id, created = StopStrings(body.stop), f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        if body.stream:
            started: set[int] = set()

            def chunk(index, delta, reason, usage=None):
                base = {"id": base_id, "object": "chat.completion.chunk", "created": created, "model": model_name}
                if usage is not None:
                    return {**base, "choices": [], "usage": usage}
                message = {"content": delta}
                if index not in started:  # the first chunk of a choice names the role, as OpenAI's do
                    started.add(index)
                    message = {"role": "assistant", "content": delta}
                return {**base, "choices": [{"index": index, "delta": message, "logprobs": None,
                                             "finish_reason": reason}]}
            return StreamingResponse(stream(prompt_ids, params, stops, base_id, chunk, include_usage),
                                     media_type="text/event-stream")
        finals = await until_disconnected(request, collect(prompt_ids, params, stops, base_id))
        choices = [{"index": j, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": reason} for j, (text, reason, _) in enumerate(finals[0])]
        return {"id": base_id, "object": "chat.completion", "created": created, "model": model_name,
                "choices": choices, "usage": usage(prompt_ids, finals)}

    return app

