"""Chapter 6's request parameters, named and defaulted as in vLLM: SamplingParams and BeamSearchParams."""

import enum
import math
from dataclasses import dataclass, field

from kvlab.validation import check_positive_int, is_integer


class RequestOutputKind(enum.Enum):
    """Which outputs a request's caller hears of (vLLM's names and values): every step's whole text so far, every
    step's new text, or only the last."""

    CUMULATIVE = 0    # after every step that gave it tokens: all its tokens and text so far (the engine's default)
    DELTA = 1         # after every step that gave it tokens: only the tokens and text new since the last output
    FINAL_ONLY = 2    # once, when it finishes (LLM.generate: nothing is detokenised along the way)


@dataclass(slots=True)
class SamplingParams:
    """How to pick each request's next tokens and when to stop.

    temperature 0 means greedy (argmax); top_k 0 or -1 and top_p 1 turn those filters off. A seed
    makes the request's samples reproducible whatever else shares its batch. n > 1 asks for n
    completions of the same prompt (vLLM V1 runs them as n requests sharing the prompt's blocks).
    min_tokens holds a request open: before that many new tokens its stop tokens (EOS unless ignore_eos,
    and stop_token_ids) are masked out of the logits and its stop strings are not searched.
    """

    n: int = 1
    temperature: float = 1.0      # 0 = greedy; vLLM's default is 1.0 too
    top_p: float = 1.0            # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0                # keep the k most likely tokens; 0 or -1 keeps all
    max_tokens: int = 16          # new tokens at most (vLLM's default)
    stop_token_ids: list[int] = field(default_factory=list)  # stop after emitting any of these
    stop: list[str] = field(default_factory=list)  # stop before any of these strings; the text ends where it begins
    ignore_eos: bool = False      # keep going past the model's end-of-sequence token(s)
    seed: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    min_tokens: int = 0           # new tokens at least: until then EOS and stop_token_ids cannot be drawn, stop
                                  # strings are not looked for (vLLM's semantics)
    extra_args: dict | None = None  # for plug-ins, as vLLM's: a KV connector reads "kv_transfer_params" here

    def __post_init__(self):
        check_positive_int("n", self.n)
        check_positive_int("max_tokens", self.max_tokens)
        if not is_integer(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_integer(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0 / -1 to keep every token, got {self.top_k!r}")
        if self.seed is not None and not is_integer(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        stops = list(self.stop_token_ids or [])
        if any(not is_integer(t) or t < 0 for t in stops):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = stops
        strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(t, str) or not t for t in strings):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop = strings
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {self.extra_args!r}")
        params = (self.extra_args or {}).get("kv_transfer_params")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"extra_args['kv_transfer_params'] must be a dict, got {params!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(slots=True)
class BeamSearchParams:
    """Beam search as `LLM.beam_search` runs it: beam_width beams, up to max_tokens new tokens."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as in transformers

    def __post_init__(self):
        check_positive_int("beam_width", self.beam_width)
        check_positive_int("max_tokens", self.max_tokens)
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
