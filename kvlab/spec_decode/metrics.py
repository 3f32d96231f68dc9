"""Speculative decoding's counters, as vLLM's v1/spec_decode/metrics.py keeps them.

    num_drafts                    verifications that had at least one draft token
    num_draft_tokens              draft tokens verified
    num_accepted_tokens           of which were accepted
    num_accepted_tokens_per_pos   accepted at draft position 0, 1, ..., k - 1

vLLM's mean acceptance length counts the token every verification gives on top of the accepted
ones: 1 + num_accepted_tokens / num_drafts tokens per target forward pass of a speculating request.
"""

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodingStats:
    """Running totals over an engine's verifications."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification: it had num_draft_tokens drafts and kept the first num_accepted_tokens."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_speculative_tokens:
            raise ValueError(f"{num_accepted_tokens} accepted of {num_draft_tokens} drafts "
                             f"(k = {self.num_speculative_tokens})")
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Share of draft tokens accepted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification: 1 + accepted drafts per draft (vLLM's figure)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
