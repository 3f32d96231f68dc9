"""`speculative_config` with vLLM's keys: which proposer, how many tokens it guesses, and its own knobs.

    LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                            "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    LLM(speculative_config={"method": "draft_model", "num_speculative_tokens": 3})   # the embedded draft model
    LLM(speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "use_draft_probs": False})

use_draft_probs is kvlab's own key. True (the default) verifies a draft model's sampled tokens with its
distribution q, the papers' rule (Leviathan et al. 2023, Chen et al. 2023): keep x with probability
min(1, p(x) / q(x)). False verifies as vLLM V1 does: its model runner passes draft_probs=None to the rejection
sampler (vllm/v1/worker/gpu_model_runner.py), so every proposer's drafts count as one-hot: x is kept with
probability p(x), and a rejection samples from p with x removed. Both keep the target's distribution.

As in vLLM, giving only one of prompt_lookup_min / prompt_lookup_max sets the other to it, and
giving neither sets both to 5; a config with a "model" and no "method" is a draft model.
"""

from dataclasses import dataclass, fields

from kvlab.validation import check_positive_int

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # beyond this a guess is almost never all accepted; it only costs verification work


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """One engine's speculation: method, k = num_speculative_tokens, and the proposer's settings."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None   # ngram: the longest suffix n-gram looked up in the context
    prompt_lookup_min: int | None = None   # ngram: the shortest one that still counts as a match
    model: object = None                   # draft_model: a path, hub id or loaded model; None = the embedded draft
    use_draft_probs: bool = True           # draft_model: verify with q (the papers) or one-hot (vLLM V1)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not isinstance(self.use_draft_probs, bool):
            raise ValueError(f"use_draft_probs is True (verify with the draft's q) or False (one-hot, as vLLM V1), "
                             f"got {self.use_draft_probs!r}")
        k = check_positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens is at most {MAX_SPECULATIVE_TOKENS} here, got {k}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("the ngram method looks tokens up in the context: it takes no 'model'")
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            if low is None and high is None:
                low = high = 5
            low = high if low is None else low
            high = low if high is None else high
            check_positive_int("prompt_lookup_min", low)
            check_positive_int("prompt_lookup_max", high)
            if low > high:
                raise ValueError(f"prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high})")
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("prompt_lookup_min / prompt_lookup_max belong to the ngram method, not draft_model")

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots past a request's tokens that the proposer writes K/V into: k for a draft model, 0 for n-grams."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def from_dict(cls, config) -> "SpeculativeConfig":
        """A SpeculativeConfig from vLLM's dict form (or one already built); unknown keys are an error."""
        if isinstance(config, cls):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4}}, got {type(config).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; kvlab knows {known}")
        config = dict(config)
        if "method" not in config:
            if config.get("model") is None:
                raise ValueError("speculative_config needs a 'method' ('ngram' or 'draft_model')")
            config["method"] = "draft_model"
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs 'num_speculative_tokens' (k, the tokens guessed per step)")
        return cls(**config)
