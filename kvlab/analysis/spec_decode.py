"""Speculative decoding's arithmetic: how many tokens a verification gives, and what that can buy.

If each draft token is accepted with probability alpha, independently, a verification of k drafts
emits the accepted prefix plus one token from the target (recovered or bonus), on average

    E[tokens per step] = 1 + alpha + alpha^2 + ... + alpha^k = (1 - alpha^(k + 1)) / (1 - alpha)

(Leviathan et al. 2023, eq. 1). vLLM reports the measured figure as the mean acceptance length,
1 + accepted / drafts. A verification costs about one target step while decoding is memory-bound
(the weights are read once for k + 1 positions as for 1), so the ideal speed-up is that length over
the cost of a step including the proposer: with a draft model c times as expensive as the target per
token, one step costs 1 + c k target steps.
"""

from kvlab.validation import check_int


def expected_acceptance_length(acceptance_rate: float, num_speculative_tokens: int) -> float:
    """Expected tokens per verification of k drafts, each accepted with probability acceptance_rate."""
    alpha = float(acceptance_rate)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance_rate must be a probability in [0, 1], got {acceptance_rate!r}")
    k = check_int("num_speculative_tokens", num_speculative_tokens, minimum=0)
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def ideal_speedup(acceptance_length: float, num_speculative_tokens: int, draft_cost: float = 0.0) -> float:
    """Tokens per unit of target time against plain decoding: length / (1 + draft_cost * k).

    draft_cost is one draft forward pass over one target forward pass (0 for n-gram lookup).
    """
    if acceptance_length < 1:
        raise ValueError(f"a verification always emits at least one token; got acceptance_length {acceptance_length}")
    if draft_cost < 0:
        raise ValueError(f"draft_cost is a ratio of times, at least 0; got {draft_cost}")
    k = check_int("num_speculative_tokens", num_speculative_tokens, minimum=0)
    return acceptance_length / (1.0 + draft_cost * k)
