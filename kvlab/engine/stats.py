"""Chapter 6: what the engines report, as typed plain data (vLLM's v1/metrics keeps its step stats the same way).

A `StepRecord` is one engine step, read by the timeline widget and the notebooks; `EngineStats` are
a run's counters, under the same names for the continuous engine and the static-batching baseline,
so the two are compared field by field.
"""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step: each request's status after it, who computed how many tokens, and the pool's use."""

    step: int
    status: dict[str, str]        # request id -> its status after the step (a RequestStatus value)
    tokens: dict[str, int]        # request id -> tokens computed for it in this step
    prefill: tuple[str, ...]      # requests scheduled for prompt (or recompute) tokens rather than one decode
    preempted: tuple[str, ...]    # requests preempted in this step, in the order they were
    used_blocks: int              # blocks held after the step
    num_blocks: int               # blocks in the pool
    batched_tokens: int           # tokens in the step's forward pass (0: nothing ran)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A run's counters: the continuous engine and static batching report the same fields."""

    num_steps: int                # scheduling steps (static batching: one per forward pass)
    num_forward_passes: int       # forward passes of the model
    num_tokens_computed: int      # token positions run through the model, recomputed and wasted ones included
    num_tokens_wasted: int        # positions computed for requests that had already finished (padding)
    num_preemptions: int          # requests preempted to free blocks
    peak_used_blocks: int         # the most blocks held (static batching: reserved) at once
