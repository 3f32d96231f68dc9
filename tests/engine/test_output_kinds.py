"""What a caller hears of a request under each RequestOutputKind, with the text detokenised incrementally:
CUMULATIVE (the whole text so far), DELTA (only what is new, as a stream sends it) and FINAL_ONLY (once)."""

import pytest

from kvlab import LLM, SamplingParams
from kvlab.engine.output_processor import OutputProcessor
from kvlab.engine.outputs import EngineCoreOutput
from kvlab.engine.request import RequestStatus
from kvlab.engine.sampling_params import RequestOutputKind

RUNNING, LENGTH = RequestStatus.RUNNING, RequestStatus.FINISHED_LENGTH


class Letters:
    """One token, one letter; counts the ids it is asked to decode."""

    def __init__(self):
        self.decoded = 0

    def decode(self, ids):
        self.decoded += len(ids)
        return "".join(chr(97 + i) for i in ids)


def steps(kind, stop=(), n_steps=6):
    tok = Letters()
    o = OutputProcessor(tok)
    o.add_request("r", None, [0], SamplingParams(output_kind=kind, stop=list(stop)), ["r"])
    got = []
    for i in range(n_steps):
        outs, _ = o.process_outputs([EngineCoreOutput("r", [i % 3, 2], LENGTH if i == n_steps - 1 else RUNNING)])
        got += [(c.text, c.token_ids, c.finish_reason) for out in outs for c in out.outputs]
    return got, tok.decoded


def test_delta_outputs_add_up_to_the_cumulative_text():
    cumulative, _ = steps(RequestOutputKind.CUMULATIVE)
    delta, _ = steps(RequestOutputKind.DELTA)
    assert [t for t, _, _ in cumulative] == ["ac", "acbc", "acbccc", "acbcccac", "acbcccacbc", "acbcccacbccc"]
    assert [t for t, _, _ in delta] == ["ac", "bc", "cc", "ac", "bc", "cc"], "DELTA: each step's new text only"
    assert [ids for _, ids, _ in delta] == [[i % 3, 2] for i in range(6)], "and only its new token ids"
    assert delta[-1][2] == "length" == cumulative[-1][2]


def test_a_stream_decodes_a_few_tokens_per_step_not_the_whole_completion():
    _, decoded = steps(RequestOutputKind.DELTA, n_steps=60)
    assert decoded <= 8 * 60, (
        f"120 tokens in 60 steps took {decoded} token decodes: a step decodes a short window (a few tokens), where "
        "decoding the whole completion every step would be about 7,000")


def test_delta_holds_back_what_could_begin_a_stop_string_and_never_takes_text_back():
    o = OutputProcessor(Letters())
    o.add_request("r", None, [0], SamplingParams(output_kind=RequestOutputKind.DELTA, stop=["cab"]), ["r"])
    texts = []
    for tokens in ([0, 1], [2], [0], [0, 1, 2]):                    # "ab" "c" "a" "abc"
        outs, stopped = o.process_outputs([EngineCoreOutput("r", tokens, RUNNING)])
        texts.append(outs[0].outputs[0].text)
    assert texts == ["", "a", "b", "caa"], "the last 2 characters could begin 'cab': held back while it runs"
    assert stopped == [] and outs[0].outputs[0].finish_reason is None
    outs, stopped = o.process_outputs([EngineCoreOutput("r", [0, 1], RUNNING)])  # "abcaabcab": 'cab' at 6
    assert outs[0].outputs[0].text == "b" and stopped == ["r"] and outs[0].outputs[0].stop_reason == "cab"
    assert "".join(texts) + outs[0].outputs[0].text == "abcaab", "the deltas add up to the text cut at the stop"


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_every_kind_ends_with_the_same_text_as_llm_generate(embedded, kind):
    import asyncio

    from kvlab.engine.async_llm import AsyncLLM

    model, tokenizer = embedded
    llm = LLM(model, tokenizer, block_size=16, num_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=40, stop=["ing"])
    want = llm.generate("HAMLET.\n", params)[0].outputs[0]

    async def go():
        async_llm = AsyncLLM(llm.llm_engine)
        parts = []
        async for out in async_llm.generate("HAMLET.\n", SamplingParams(temperature=0, max_tokens=40, stop=["ing"],
                                                                       output_kind=kind)):
            parts.append(out.outputs[0])
        await async_llm.shutdown()
        return parts

    parts = asyncio.run(go())
    text = "".join(p.text for p in parts) if kind is RequestOutputKind.DELTA else parts[-1].text
    assert text == want.text and parts[-1].finish_reason == want.finish_reason, f"{kind.name}: {text!r}"
    if kind is RequestOutputKind.FINAL_ONLY:
        assert len(parts) == 1, "FINAL_ONLY: one output, at the end"
