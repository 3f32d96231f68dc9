"""Speculative decoding's rejection sampler keeps the target's distribution (chi-square on many seeded draws)."""

import math

import pytest
import torch

from kvlab.engine.rejection_sampler import greedy_verify, rejection_sample

VOCAB = 5
DRAWS = 20_000


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test that counts were drawn from probs (vocab small, every expected count large)."""
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = len(probs) - 1
    # Wilson-Hilferty: the chi-square survival function through a normal approximation (no scipy).
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def random_dist(seed: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(n, VOCAB, generator=gen) * 1.5, dim=-1).double()


def first_tokens(target, draft_probs, propose, seed=0):
    """The first emitted token of DRAWS verifications, each with a fresh draft proposed from draft_probs."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    for _ in range(DRAWS):
        draft = [int(torch.multinomial(draft_probs[i], 1, generator=gen)) for i in range(2)] if propose is None \
            else propose
        counts[rejection_sample(draft, target, None if propose is not None else draft_probs, gen)[0]] += 1
    return counts


def test_the_first_token_follows_the_target_with_a_draft_model():
    target, draft = random_dist(1, 3), random_dist(2, 2)
    p = chi_square_p_value(first_tokens(target, draft, None), target[0])
    assert p > 1e-3, f"the first emitted token does not follow the target's distribution (chi-square p = {p:.2g})"


def test_the_first_token_follows_the_target_with_an_n_gram_proposal():
    target = random_dist(3, 3)
    p = chi_square_p_value(first_tokens(target, None, [2, 4]), target[0])
    assert p > 1e-3, f"with a one-hot draft, the first token must still follow the target (p = {p:.2g})"


def test_a_sampler_that_keeps_draft_tokens_would_be_caught():
    """The test has power: counts of the draft's own tokens are far from the target's distribution."""
    target, draft = random_dist(1, 3), random_dist(2, 2)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    for _ in range(DRAWS):
        counts[int(torch.multinomial(draft[0], 1, generator=gen))] += 1
    assert chi_square_p_value(counts, target[0]) < 1e-6


def test_bonus_token_and_all_accepted_when_draft_equals_target():
    """q == p: every draft token is kept (min(1, p/q) = 1) and the bonus follows the last position."""
    target = random_dist(4, 3)
    gen = torch.Generator().manual_seed(5)
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    for _ in range(DRAWS):
        draft = [int(torch.multinomial(target[i], 1, generator=gen)) for i in range(2)]
        out = rejection_sample(draft, target, target[:2], gen)
        assert out[:2] == draft and len(out) == 3
        counts[out[2]] += 1
    assert chi_square_p_value(counts, target[2]) > 1e-3


def test_seeded_requests_are_reproducible():
    target, draft = random_dist(6, 4), random_dist(7, 3)
    runs = [rejection_sample([1, 3, 0], target, draft, torch.Generator().manual_seed(42)) for _ in range(2)]
    assert runs[0] == runs[1]


def test_greedy_keeps_draft_tokens_while_they_are_the_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0], [1.0, 2.0, 0.0]])
    assert greedy_verify([1, 0, 2], logits) == [1, 0, 2, 1], "all kept, then the bonus argmax"
    assert greedy_verify([1, 2, 2], logits) == [1, 0], "the first mismatch is replaced by the argmax"
    assert greedy_verify([0, 0, 2], logits) == [1]
    assert greedy_verify([], logits[:1]) == [1], "no draft: one ordinary greedy step"


@pytest.mark.parametrize("args, message", [
    (([1, 2], torch.ones(2, VOCAB) / VOCAB), r"\[k \+ 1, vocab\]"),
    (([1, 2], torch.ones(3, VOCAB) / VOCAB, torch.ones(3, VOCAB) / VOCAB), r"draft_probs must be \[k, vocab\]"),
    (([1, 7], torch.ones(3, VOCAB) / VOCAB), "outside the vocabulary"),
])
def test_bad_shapes_and_tokens_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        rejection_sample(*args)


def test_the_residual_distribution_is_a_distribution():
    """max(p - q, 0), renormalised: non-negative, sums to 1, zero where q already covers p."""
    from kvlab.engine.rejection_sampler import residual_distribution

    for seed in range(20):
        p, q = random_dist(seed, 2)
        r = residual_distribution(p, q)
        assert abs(float(r.sum()) - 1.0) < 1e-12, f"seed {seed}: the residual sums to {float(r.sum())}, not 1"
        assert bool((r >= 0).all()) and bool((r[q >= p] == 0).all()), "no mass where the draft already gave enough"
    p = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0], dtype=torch.float64)
    assert torch.equal(residual_distribution(p, p), p), "q == p never rejects: p itself is returned, summing to 1"


def test_a_rejection_ends_the_verification_without_a_bonus_token():
    """Deterministic: a draft token the target gives probability 0 is always rejected, and nothing follows it."""
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]],
                          dtype=torch.float64)
    for seed in range(50):
        out = rejection_sample([0, 1], target, None, torch.Generator().manual_seed(seed))
        assert len(out) == 1 and out[0] in (1, 2), (
            f"seed {seed}: the first draft is rejected, so exactly one token (recovered from the residual) comes "
            f"out, never a bonus; got {out}")
    certain = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0]],
                           dtype=torch.float64)
    assert rejection_sample([1, 2], certain, None, torch.Generator().manual_seed(0)) == [1, 2, 3], (
        "every draft accepted: the bonus token comes from the last row")
    assert greedy_verify([1, 4], certain) == [1, 2], "greedy: the first mismatch ends it with the target's argmax"


def test_sampled_drafts_verified_one_hot_keep_the_target_and_are_kept_less_often():
    """vLLM V1's way (draft_probs=None) for a draft x ~ q: kept with p(x), not min(1, p(x) / q(x)).

    The output follows p either way."""
    target, draft = random_dist(5, 2), random_dist(6, 1)
    gen = torch.Generator().manual_seed(4)
    counts = {"q": torch.zeros(VOCAB, dtype=torch.float64), "one-hot": torch.zeros(VOCAB, dtype=torch.float64)}
    kept = {"q": 0, "one-hot": 0}
    for _ in range(DRAWS):
        x = int(torch.multinomial(draft[0], 1, generator=gen))
        for name, q in (("q", draft), ("one-hot", None)):
            out = rejection_sample([x], target, q, gen)
            counts[name][out[0]] += 1
            kept[name] += len(out) == 2
    for name in counts:
        p = chi_square_p_value(counts[name], target[0])
        assert p > 1e-3, f"verified with {name}: the first token must follow the target (chi-square p = {p:.2g})"
    theory = {"q": float(torch.minimum(target[0], draft[0]).sum()), "one-hot": float((target[0] * draft[0]).sum())}
    for name in kept:
        assert abs(kept[name] / DRAWS - theory[name]) < 0.015, (name, kept[name] / DRAWS, theory[name])
    assert theory["one-hot"] < theory["q"], "one-hot verification keeps fewer of the same sampled drafts"


def test_the_inputs_are_left_unchanged_on_both_branches():
    target, draft = random_dist(7, 3), random_dist(8, 2)
    before = (target.clone(), draft.clone())
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):   # accepting and rejecting, with q and one-hot
        for q in (draft, None):
            drafts = [1, 3]
            rejection_sample(drafts, target, q, gen)
            assert drafts == [1, 3]
    assert torch.equal(target, before[0]) and torch.equal(draft, before[1]), "verification must not write its inputs"
