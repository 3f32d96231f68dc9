"""kvlab's OpenAI-compatible server on FastAPI and uvicorn, the stack `vllm serve` uses.

    GET  /health                 200 while the engine loop is alive
    GET  /v1/models              the one served model
    POST /v1/completions         text or token-id prompts; stream: true sends server-sent events (serving_completion)
    POST /v1/chat/completions    messages through the chat template (serving_chat, chat_template)
    GET  /metrics                Prometheus text, vLLM's metric names

Requests take every shape OpenAI's API and vLLM accept (protocol: content as a string or text parts,
vLLM's stream options and extra sampling fields, unknown fields ignored with a logged warning).
Errors have vLLM's body, {"error": {"message", "type", "param", "code"}} with code the HTTP status:
malformed JSON, wrong types and out-of-range values (400), what kvlab cannot answer such as logprobs
or an image part (400), an unknown model (404), a prompt beyond the context (400). One bad request
never stops the others (serving_engine).
"""

import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from kvlab.engine.async_llm import AsyncLLM
from kvlab.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvlab.entrypoints.openai.serving_chat import OpenAIServingChat
from kvlab.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kvlab.entrypoints.openai.serving_engine import OpenAIError, validation_error
from kvlab.entrypoints.prometheus import exposition


def build_app(async_llm: AsyncLLM, model_name: str | list[str], tokenizer) -> FastAPI:
    """The FastAPI app serving async_llm's engine under model_name (or several names, the first one answering)."""
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"the served model name must be one or more non-empty strings, got {model_name!r}")
    app = FastAPI(title="kvlab", description="kvlab's OpenAI-compatible server")
    app.state.async_llm = async_llm
    completions = OpenAIServingCompletion(async_llm, names)
    chat = OpenAIServingChat(async_llm, names, tokenizer)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        return validation_error(err).response()

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, err: OpenAIError):
        return err.response()

    @app.get("/health")
    async def health():
        if async_llm.errored is not None:
            return OpenAIError(503, f"the engine loop has stopped: {async_llm.errored!r}").response()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "kvlab", "root": names[0],
                                            "max_model_len": async_llm.engine.max_model_len} for name in names]}

    @app.get("/metrics")
    async def metrics():
        body = exposition(await async_llm.get_metrics(), names[0])
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        return await completions.create_completion(body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await chat.create_chat_completion(body, request)

    return app
