"""Helpers for the server tests: a kvlab server in a background thread on a free port, and waiting until idle."""

import socket
import threading
import time


def start_server(**engine_args):
    """(base_url, server, async_llm, thread) for a uvicorn server on 127.0.0.1 serving a fresh engine."""
    import uvicorn

    from kvlab import load_model
    from kvlab.engine.async_llm import AsyncLLM
    from kvlab.engine.llm_engine import LLMEngine
    from kvlab.entrypoints.openai.api_server import build_app

    model, tokenizer = load_model()
    engine = LLMEngine(model, tokenizer, **engine_args)
    async_llm = AsyncLLM(engine)
    app = build_app(async_llm, "kvlab-embedded", tokenizer)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(600):
        if server.started:
            break
        time.sleep(0.05)
    assert server.started, "the test server did not start"
    return f"http://127.0.0.1:{port}", server, async_llm, thread


def wait_idle(async_llm, rounds: int = 400) -> None:
    """Until the engine has no request left (aborts run on the engine's thread; give them a moment)."""
    engine = async_llm.engine
    for _ in range(rounds):
        if not engine.has_unfinished_requests():
            return
        time.sleep(0.025)
