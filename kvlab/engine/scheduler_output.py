"""What the scheduler hands the model runner each step: plain data, never a Request (vLLM's v1/core/sched/output.py).

The runner keeps its own state per request (its tokens, its block table, its sampling parameters), so
a step's output carries only what changed:

    scheduled_new_reqs       NewRequestData: a request the runner has never seen, in full
    scheduled_cached_reqs    CachedRequestData: for requests it knows, the blocks appended to their tables
                             (and how many were dropped from the end: kvlab gives a speculating request's
                             rejected blocks back to the pool, where vLLM keeps them), their computed tokens,
                             and whether they resume after a preemption (their table is then replaced)
    num_scheduled_tokens     request id -> tokens it computes this step, in batch order
    scheduled_spec_decode_tokens   request id -> the draft tokens among them, verified this step
    blocks_to_swap_out/in    (device block, CPU block) and (CPU block, device block) copies the runner makes
                             before the forward pass: swap preemption's copy orders
    preempted_req_ids, finished_req_ids   requests the runner drops or parks
    kv_connector_metadata    a KV connector's orders for its worker half (kvlab.kv_transfer), or None

so that the runner never reads the scheduler's objects, and one output can be logged, replayed or
sent to another process.
"""

from dataclasses import dataclass, field

from kvlab.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request scheduled for the first time: everything the runner needs to run it from now on."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]       # empty, except for a request that resumes after the runner forgot it
    sampling_params: SamplingParams
    block_ids: list[int]              # its whole block table so far, prefix-cache hits first
    num_computed_tokens: int          # tokens whose K/V are already in those blocks (prefix-cache hits)


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner already holds, one entry per request in each list (vLLM keeps it struct-of-lists)."""

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)  # table replaced by new_block_ids
    new_block_ids: list[list[int]] = field(default_factory=list)       # appended to the table
    num_dropped_blocks: list[int] = field(default_factory=list)        # removed from the table's end first
    num_computed_tokens: list[int] = field(default_factory=list)

    def add(self, req_id: str, resumed: bool, new_block_ids: list[int], num_dropped_blocks: int,
            num_computed_tokens: int) -> None:
        self.req_ids.append(req_id)
        self.resumed_from_preemption.append(resumed)
        self.new_block_ids.append(new_block_ids)
        self.num_dropped_blocks.append(num_dropped_blocks)
        self.num_computed_tokens.append(num_computed_tokens)

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """One step: who computes how many tokens, with which blocks, and what the scheduler did to make room."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)      # in batch order (admission order)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, CPU block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (CPU block, device block)
    preempted_req_ids: list[str] = field(default_factory=list)   # in the order they were preempted
    swapped_out: list[str] = field(default_factory=list)         # of those, the ones whose K/V went to the CPU pool
    swapped_in: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)            # first admissions and re-admissions, in order
    finished_req_ids: set[str] = field(default_factory=set)      # finished or aborted since the last step
    kv_connector_metadata: object = None   # a KV connector's copy orders for the worker (kvlab.kv_transfer)

    @property
    def total_num_scheduled_tokens(self) -> int:
        """The step's tokens, drafts included: never more than max_num_batched_tokens."""
        return sum(self.num_scheduled_tokens.values())
