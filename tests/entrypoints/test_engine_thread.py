"""AsyncLLM's engine thread runs a busy loop of its own (vLLM's EngineCore shape): it steps without waiting for the
event loop, and a step that fails reaches every stream and every later call instead of hanging them."""

import asyncio
import time

import pytest

from kvlab import SamplingParams, load_model
from kvlab.engine.async_llm import AsyncLLM
from kvlab.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def embedded_model():
    return load_model()


def make(embedded_model):
    model, tokenizer = embedded_model
    return AsyncLLM(LLMEngine(model, tokenizer, block_size=16, num_blocks=32, max_num_seqs=4))


def test_the_engine_keeps_stepping_while_the_event_loop_is_busy(embedded_model):
    async def run():
        llm = make(embedded_model)
        stream = llm.generate("OTHELLO.\n", SamplingParams(temperature=0, max_tokens=120))
        first = await anext(stream)
        before = llm.engine.step_count
        time.sleep(0.4)  # the event loop does nothing else for 0.4 s: no task of it runs
        during = llm.engine.step_count - before
        outs = [first] + [out async for out in stream]
        await llm.shutdown()
        return during, outs

    during, outs = asyncio.run(run())
    assert during >= 3, (
        f"the engine took {during} steps while the event loop was blocked: its thread must step on by itself, "
        "not wait for the loop to ask for each step")
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 120, "the outputs queued meanwhile all arrive"


def test_a_failing_step_reaches_the_stream_and_later_calls(embedded_model):
    async def run():
        llm = make(embedded_model)

        def broken():
            raise RuntimeError("a bug in a step")

        llm.engine.step = broken
        with pytest.raises(RuntimeError, match="the engine loop failed") as err:
            async for _ in llm.generate("ROMEO.\n", SamplingParams(max_tokens=8)):
                pass
        assert "a bug in a step" in repr(err.value.__cause__)
        with pytest.raises(RuntimeError, match="the engine loop has stopped"):
            async for _ in llm.generate("JULIET.\n", SamplingParams(max_tokens=8)):
                pass
        await llm.shutdown()
        return llm

    assert isinstance(asyncio.run(asyncio.wait_for(run(), 30)).errored, RuntimeError), "the failure is kept"


def test_a_consumer_that_falls_behind_gets_the_missed_steps_in_one_output(embedded_model):
    from kvlab.engine.sampling_params import RequestOutputKind

    async def run(kind):
        llm = make(embedded_model)
        stream = llm.generate("OTHELLO.\n", SamplingParams(temperature=0, max_tokens=60, output_kind=kind))
        outs = [await anext(stream)]
        time.sleep(0.3)  # several steps end meanwhile
        outs.append(await anext(stream))
        outs += [out async for out in stream]
        await llm.shutdown()
        return outs

    delta = asyncio.run(run(RequestOutputKind.DELTA))
    assert len(delta[1].outputs[0].token_ids) >= 3, "the steps missed while the loop slept arrive as one DELTA output"
    assert sum(len(o.outputs[0].token_ids) for o in delta) == 60, "merged, not lost: every token arrives once"
    cumulative = asyncio.run(run(RequestOutputKind.CUMULATIVE))
    assert "".join(o.outputs[0].text for o in delta) == cumulative[-1].outputs[0].text
    assert len(cumulative[1].outputs[0].token_ids) >= 4, "a CUMULATIVE consumer that was behind gets the newest only"
