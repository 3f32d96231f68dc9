"""The n-gram proposer (prompt lookup decoding): guess that the text goes on as it did after an earlier match.

The last n tokens of the sequence are looked up earlier in the sequence (prompt and outputs), for n
from prompt_lookup_max down to prompt_lookup_min; at the first n that matches, the earliest match
wins and the up to k tokens that followed it are the draft. No model runs, so the draft has no
probabilities (the rejection sampler treats it as one-hot), and no K/V is written for it. This is the
rule of vLLM V1's NgramProposer (longest n-gram, earliest position); transformers' prompt lookup
searches the same way.

    find_ngram_draft([1, 2, 3, 4, 2, 3], min_n=2, max_n=3, k=4)   # [4, 2, 3]: [2, 3] matched at position 1
"""

from collections.abc import Sequence

from kvlab.spec_decode.config import SpeculativeConfig
from kvlab.validation import check_int, check_positive_int


def find_ngram_draft(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the longest matching suffix n-gram."""
    check_positive_int("min_n", min_n)
    check_positive_int("max_n", max_n)
    check_int("k", k, minimum=0)
    tokens = list(token_ids)
    total = len(tokens)
    if total < 2:
        return []
    last = tokens[-1]
    best_n, best_start = 0, 0
    # One scan over where an occurrence could end (a token must follow it); each candidate is extended
    # backwards. Only a strictly longer match replaces the best, so ties keep the earliest.
    for end in range(total - 1):
        if tokens[end] != last:
            continue
        n = 1
        while n < max_n and n <= end and tokens[end - n] == tokens[total - 1 - n]:
            n += 1
        if n > best_n:
            best_n, best_start = n, end - n + 1
            if n == max_n:
                break
    if best_n < min_n:
        return []
    return tokens[best_start + best_n:best_start + best_n + k]


class NgramProposer:
    """Proposes drafts by n-gram lookup in each request's own tokens."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.k = config.num_speculative_tokens

    def propose(self, token_ids: Sequence[int], max_drafts: int | None = None) -> list[int]:
        """The draft for a sequence: at most min(k, max_drafts) tokens, possibly none."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        return find_ngram_draft(token_ids, self.min_n, self.max_n, k) if k > 0 else []
