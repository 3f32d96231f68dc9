"""Chapter 5: beam search on the forked, copy-on-write paged cache equals transformers' generate."""

import pytest

from conftest import make_tiny_model
from kvlab.baselines.transformers_generate import reference_beam_search
from kvlab.decoding.beam_search import beam_search
from kvlab.decoding.parallel_sampling import sample_n

PROMPT = [3, 5, 7, 11, 13]


def assert_same(ours, theirs):
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    for (_, a), (_, b) in zip(ours, theirs):
        assert abs(a - b) < 1e-4


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("llama")


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
@pytest.mark.parametrize("early_stopping", [False, True])
def test_tiny_llama_equals_transformers(tiny, k, length_penalty, early_stopping):
    ours = beam_search(tiny, PROMPT, k, 10, length_penalty, early_stopping)
    assert_same(ours, reference_beam_search(tiny, PROMPT, k, 10, length_penalty, early_stopping))
    assert len(ours) == k and all(len(t) == 10 for t, _ in ours)  # no EOS: every beam runs to the end


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("length_penalty", [1.0, 2.0])
@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("eos", [62, 96])
def test_with_eos_finishing_early_equals_transformers(k, length_penalty, early_stopping, eos):
    model = make_tiny_model("llama")
    model.generation_config.eos_token_id = eos  # tokens this random model produces: some beams finish early
    ours = beam_search(model, PROMPT, k, 12, length_penalty, early_stopping)
    assert_same(ours, reference_beam_search(model, PROMPT, k, 12, length_penalty, early_stopping))


def test_eos_case_really_finishes_early():
    model = make_tiny_model("llama")
    model.generation_config.eos_token_id = 96
    ours = beam_search(model, PROMPT, 4, 12, 1.0, False)
    assert sum(t[-1] == 96 and len(t) < 12 for t, _ in ours) >= 2


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("length_penalty", [1.0, 2.0])
@pytest.mark.parametrize("early_stopping", [False, True])
def test_embedded_model_equals_transformers(embedded, k, length_penalty, early_stopping):
    model, tokenizer = embedded
    prompt = tokenizer("OTHELLO.\n")["input_ids"]
    stats = {}
    ours = beam_search(model, prompt, k, 12, length_penalty, early_stopping, stats=stats)
    assert_same(ours, reference_beam_search(model, prompt, k, 12, length_penalty, early_stopping))
    assert stats["peak_used_blocks"] <= stats["num_blocks"]


def test_beams_share_blocks(tiny):
    stats = {}
    beam_search(tiny, list(range(1, 41)), 4, 6, stats=stats)  # 40-token prompt: 2 full blocks of 16 shared
    assert stats["copies"] > 0
    assert stats["peak_used_blocks"] < stats["blocks_without_sharing"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_rejects_bad_arguments(tiny, bad):
    with pytest.raises(ValueError):
        beam_search(tiny, PROMPT, bad, 4)
    with pytest.raises(ValueError):
        beam_search(tiny, PROMPT, 2, bad)


def test_parallel_sampling_reproducible_and_shares_prompt_blocks(tiny):
    prompt = list(range(1, 40))  # 2 full blocks + 7 tokens in a partly filled third
    a = sample_n(tiny, prompt, 4, 10, temperature=1.0, seed=3)
    b = sample_n(tiny, prompt, 4, 10, temperature=1.0, seed=3)
    c = sample_n(tiny, prompt, 4, 10, temperature=1.0, seed=4)
    assert a.outputs == b.outputs and a.outputs != c.outputs
    assert len(a.outputs) == 4 and all(len(o) == 10 for o in a.outputs)
    assert a.shared_blocks == 2  # the full prompt blocks stay shared
    assert a.copies == 3  # the partly filled prompt block: copied by all but the last writer
    assert a.blocks_with_sharing == 2 + 4 and a.blocks_without_sharing == 4 * 3


def test_first_child_continues_its_parent_and_only_extra_children_fork(tiny):
    from kvlab.decoding.beam_search import BeamSearch

    k = 4
    search = BeamSearch(tiny, PROMPT, k, 24)
    search.step()  # the prefill: every beam is sequence 0
    total, decode_steps = 0, 0
    while True:
        before = list(dict.fromkeys(search.beam_seq))
        search.step()
        if search.done:
            break
        decode_steps += 1
        after = search.beam_seq
        continuing = [seq for seq in after if seq in before]
        assert len(continuing) == len(set(continuing)), "a parent's sequence is continued by one child only"
        assert all(seq > max(before) for seq in after if seq not in before), "every other child is a new fork"
        forks = k - len(continuing)  # c - 1 for each parent with c children
        assert search.last_forked == forks
        if decode_steps == 1:
            assert forks == k - 1, "the first step forks the prompt's sequence k - 1 times"
        total += forks
    assert search.stats()["forks"] == total
    assert 0 < total < k * decode_steps, "a child that continues its parent is no fork"


def test_forked_search_still_frees_everything_and_keeps_counts(tiny):
    stats = {}
    beam_search(tiny, list(range(1, 41)), 4, 24, stats=stats)
    assert stats["forks"] >= 3 and stats["copies"] <= stats["forks"], "only forks copy a shared last block"
