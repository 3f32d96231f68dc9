"""`kvlab proxy`: one OpenAI endpoint in front of a prefill server and a decode server (vLLM's toy_proxy_server.py).

    kvlab serve default --port 8100 --kv-transfer-config '{"kv_connector": "SocketConnector", "kv_role": "kv_producer"}'
    kvlab serve default --port 8200 --kv-transfer-config '{"kv_connector": "SocketConnector", "kv_role": "kv_consumer"}'
    kvlab proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Each completion or chat request goes twice, as in vLLM's proxy:

1. to the prefill server, with max_tokens=1 (and max_completion_tokens=1), stream false and kv_transfer_params
   {"do_remote_decode": true}: it computes the prompt, keeps its blocks and answers with kv_transfer_params
   naming them (kvlab.kv_transfer.socket_connector);
2. to the decode server, the client's own request plus those kv_transfer_params: it pulls the blocks, decodes,
   and its answer (a stream of server-sent events when the client asked for one) goes back to the client as is.

When the prefill server cannot be reached, times out or fails (a 5xx), the client gets a JSON error in vLLM's
body naming what failed: 502 (refused or failed) or 504 (timed out). With --fallback-local-prefill the request
goes to the decode server alone instead, which then computes the prompt itself: slower, same tokens. A 4xx from
the prefill server is the request's own fault (a bad field) and is returned as it is. GET /health answers 200
when the decode server is healthy and the prefill server is too (or the fallback covers it), 503 otherwise.
"""

import argparse
import contextlib
import json
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("kvlab.entrypoints.disagg_proxy")

ERROR_TYPES = {400: "BadRequestError", 502: "BadGatewayError", 503: "ServiceUnavailableError",
               504: "GatewayTimeoutError"}


def error(status: int, message: str) -> JSONResponse:
    """vLLM's error body, {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": ERROR_TYPES.get(
        status, "InternalServerError"), "param": None, "code": status}})


def prefill_request(body: dict, chat: bool) -> dict:
    """The client's request as the prefill server gets it: one token of one completion, no stream, do_remote_decode
    (n=1: the decode server samples the n completions from one prompt's blocks; n prefills would each hold blocks
    that only one pull releases)."""
    out = dict(body, max_tokens=1, n=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    out.pop("stream_options", None)  # only allowed with stream true
    if chat:
        out["max_completion_tokens"] = 1
    # min_tokens above one would contradict max_tokens=1.
    if out.get("min_tokens"):
        out["min_tokens"] = 1
    return out


def check_url(name: str, url: str) -> str:
    """A server's base URL (http://host:port), without a trailing slash; ValueError naming the flag otherwise."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{name} must be a server's base URL such as http://127.0.0.1:8100, got {url!r}")
    return url.rstrip("/")


def build_proxy_app(prefill_url: str, decode_url: str, fallback_local_prefill: bool = False,
                    prefill_timeout_s: float = 120.0, decode_timeout_s: float = 600.0) -> FastAPI:
    """The proxy's FastAPI app: /v1/completions, /v1/chat/completions, /v1/models and /health."""
    prefill_url, decode_url = check_url("prefill", prefill_url), check_url("decode", decode_url)
    for name, value in (("prefill_timeout_s", prefill_timeout_s), ("decode_timeout_s", decode_timeout_s)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await app.state.prefill.aclose()
        await app.state.decode.aclose()

    app = FastAPI(title="kvlab disaggregated prefill/decode proxy", lifespan=lifespan)
    app.state.prefill = httpx.AsyncClient(base_url=prefill_url, timeout=prefill_timeout_s)
    app.state.decode = httpx.AsyncClient(base_url=decode_url, timeout=decode_timeout_s)
    app.state.num_fallbacks = 0

    async def prefill(path: str, body: dict, chat: bool) -> dict | JSONResponse:
        """The prefill server's kv_transfer_params (may be {}), or the error response for the client."""
        try:
            reply = await app.state.prefill.post(path, json=prefill_request(body, chat))
        except httpx.TimeoutException:
            return error(504, f"the prefill server {prefill_url} did not answer {path} within "
                              f"{prefill_timeout_s:g} s")
        except httpx.HTTPError as err:
            return error(502, f"the prefill server {prefill_url} could not be reached for {path}: "
                              f"{type(err).__name__}: {err}")
        if 400 <= reply.status_code < 500:  # the request's own fault: the client sees the server's answer
            return JSONResponse(status_code=reply.status_code, content=_json_or_text(reply))
        if reply.status_code != 200:
            return error(502, f"the prefill server {prefill_url} failed {path} with HTTP {reply.status_code}: "
                              f"{reply.text[:300]}")
        return reply.json().get("kv_transfer_params") or {}

    async def forward(path: str, request: Request, chat: bool):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        params = await prefill(path, body, chat)
        if isinstance(params, JSONResponse):
            if not fallback_local_prefill or params.status_code < 500:
                return params
            logger.warning("prefill failed (%s); --fallback-local-prefill: the decode server computes the prompt",
                           json.loads(params.body)["error"]["message"])
            app.state.num_fallbacks += 1
            params = {}
        decode_body = dict(body, kv_transfer_params=params) if params else body
        client = app.state.decode
        try:
            reply = await client.send(client.build_request("POST", path, json=decode_body), stream=True)
        except httpx.TimeoutException:
            return error(504, f"the decode server {decode_url} did not answer {path} within {decode_timeout_s:g} s")
        except httpx.HTTPError as err:
            return error(502, f"the decode server {decode_url} could not be reached for {path}: "
                              f"{type(err).__name__}: {err}")
        if body.get("stream") and reply.status_code == 200:
            return StreamingResponse(_relay(reply), status_code=200,
                                     media_type=reply.headers.get("content-type", "text/event-stream"))
        content = await reply.aread()
        await reply.aclose()
        return Response(content, status_code=reply.status_code,
                        media_type=reply.headers.get("content-type", "application/json"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward("/v1/completions", request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await forward("/v1/chat/completions", request, chat=True)

    @app.get("/v1/models")
    async def models():
        try:
            reply = await app.state.decode.get("/v1/models")
        except httpx.HTTPError as err:
            return error(502, f"the decode server {decode_url} could not be reached: {type(err).__name__}: {err}")
        return JSONResponse(status_code=reply.status_code, content=_json_or_text(reply))

    @app.get("/health")
    async def health():
        status = {}
        for name, client in (("prefill", app.state.prefill), ("decode", app.state.decode)):
            try:
                reply = await client.get("/health", timeout=5.0)
                status[name] = "ok" if reply.status_code == 200 else f"HTTP {reply.status_code}"
            except httpx.HTTPError as err:
                status[name] = f"unreachable ({type(err).__name__})"
        healthy = status["decode"] == "ok" and (status["prefill"] == "ok" or fallback_local_prefill)
        return JSONResponse(status_code=200 if healthy else 503, content=status)

    return app


async def _relay(reply: httpx.Response):
    """The decode server's stream, chunk by chunk as it comes; closed when the client or the server is done."""
    try:
        async for chunk in reply.aiter_raw():
            yield chunk
    finally:
        await reply.aclose()


def _json_or_text(reply: httpx.Response):
    try:
        return reply.json()
    except ValueError:
        return {"error": {"message": reply.text[:300], "type": "BadGatewayError", "param": None,
                          "code": reply.status_code}}


def proxy_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `kvlab proxy`."""
    parser.add_argument("--prefill", required=True, metavar="URL", help="the prefill server (kv_producer)")
    parser.add_argument("--decode", required=True, metavar="URL", help="the decode server (kv_consumer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--fallback-local-prefill", action="store_true",
                        help="when the prefill server fails, send the request to the decode server alone")
    parser.add_argument("--prefill-timeout-s", type=float, default=120.0)
    parser.add_argument("--decode-timeout-s", type=float, default=600.0)
    parser.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    return parser
