"""What the OpenAI endpoints share (vLLM's entrypoints/openai/serving_engine.py): checking a request against the
engine, running its prompts through AsyncLLM, collecting or streaming the completions, vLLM's error body.

A request is checked whole before any of its prompts runs: the model name (404), what kvlab cannot answer
(400, protocol's rules; the fields it accepts and does not apply are logged), the context (400: prompt
plus max_tokens beyond max_model_len, as vLLM answers), then every prompt through the engine's own
InputProcessor, whose refusal (a RequestRejected naming the field) becomes the 400's message and param
as it is. Stop strings, min_tokens, n > 1 and detokenisation are the engine's; an endpoint only turns
RequestOutputs into OpenAI's JSON. As vLLM's server does, a stream asks the engine for DELTA outputs (each
step's new text, detokenised incrementally) and a plain request for FINAL_ONLY (one output at the end).
A client that goes away, streaming or not, aborts its request, which frees its blocks at once.
"""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from kvlab.engine.async_llm import AsyncLLM
from kvlab.engine.input_processor import RequestRejected
from kvlab.engine.sampling_params import RequestOutputKind, SamplingParams
from kvlab.entrypoints.openai.protocol import FieldError, logger

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
               501: "NotImplementedError", 503: "ServiceUnavailableError"}


class OpenAIError(Exception):
    """An error answered with vLLM's body, {"error": {"message", "type", "param", "code"}}, code the HTTP status.

    vLLM builds it in create_error_response (vllm/entrypoints/openai/serving_engine.py; in newer releases
    vllm/entrypoints/serve/exception_handler/error_response.py): type "BadRequestError" for a 400,
    "NotFoundError" for a 404. OpenAI's own API puts a string code there; vLLM's clients read both.
    """

    def __init__(self, status: int, message: str, type_: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or ERROR_TYPES.get(status, "BadRequestError")

    @classmethod
    def rejected(cls, err: RequestRejected) -> "OpenAIError":
        """The engine's refusal as a 400, its message and field as they are."""
        return cls(400, err.message, param=err.param)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.body())


def _clean_loc(loc) -> list[str]:
    """A pydantic error location without its union-branch markers ('list[int]', 'str', 'function-after[...]')."""
    return [str(p) for p in loc if p != "body" and not any(c in str(p) for c in "[](){}")
            and str(p) not in ("str", "int", "float", "bool", "list", "dict", "none")]


def validation_error(err: RequestValidationError) -> OpenAIError:
    """pydantic's most telling complaint about a request body, as a 400 naming the field."""
    errors = err.errors()
    if not errors:
        return OpenAIError(400, "the request body is not valid")
    if any(e.get("type") == "json_invalid" for e in errors):
        return OpenAIError(400, "the request body is not valid JSON")
    # A check of kvlab's own (FieldError) says most; otherwise the error that reached deepest into the
    # body, which for a union (prompt: str | list[int] ...) is the branch the value came closest to.
    first = next((e for e in errors if isinstance((e.get("ctx") or {}).get("error"), FieldError)), None)
    first = first or max(errors, key=lambda e: len(_clean_loc(e.get("loc", ()))))
    loc = _clean_loc(first.get("loc", ()))
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        if loc[-1:] != [cause.param]:  # a field's own validator is already located at the field
            loc.append(cause.param)
        message = str(cause)
    else:
        message = first.get("msg", "invalid value").removeprefix("Value error, ")
    param = ".".join(loc) or None
    return OpenAIError(400, f"{param or 'body'}: {message}", param=param)


# One completion's progress: (text so far, finish reason or None, tokens generated).
Row = tuple[str, str | None, int]


class OpenAIServing:
    """One served model: request checks, and running prompts to a result or a stream of server-sent events."""

    def __init__(self, async_llm: AsyncLLM, model_names: str | list[str]):
        self.async_llm = async_llm
        self.engine = async_llm.engine
        self.model_names = [model_names] if isinstance(model_names, str) else list(model_names)
        self.model_name = self.model_names[0]  # the name answers carry, as vLLM's first --served-model-name

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves "
                                   f"{' or '.join(map(repr, self.model_names))}", param="model")

    def check_request(self, body) -> None:
        """Refuse what kvlab cannot answer (a 400 naming the field); log what it accepts and does not apply."""
        self.check_model(body.model)
        for field, why in body.unsupported():
            raise OpenAIError(400, f"{field}: {why}", param=field)
        if ignored := body.ignored():
            logger.warning("kvlab accepts and ignores these request fields, as vLLM ignores fields it does not "
                           "support: %s", ", ".join(ignored))

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
                try:  # vLLM's defaults for what the body leaves out (its _DEFAULT_SAMPLING_PARAMS)
                    sampling = SamplingParams(
                        n=body.n, temperature=1.0 if body.temperature is None else body.temperature,
                        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                        max_tokens=limit, seed=body.seed, ignore_eos=body.ignore_eos, stop=body.stop or [],
                        stop_token_ids=body.stop_token_ids or [], min_tokens=body.min_tokens,
                        output_kind=RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY,
                        extra_args={"kv_transfer_params": body.kv_transfer_params}
                        if body.kv_transfer_params is not None else None)
                except ValueError as err:
                    raise OpenAIError(400, str(err)) from None
                processor.process(prompt_ids, sampling)
                ids.append(prompt_ids)
                params.append(sampling)
        except RequestRejected as err:
            raise OpenAIError.rejected(err) from None
        return ids, params

    async def run_prompt(self, prompt_ids, params: SamplingParams, request_id: str,
                         include_stop_str: bool = False, kv_params: dict | None = None) -> AsyncIterator[list[Row]]:
        """Per output of the engine: one Row per completion of the prompt, holding the text new since the last Row
        (whatever output kind the params ask for), its finish reason the first time it finishes, and its tokens so far.
        kv_params, if given, receives the KV connector's params for a peer under "kv_transfer_params".
        """
        n = params.n
        delta = params.output_kind is RequestOutputKind.DELTA
        shown, tokens, ended = [0] * n, [0] * n, [False] * n
        try:
            async for out in self.async_llm.generate(prompt_ids, params, request_id):
                if kv_params is not None and out.kv_transfer_params is not None:
                    kv_params["kv_transfer_params"] = out.kv_transfer_params
                rows = []
                for j, c in enumerate(out.outputs):
                    if ended[j]:  # a finished completion of an n > 1 request, while its siblings run on
                        rows.append(("", None, tokens[j]))
                        continue
                    if delta:
                        text = c.text
                        tokens[j] += len(c.token_ids)
                    else:
                        text, shown[j], tokens[j] = c.text[shown[j]:], len(c.text), len(c.token_ids)
                    reason = c.finish_reason if c.finish_reason in ("stop", "length") else None
                    if reason:
                        ended[j] = True
                        if include_stop_str and c.stop_reason:
                            text += c.stop_reason
                    rows.append((text, reason, tokens[j]))
                yield rows
        except RequestRejected as err:
            raise OpenAIError.rejected(err) from None
        except ValueError as err:  # e.g. a request id already in use
            raise OpenAIError(400, str(err)) from None

    async def collect(self, prompt_ids, params, base_id: str, include_stop_str: bool = False,
                      kv_params: dict | None = None) -> list[list[Row]]:
        """The final Rows of every prompt (each completion's whole text), all prompts running at once; kv_params
        receives the first prompt's KV connector params (vLLM's responses carry one set, the first result's)."""
        async def last(i):
            rows = None
            async for new in self.run_prompt(prompt_ids[i], params[i], f"{base_id}-{i}", include_stop_str,
                                             kv_params if i == 0 else None):
                rows = new if rows is None else [(text + more, reason or done, count) for (text, done, _), (
                    more, reason, count) in zip(rows, new)]
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

    async def deltas(self, body, prompt_ids, params, base_id: str, prefix: Callable | None = None):
        """(choice index, new text, finish reason, tokens so far) per piece of any completion, or an OpenAIError.

        One prompt (the common case) is read straight from its stream; several run as tasks feeding one queue,
        so that every prompt's pieces go out as they come.
        """
        n = params[0].n

        async def pieces(i):
            if prefix is not None:
                for j in range(n):
                    yield i * n + j, prefix(i), None, 0
            async with contextlib.aclosing(self.run_prompt(prompt_ids[i], params[i], f"{base_id}-{i}",
                                                           body.include_stop_str_in_output)) as rows_stream:
                async for rows in rows_stream:
                    for j, (text, reason, tokens) in enumerate(rows):
                        if text or reason:
                            yield i * n + j, text, reason, tokens

        if len(prompt_ids) == 1:
            try:
                async with contextlib.aclosing(pieces(0)) as only:
                    async for item in only:
                        yield item
            except OpenAIError as err:
                yield err
            return

        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i):
            try:
                async for item in pieces(i):
                    await queue.put(item)
            except OpenAIError as err:
                await queue.put(err)
            finally:
                await queue.put(None)

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(prompt_ids))]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                else:
                    yield item
        finally:
            for task in tasks:  # a client that left cancels this generator: every prompt's request aborts
                task.cancel()

    async def stream(self, body, prompt_ids, params, base_id: str, chunk: Callable,
                     usage_chunk: Callable, prefix: Callable | None = None) -> AsyncIterator[bytes]:
        """Server-sent events: chunk(index, delta, finish_reason) per new piece of text, then usage_chunk(usage)
        when stream_options.include_usage asks for it (OpenAI's rule), then [DONE].

        With vLLM's stream_options.continuous_usage_stats every chunk also carries its prompt's usage so far.
        prefix(i) is text sent first for each of prompt i's completions (echo).
        """
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options.continuous_usage_stats)
        n = params[0].n
        finals: dict[int, int] = {}
        async with contextlib.aclosing(self.deltas(body, prompt_ids, params, base_id, prefix)) as items:
            async for item in items:
                if isinstance(item, OpenAIError):
                    yield f"data: {json.dumps(item.body())}\n\n".encode()
                    continue
                index, delta, reason, tokens = item
                if reason:
                    finals[index] = tokens
                event = chunk(index, delta, reason)
                if continuous:
                    p_len = len(prompt_ids[index // n])
                    event["usage"] = {"prompt_tokens": p_len, "completion_tokens": tokens,
                                      "total_tokens": p_len + tokens}
                yield f"data: {json.dumps(event)}\n\n".encode()
        if include_usage:
            stats = {"prompt_tokens": sum(map(len, prompt_ids)), "completion_tokens": sum(finals.values())}
            stats["total_tokens"] = stats["prompt_tokens"] + stats["completion_tokens"]
            yield f"data: {json.dumps(usage_chunk(stats))}\n\n".encode()
        yield b"data: [DONE]\n\n"
