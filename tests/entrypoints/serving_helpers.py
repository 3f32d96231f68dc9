"""Helpers for the server tests: kvlab's BackgroundServer on the embedded model, and waiting until it is idle."""

import time


def start_server(**engine_args):
    """A BackgroundServer on a free port serving a fresh engine with engine_args."""
    from kvlab import load_model
    from kvlab.engine.llm_engine import LLMEngine
    from kvlab.entrypoints.background import BackgroundServer

    model, tokenizer = load_model()
    return BackgroundServer(LLMEngine(model, tokenizer, **engine_args))


def wait_idle(async_llm, rounds: int = 400) -> None:
    """Until the engine has no request left (aborts run on the engine's thread; give them a moment)."""
    engine = async_llm.engine
    for _ in range(rounds):
        if not engine.has_unfinished_requests():
            return
        time.sleep(0.025)


def serve_embedded():
    """(base_url, async_llm) of a server on the embedded model for one test module (a small pool: 48 blocks of 16).

    Test modules turn it into their `served` fixture: served = pytest.fixture(scope="module")(serve_embedded).
    """
    server = start_server(block_size=16, num_blocks=48, max_num_seqs=8, max_num_batched_tokens=128)
    yield server.base_url, server.async_llm
    server.stop()
    assert not server.running, "the server thread must end on stop()"
