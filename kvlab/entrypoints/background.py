"""`kvlab serve` inside a notebook or a test: the same server, in a background thread, stopped on exit.

    server = BackgroundServer(LLMEngine(model, tokenizer, ...))    # starts on a free port
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    ...
    server.stop()                                                   # or leave it: the kernel's exit stops it
"""

import atexit
import socket
import threading
import time

from kvlab.engine.async_llm import AsyncLLM
from kvlab.entrypoints.openai.api_server import build_app


class BackgroundServer:
    """uvicorn serving build_app(AsyncLLM(engine)) on host:port (0: a free port) in a daemon thread."""

    def __init__(self, engine, model_name: str | list[str] = "kvlab-embedded", host: str = "127.0.0.1",
                 port: int = 0, start_timeout_s: float = 30.0):
        import uvicorn

        if port == 0:
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
        self.engine = engine
        self.async_llm = AsyncLLM(engine)
        self.app = build_app(self.async_llm, model_name, engine.tokenizer)
        self.model_name = model_name if isinstance(model_name, str) else model_name[0]  # the name answers carry
        self.base_url = f"http://{host}:{port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level="error"))
        self._thread = threading.Thread(target=self._server.run, name="kvlab-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.base_url} (is the port taken?)")
            time.sleep(0.02)
        atexit.register(self.stop)  # a notebook kernel that shuts down takes its server with it

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop serving (open requests are cancelled) and wait for the thread to end."""
        if self._thread.is_alive():
            self._server.should_exit = True
            self._thread.join(10)
        atexit.unregister(self.stop)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
