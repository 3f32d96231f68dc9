"""What the KV-transfer tests share: prompts around a shared prefix (the `prompts` fixture, imported as
prompts_fixture), block size, sampling, an offloading config and a one-by-one runner."""

import pytest

from kvlab import SamplingParams

BLOCK_SIZE = 8

TEXT = ("KING LEAR.\nNothing will come of nothing. Speak again.\nCORDELIA.\nUnhappy that I am, I cannot heave my "
        "heart into my mouth.")
OTHER = "HAMLET.\nTo be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings"


@pytest.fixture(scope="module", name="prompts")
def prompts_fixture(embedded):
    """A 40-token shared prefix (5 blocks) with two endings, and an unrelated prompt that fills the pool."""
    _, tokenizer = embedded
    prefix = tokenizer(TEXT)["input_ids"][:5 * BLOCK_SIZE]
    return {"a": prefix + tokenizer(" ROMEO.")["input_ids"], "b": prefix + tokenizer(" JULIET.\nO")["input_ids"],
            "c": tokenizer(OTHER)["input_ids"][:50]}


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def offloading(size: int, policy: str = "lru") -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"kv_offloading_size": size, "eviction_policy": policy}}


def run_one_by_one(engine, requests, max_tokens=8) -> dict[str, list[int]]:
    """Run each request to its end before the next is added; the output token ids by request id."""
    outputs = {}
    for rid, prompt in requests:
        engine.add_request(rid, prompt, greedy(max_tokens))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[rid] = out.outputs[0].token_ids
    return outputs
