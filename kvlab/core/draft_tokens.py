"""Speculative decoding's bookkeeping: slots for unverified draft tokens, and giving them back (vLLM V1's scheduler).

A request that speculates schedules its last sampled token plus k draft tokens; the target model
writes K/V for all k + 1 in its forward pass. Verification keeps the first `num_accepted` drafts.
The rejected ones are rolled back by lowering num_computed_tokens: their slots hold K/V of tokens
that are not in the sequence, and they are overwritten by whatever is written there next. Blocks
that lie wholly past the sequence (plus the lookahead slots a draft model writes its own K/V into)
go back to the pool. Draft tokens are never hashed into the prefix cache: a block is cached only
once every token in it is verified.

    plan = plan_rollback(num_computed_tokens=20, num_draft_tokens=4, num_accepted_tokens=1,
                         num_blocks_held=6, block_size=4)
    plan.num_computed_tokens, plan.num_blocks_to_keep      # (17, 5): 3 rejected; block 5 is past token 17
"""

from dataclasses import dataclass

from kvlab.core.paging import num_blocks_needed
from kvlab.validation import check_block_size, check_int


@dataclass(frozen=True, slots=True)
class RollbackPlan:
    """What verification leaves: the tokens whose K/V count, and how many of the request's blocks stay its own."""

    num_computed_tokens: int   # tokens with valid K/V after the rejected drafts are dropped
    num_blocks_to_keep: int    # the first blocks of the block table kept; the rest go back to the pool
    num_rejected_tokens: int


def plan_rollback(num_computed_tokens: int, num_draft_tokens: int, num_accepted_tokens: int, num_blocks_held: int,
                  block_size: int, num_lookahead_tokens: int = 0) -> RollbackPlan:
    """Roll back the rejected drafts of one verification.

    num_computed_tokens counts every token the target just wrote, the last num_draft_tokens of them
    drafts, of which the first num_accepted_tokens were accepted. Blocks needed for the tokens that
    remain plus num_lookahead_tokens more slots are kept, never more than the request holds.
    """
    check_int("num_computed_tokens", num_computed_tokens, minimum=0)
    check_int("num_draft_tokens", num_draft_tokens, minimum=0)
    check_int("num_accepted_tokens", num_accepted_tokens, minimum=0)
    check_int("num_blocks_held", num_blocks_held, minimum=0)
    check_int("num_lookahead_tokens", num_lookahead_tokens, minimum=0)
    check_block_size(block_size)
    if num_draft_tokens > num_computed_tokens:
        raise ValueError(f"{num_draft_tokens} draft tokens among only {num_computed_tokens} computed tokens")
    if num_accepted_tokens > num_draft_tokens:
        raise ValueError(f"{num_accepted_tokens} accepted tokens out of only {num_draft_tokens} drafts")
    if num_blocks_needed(num_computed_tokens, block_size) > num_blocks_held:
        needed = num_blocks_needed(num_computed_tokens, block_size)
        raise ValueError(f"{num_computed_tokens} computed tokens need {needed} blocks of {block_size}, "
                         f"but the request holds {num_blocks_held}")
    rejected = num_draft_tokens - num_accepted_tokens
    remaining = num_computed_tokens - rejected
    keep = min(num_blocks_held, num_blocks_needed(remaining + num_lookahead_tokens, block_size))
    return RollbackPlan(remaining, keep, rejected)
