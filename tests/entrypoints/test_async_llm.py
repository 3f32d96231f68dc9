"""AsyncLLM: requests join while the engine steps, tokens stream, the loop stays free, consumers that leave abort."""

import asyncio

import pytest

from kvlab import SamplingParams, load_model
from kvlab.engine.async_llm import AsyncLLM
from kvlab.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def embedded_model():
    return load_model()


def make(embedded_model, **kwargs):
    model, tokenizer = embedded_model
    return AsyncLLM(LLMEngine(model, tokenizer, block_size=16, num_blocks=32, max_num_seqs=4, **kwargs))


def test_streams_grow_and_match_the_offline_engine(embedded_model):
    model, tokenizer = embedded_model
    offline = LLMEngine(model, tokenizer, block_size=16, num_blocks=32)
    offline.add_request("x", "OTHELLO.\n", SamplingParams(temperature=0, max_tokens=20))
    while offline.has_unfinished_requests():
        offline.step()
    want = offline.output("x").outputs[0].text

    async def run():
        llm = make(embedded_model)
        seen = []
        async for out in llm.generate("OTHELLO.\n", SamplingParams(temperature=0, max_tokens=20)):
            seen.append(out.outputs[0].text)
        await llm.shutdown()
        return seen

    seen = asyncio.run(run())
    assert seen[-1] == want and len(seen) > 5, "an output per step (steps the consumer missed merged), the last whole"
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:])), "each output extends the one before"


def test_the_event_loop_runs_while_the_engine_steps(embedded_model):
    async def run():
        llm = make(embedded_model)
        ticks = []
        stop = asyncio.Event()

        async def ticker():
            while not stop.is_set():
                ticks.append(llm.engine.step_count)
                # A short sleep, not sleep(0): a loop that never waits would hold the GIL against the engine thread.
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        async for _ in llm.generate("HAMLET.\n", SamplingParams(temperature=0, max_tokens=60)):
            pass
        stop.set()
        await task
        await llm.shutdown()
        return ticks

    ticks = asyncio.run(run())
    assert len(set(ticks)) > 10, "the ticker must run between engine steps, not only before and after them"


def test_a_consumer_that_leaves_aborts_its_request(embedded_model):
    async def run():
        llm = make(embedded_model)
        stream = llm.generate("ROMEO.\n", SamplingParams(temperature=0, max_tokens=200))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await stream.aclose()
        other = [o async for o in llm.generate("JULIET.\n", SamplingParams(temperature=0, max_tokens=5))]
        await llm.shutdown()
        return llm, other

    llm, other = asyncio.run(run())
    engine = llm.engine
    assert llm.num_aborted == 1 and not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks, "the abandoned request's blocks came back"
    assert other[-1].finished and len(other[-1].outputs[0].token_ids) == 5


def test_a_bad_request_raises_and_the_others_continue(embedded_model):
    async def run():
        llm = make(embedded_model)
        good = asyncio.ensure_future(_collect(llm.generate("ROMEO.\n", SamplingParams(max_tokens=30))))
        with pytest.raises(ValueError, match="max_model_len"):
            await _collect(llm.generate("x" * 400, SamplingParams(max_tokens=5)))
        result = await good
        await llm.shutdown()
        return result

    assert len(asyncio.run(run())[-1].outputs[0].token_ids) == 30


def test_abort_by_id_ends_the_stream(embedded_model):
    async def run():
        llm = make(embedded_model)
        outs = []

        async def consume():
            async for out in llm.generate("ROMEO.\n", SamplingParams(max_tokens=200), request_id="r1"):
                outs.append(out)

        task = asyncio.ensure_future(consume())
        while not outs:
            await asyncio.sleep(0)
        await llm.abort("r1")
        await task
        await llm.shutdown()
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"


async def _collect(stream):
    return [out async for out in stream]
