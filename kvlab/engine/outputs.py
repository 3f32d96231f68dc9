"""What comes back up after a step: the model runner's tokens, then the scheduler's per-request results (vLLM's
v1/outputs.py and v1/engine EngineCoreOutput).

    ModelRunnerOutput   per scheduled request, in batch order: the tokens it emits this step (none for a prompt
                        chunk that does not reach the end of the prompt; with speculation, the accepted drafts
                        and one more) and the drafts proposed for its next step
    EngineCoreOutput    per request that moved: its new tokens after the scheduler applied the stop rules, and
                        why it finished, if it did; the output processor turns these into RequestOutputs
"""

from dataclasses import dataclass, field

from kvlab.engine.request import RequestStatus


@dataclass(slots=True)
class ModelRunnerOutput:
    """One step's results from the model runner, in the order of the scheduler output's num_scheduled_tokens."""

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)   # [] for a prompt chunk that samples nothing
    spec_token_ids: list[list[int]] | None = None                      # next step's drafts, with speculation on
    num_forward_passes: int = 0                                         # of the target model, this step (0 or 1)
    # A KV connector's asynchronous copies that finished (vLLM's KVConnectorOutput): None when all finish in-step.
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    invalid_block_ids: set[int] | None = None  # blocks whose load failed: their tokens are recomputed

    @property
    def req_id_to_index(self) -> dict[str, int]:
        return {rid: i for i, rid in enumerate(self.req_ids)}


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput()


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's progress in a step: the tokens it kept, and its status after them."""

    request_id: str
    new_token_ids: list[int]
    status: RequestStatus
    num_draft_tokens: int = 0        # drafts verified for it this step
    num_accepted_tokens: int = 0     # of which were accepted
    kv_transfer_params: dict | None = None  # a KV connector's params for a peer, on a request's last output

    @property
    def finished(self) -> bool:
        return self.status.finished
