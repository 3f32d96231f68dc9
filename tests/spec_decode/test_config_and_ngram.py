"""speculative_config takes vLLM's keys and defaults; the n-gram proposer finds vLLM's match (longest, earliest)."""

import random

import pytest

from kvlab.spec_decode.config import SpeculativeConfig
from kvlab.spec_decode.ngram_proposer import NgramProposer, find_ngram_draft


def test_vllm_defaults_for_the_lookup_window():
    both = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5), "neither given: both 5, as in vLLM"
    only_max = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)
    assert only_min.num_lookahead_tokens == 0, "n-gram drafts write no K/V: no lookahead slots"
    draft = SpeculativeConfig.from_dict({"model": "some/draft", "num_speculative_tokens": 4})
    assert draft.method == "draft_model" and draft.num_lookahead_tokens == 4


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "at most"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "must not exceed"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "takes no 'model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "belong to the ngram"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_spec_tokens": 3}, "unknown keys"),
    ({"num_speculative_tokens": 2}, "needs a 'method'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "use_draft_probs": "no"}, "use_draft_probs"),
    ("ngram", "must be a dict"),
])
def test_bad_configs_say_what_is_wrong(config, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(config)


def test_vllm_docstring_example():
    # [2, 3] is the longest suffix that occurs earlier (at position 1); three tokens follow it.
    assert find_ngram_draft([1, 2, 3, 4, 2, 3], min_n=2, max_n=3, k=4) == [4, 2, 3]


def test_longest_match_wins_then_the_earliest():
    tokens = [7, 1, 2, 9, 5, 1, 2, 8, 3, 5, 1, 2]
    # Suffix [5, 1, 2] occurs at 4 (followed by 8); [1, 2] alone would match earlier at 1 (followed by 9).
    assert find_ngram_draft(tokens, 1, 3, 2) == [8, 3]
    assert find_ngram_draft(tokens, 1, 2, 2) == [9, 5], "with max_n 2 the earliest [1, 2] wins"
    assert find_ngram_draft(tokens, 4, 4, 2) == [], "no 4-gram match: no draft"
    assert find_ngram_draft([4, 4, 4], 1, 2, 5) == [4], "an overlapping match proposes what follows it, up to the end"
    assert find_ngram_draft([4], 1, 2, 3) == []


def brute_force(tokens, min_n, max_n, k):
    best = None
    for n in range(min_n, max_n + 1):
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                if best is None or n > best[0]:
                    best = (n, start)
                break
    return [] if best is None else tokens[best[1] + best[0]:best[1] + best[0] + k]


@pytest.mark.parametrize("seed", range(5))
def test_agrees_with_a_brute_force_search(seed):
    rng = random.Random(seed)
    for _ in range(300):
        tokens = [rng.randrange(3) for _ in range(rng.randint(1, 30))]
        low = rng.randint(1, 3)
        high = rng.randint(low, 5)
        k = rng.randint(0, 6)
        assert find_ngram_draft(tokens, low, high, k) == brute_force(tokens, low, high, k), (tokens, low, high, k)


def test_the_proposer_caps_drafts():
    proposer = NgramProposer(SpeculativeConfig("ngram", 4, prompt_lookup_max=2, prompt_lookup_min=1))
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert proposer.propose(tokens) == [3, 4, 5, 6]
    assert proposer.propose(tokens, max_drafts=2) == [3, 4], "never more drafts than the request has room for"
    assert proposer.propose(tokens, max_drafts=0) == []
