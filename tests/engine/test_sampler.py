"""Chapter 6's sampler: argmax at temperature 0, top-k and top-p filters, and draws a seed makes reproducible."""

import math

import pytest
import torch

from kvlab.engine.sampler import apply_top_k_top_p, sample
from kvlab.engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


def logits_of(probs):
    """Logits whose softmax is probs."""
    return torch.tensor([math.log(p) for p in probs])


def kept(logits):
    """The token ids a filter left finite."""
    return sorted(int(i) for i in torch.nonzero(torch.isfinite(logits)).flatten())


def test_temperature_zero_is_argmax_of_each_row():
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [3.0, 0.0, 0.0, 2.9], [-5.0, -4.0, -6.0, -4.5]])
    greedy = SamplingParams(temperature=0)
    assert sample(logits, [greedy] * 3, [None] * 3) == [1, 0, 1], "greedy takes each row's most likely token"


def test_each_row_uses_its_own_params():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    tokens = sample(logits, [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1)],
                    [None, torch.Generator().manual_seed(0)])
    assert tokens == [1, 1] and all(type(t) is int for t in tokens), "one Python int per row, each under its params"


def test_top_k_keeps_the_k_most_likely_tokens():
    logits = torch.tensor([0.3, 2.0, -1.0, 1.5, 0.9])
    assert kept(apply_top_k_top_p(logits, 2, 1.0)) == [1, 3], "top_k=2 keeps the two largest logits, wherever they are"
    assert kept(apply_top_k_top_p(logits, 1, 1.0)) == [1], "top_k=1 keeps only the most likely token"
    filtered = apply_top_k_top_p(logits, 3, 1.0)
    assert torch.equal(filtered[[1, 3, 4]], logits[[1, 3, 4]]), "kept tokens keep their logits unchanged"


@pytest.mark.parametrize("top_k", [0, -1, 5, 50])
def test_top_k_off_or_at_least_the_vocabulary_keeps_everything(top_k):
    logits = torch.tensor([0.3, 2.0, -1.0, 1.5, 0.9])
    assert torch.equal(apply_top_k_top_p(logits, top_k, 1.0), logits), f"top_k={top_k} filters nothing"


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    # Probabilities in shuffled order, so the filter must map its sorted decision back to token ids.
    probs = [0.15, 0.5, 0.05, 0.3]
    logits = logits_of(probs)
    assert kept(apply_top_k_top_p(logits, 0, 0.79)) == [1, 3], (
        "0.5 falls short of top_p=0.79 and 0.5 + 0.3 reaches it: the two most likely tokens are kept, the rest dropped")
    assert kept(apply_top_k_top_p(logits, 0, 0.81)) == [0, 1, 3], "0.8 falls short of 0.81: a third token is needed"
    assert kept(apply_top_k_top_p(logits, 0, 0.45)) == [1], "the most likely token (0.5) alone reaches top_p=0.45"
    assert kept(apply_top_k_top_p(logits, 0, 0.01)) == [1], "the most likely token always stays, however small top_p"
    assert kept(apply_top_k_top_p(logits, 0, 1.0)) == [0, 1, 2, 3], "top_p=1 keeps every token"


def test_top_k_then_top_p():
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    assert kept(apply_top_k_top_p(logits, 3, 0.5)) == [0, 1], (
        "top_k=3 drops the last token; top_p then keeps 0.4 and 0.3 of the renormalised three (0.44 + 0.33 >= 0.5)")


def test_draws_come_only_from_the_tokens_the_filters_keep():
    logits = torch.tensor([[1.0, 0.9, 0.8, 0.7, 0.6, 0.5]]).repeat(200, 1)
    params = [SamplingParams(temperature=1.0, top_k=2)] * 200
    gen = torch.Generator().manual_seed(0)
    tokens = sample(logits, params, [gen] * 200)
    assert set(tokens) == {0, 1}, "top_k=2 samples both of the two most likely tokens, and never any other"


def test_a_seed_makes_draws_reproducible_whatever_the_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, seed=7)] * 4

    def draw(seed):
        return sample(logits, params, [torch.Generator().manual_seed(seed + i) for i in range(4)])

    assert draw(3) == draw(3), "the same seeds give the same tokens"
    first_rows = [draw(3)[0] for _ in range(3)]
    alone = sample(logits[:1], params[:1], [torch.Generator().manual_seed(3)])
    assert alone == [first_rows[0]] and len(set(first_rows)) == 1, (
        "a row's draw depends only on its own generator, not on the other rows of the batch")
    many = {tuple(draw(seed)) for seed in range(20)}
    assert len(many) > 1, "different seeds give different samples"


def test_low_temperature_approaches_greedy():
    logits = torch.tensor([[1.0, 1.5, 0.2]] * 50)
    tokens = sample(logits, [SamplingParams(temperature=0.01)] * 50, [torch.Generator().manual_seed(0)] * 50)
    assert set(tokens) == {1}, "dividing by a tiny temperature sharpens the softmax onto the argmax"
