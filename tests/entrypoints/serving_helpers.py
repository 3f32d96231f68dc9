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
