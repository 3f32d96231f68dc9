"""The draft-model proposer on its own: its pools under the target's block ids, its catch-up, its guesses."""

import pytest
import torch

from conftest import make_tiny_model
from kvlab.baselines.transformers_generate import reference_generate
from kvlab.engine.sampler import sample_with_probs
from kvlab.engine.sampling_params import SamplingParams
from kvlab.spec_decode.draft_model import DraftModelProposer, DraftRequest, load_draft_model

BLOCK = 4


@pytest.fixture(scope="module")
def draft():
    return make_tiny_model("llama", seed=3)


def proposer(draft, k=3, num_blocks=12):
    return DraftModelProposer(draft, num_blocks, BLOCK, k, sample_with_probs, attention_backend="torch")


GREEDY = SamplingParams(temperature=0, max_tokens=64)


def test_greedy_drafts_are_the_draft_models_own_greedy_continuation(draft):
    p = proposer(draft)
    tokens = [5, 9, 13, 2, 7, 11]
    table = [3, 8, 1, 10]                                   # scattered blocks: 16 slots, room for the lookahead
    p.admit("r", 0)
    (ids, probs), = p.propose([DraftRequest("r", tokens, table, len(tokens) - 1, 3, GREEDY)])
    assert ids == reference_generate(draft, tokens, 3), "k greedy guesses are the draft model's greedy tokens"
    assert probs is None, "greedy drafts carry no distribution (the verifier takes the argmax)"
    assert p.num_computed["r"] == len(tokens), "after proposing, the draft's K/V cover every verified token"
    assert p.num_forward_passes == 3, "one catch-up pass, then one pass per further guess"


def test_catch_up_covers_only_what_the_target_computed_when_not_proposing(draft):
    p = proposer(draft)
    p.admit("r", 4)                                         # a prefix-cache hit of one block
    (ids, _), = p.propose([DraftRequest("r", list(range(1, 11)), [0, 1, 2], 7, 0, GREEDY)])
    assert ids == [] and p.num_computed["r"] == 7, "a prefill chunk: catch up to the target's 7 tokens, guess none"


def test_sampled_drafts_come_with_their_distributions(draft):
    p = proposer(draft, k=2)
    p.admit("r", 0)
    params = SamplingParams(temperature=0.8, max_tokens=64)
    (ids, probs), = p.propose([DraftRequest("r", [5, 9, 13], [0, 1], 2, 2, params, torch.Generator().manual_seed(0))])
    assert len(ids) == 2 and probs.shape == (2, draft.config.vocab_size)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, dtype=probs.dtype))
    assert all(float(probs[i, t]) > 0 for i, t in enumerate(ids)), "each draft token was drawn from its row"


def test_without_draft_probs_the_same_drafts_come_without_distributions(draft):
    """keep_draft_probs=False is vLLM V1's draft_probs=None: the same sampled tokens, no q for the verifier."""
    params = SamplingParams(temperature=0.8, max_tokens=64)
    drafted = []
    for keep in (True, False):
        p = DraftModelProposer(draft, 12, BLOCK, 2, sample_with_probs, attention_backend="torch",
                               keep_draft_probs=keep)
        p.admit("r", 0)
        drafted.append(p.propose([DraftRequest("r", [5, 9, 13], [0, 1], 2, 2, params,
                                               torch.Generator().manual_seed(0))])[0])
    (ids_with, probs_with), (ids_without, probs_without) = drafted
    assert ids_with == ids_without, "the flag changes what verification sees, not what the draft model samples"
    assert probs_with is not None and probs_without is None


def test_keep_and_free_follow_the_target_through_preemption(draft):
    p = proposer(draft)
    p.admit("r", 0)
    p.propose([DraftRequest("r", [5, 9, 13, 2, 7], [0, 1], 4, 1, GREEDY)])
    assert p.num_computed["r"] == 5
    p.keep("r", 4)
    assert p.num_computed["r"] == 4, "a swap keeps the K/V of the target's computed tokens only"
    p.free("r")
    assert "r" not in p.num_computed
    p.free("r")  # freeing twice is harmless: a request may finish after its preemption forgot it


def test_the_draft_must_share_the_targets_vocabulary_and_context():
    target = make_tiny_model("llama")
    other = make_tiny_model("llama")
    other.config.vocab_size = 50
    with pytest.raises(ValueError, match="vocabulary"):
        load_draft_model(other, target)
    short = make_tiny_model("llama")
    short.config.max_position_embeddings = 32
    with pytest.raises(ValueError, match="context"):
        load_draft_model(short, target)
    assert load_draft_model(make_tiny_model("qwen2"), target) is not None, "any family, if the vocabulary matches"
