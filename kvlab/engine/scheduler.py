"""Chapter 6's scheduler: each step, one batch of decodes and chunked prefills under a token budget.

Every step it walks the running requests in admission order and gives each its next tokens: one for
a decode, the next chunk of the prompt for a prefill, never more than max_num_batched_tokens in all.
When the pool has no block for a running request, the most recently admitted running request is
preempted (it has done the least work, so it loses the least): by recompute (free its blocks, put it
back at the front of the waiting queue, run its tokens again later) or by swap (copy its blocks to
the CPU pool, put it at the front of the swapped queue, copy them back later). Only in a step
without preemption are new requests admitted: swapped ones first, then waiting ones (none while a
swapped one still waits), while the budget, max_num_seqs and the free blocks allow.

The rules themselves are the three pure functions below, plain numbers in and out, which
Scheduler.schedule calls (Chapter 6's exercises are checked against them):

    next_chunk_size            how many of a request's remaining tokens the budget left lets it compute
    split_token_budget         the step's budget over the running requests, in admission order
    choose_preemption_victims  whom to preempt, most recently admitted first, until the others fit

Scheduler.schedule reads the numbers off its queues and the KVCacheManager, asks these rules, and
carries out what they decide.
"""

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from kvlab.cache.swap import SwapSpace
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.paging import num_blocks_needed
from kvlab.engine.request import Request, RequestStatus

# ----- the rules, as pure functions -----

def next_chunk_size(num_tokens_to_compute: int, token_budget: int) -> int:
    """A request computes as many of its remaining tokens as the budget left allows: all of them, or the next chunk."""
    return min(num_tokens_to_compute, token_budget)


def split_token_budget(num_tokens_to_compute: list[int], token_budget: int) -> list[int]:
    """Requests in admission order each get next_chunk_size of the budget the earlier ones left (0 once it is spent)."""
    shares = []
    for tokens in num_tokens_to_compute:
        share = next_chunk_size(tokens, token_budget)
        shares.append(share)
        token_budget -= share
    return shares


# running: (request_id, blocks its preemption returns to the pool) in admission order; blocks_needed: request_id ->
# the new blocks its tokens of this step take. Returns the victims' ids in the order they are preempted.
def choose_preemption_victims(running: list[tuple[Hashable, int]], num_free_blocks: int,
                              blocks_needed: dict[Hashable, int]) -> list[Hashable]:
    """Walking the running requests in admission order, while one needs more blocks than are free, the last one
    still running is preempted (possibly itself, which ends the walk)."""
    still_running = list(running)
    victims = []
    i = 0
    while i < len(still_running):
        request_id = still_running[i][0]
        while blocks_needed[request_id] > num_free_blocks:
            victim, freed = still_running.pop()
            victims.append(victim)
            num_free_blocks += freed
            if victim == request_id:
                return victims  # the requests after it are gone already; the ones before it keep their blocks
        num_free_blocks -= blocks_needed[request_id]
        i += 1
    return victims


@dataclass(slots=True)
class ScheduledRequest:
    """A request's share of one step: its next num_new_tokens tokens and their cache slots.

    With speculative decoding the last num_draft_tokens of them are unverified drafts, and
    num_lookahead_tokens more slots were held for the draft model's own K/V.
    """

    request: Request
    num_new_tokens: int
    slots: list[int]
    num_draft_tokens: int = 0
    num_lookahead_tokens: int = 0
    samples: bool = True  # the new tokens reach the sequence's end, so this step gives the request tokens


@dataclass(slots=True)
class SchedulerOutput:
    """What one step runs, and what the scheduler did to make room."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)      # request ids preempted this step
    swapped_out: list[str] = field(default_factory=list)
    swapped_in: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)        # first admissions and re-admissions

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Waiting, running and swapped queues over one KVCacheManager (and a SwapSpace for swap preemption)."""

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str = "recompute", swap_space: SwapSpace | None = None,
                 num_lookahead_tokens: int = 0):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        if preemption_mode == "swap" and swap_space is None:
            raise ValueError("preemption_mode='swap' needs a swap space (a CPU block pool)")
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.swap_space = swap_space
        # Slots past a sampling request's tokens for a draft model's K/V (vLLM's num_lookahead_tokens).
        self.num_lookahead_tokens = num_lookahead_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []      # in admission order: the last one is the next victim
        self.swapped: deque[Request] = deque()
        self.cpu_blocks: dict[str, list[int]] = {}  # swapped request -> its CPU block ids
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # tokens that had K/V once, lost them to preemption and ran again

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ----- one step -----
    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch, allocating cache slots for every scheduled token."""
        out = SchedulerOutput()
        running = list(self.running)
        # The budget goes to the running requests first, in admission order.
        # A speculating request asks for its draft tokens too; the budget may cut some of them off.
        shares = split_token_budget([r.num_tokens_with_spec - r.num_computed_tokens for r in running],
                                    self.max_num_batched_tokens)
        # Preempt until every request the budget reached has room for its tokens.
        victims = choose_preemption_victims(
            [(r.request_id, freed) for r, freed in zip(running, self._blocks_freed_by_preemption())],
            self.kv.num_free_blocks,
            {r.request_id: self.kv.num_blocks_to_allocate(r.request_id, n,
                                                          num_lookahead_tokens=self._lookahead(r, n))
             for r, n in zip(running, shares)})
        # Every victim goes before anyone allocates, so the room choose_preemption_victims counted is free
        # when the requests the budget reached take their blocks.
        by_id = {r.request_id: r for r in running}
        for request_id in victims:
            self.running.remove(by_id[request_id])
            self._preempt(by_id[request_id], out)
        for request, n in zip(running, shares):
            if n and request in self.running:
                out.scheduled.append(self._allocate(request, n))
        if out.preempted:
            return out  # no room to spare this step: admit nobody
        budget = self.max_num_batched_tokens - out.num_batched_tokens
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            scheduled = self._swap_in(self.swapped[0], budget, out)
            if scheduled is None:
                break
            self.swapped.popleft()
            budget -= scheduled.num_new_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not self.swapped:
            scheduled = self._admit(self.waiting[0], budget, out)
            if scheduled is None:
                break
            self.waiting.popleft()
            budget -= scheduled.num_new_tokens
        return out

    def _blocks_freed_by_preemption(self) -> list[int]:
        """Per running request, the blocks that preempting it returns to the pool once every later one is preempted.

        Victims go from the back, so those are its blocks that no earlier running request shares (with
        prefix caching, the n completions of one prompt share its full blocks).
        """
        tables = self.kv.block_tables
        held_before: set[int] = set()
        freed = []
        for request in self.running:
            own = set(tables[request.request_id]) - held_before
            freed.append(len(own))
            held_before |= own
        return freed

    def _lookahead(self, request: Request, n: int, start: int | None = None) -> int:
        """Slots held past a request's n new tokens from `start` (default: its computed tokens).

        A draft model's lookahead, only when the request samples and never past its longest length;
        or, for an Orca-style reservation (request.reserved_len), whatever of it is not yet allocated.
        """
        end = (request.num_computed_tokens if start is None else start) + n
        reserve = max(0, request.reserved_len - end)
        if not self.num_lookahead_tokens or end < request.num_tokens:
            return reserve
        return max(reserve, min(self.num_lookahead_tokens, request.max_len - end))

    def _allocate(self, request: Request, n: int, computed_blocks=()) -> ScheduledRequest:
        start = request.num_computed_tokens
        # Only positions below recompute_until were computed before; prefix-cache hits already skipped some.
        self.num_recomputed_tokens += max(0, min(start + n, request.recompute_until) - start)
        num_drafts = max(0, start + n - request.num_tokens)
        del request.spec_token_ids[num_drafts:]  # drafts the budget did not reach are dropped, as in vLLM V1
        lookahead = self._lookahead(request, n)
        tokens = (request.all_token_ids + request.spec_token_ids)[start:start + n]
        slots = self.kv.allocate_slots(request.request_id, n, computed_blocks, new_token_ids=tokens,
                                       num_draft_tokens=num_drafts, num_lookahead_tokens=lookahead)
        return ScheduledRequest(request, n, slots, num_drafts, lookahead, start + n - num_drafts >= request.num_tokens)

    def _admit(self, request: Request, budget: int, out: SchedulerOutput) -> ScheduledRequest | None:
        # A re-admitted (recompute-preempted) request looks up its prompt *and* outputs: the blocks it
        # freed may still be cached, which makes the recompute cheaper.
        hits, num_cached = self.kv.get_computed_blocks(request.request_id, request.all_token_ids)
        n = next_chunk_size(request.num_tokens - num_cached, budget)
        lookahead = self._lookahead(request, n, start=num_cached)
        if self.kv.num_blocks_to_allocate(request.request_id, n, hits, lookahead) > self.kv.num_free_blocks:
            return None
        request.num_computed_tokens = num_cached
        scheduled = self._allocate(request, n, hits)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(scheduled)
        out.admitted.append(request.request_id)
        return scheduled

    def _swap_in(self, request: Request, budget: int, out: SchedulerOutput) -> ScheduledRequest | None:
        rid, computed = request.request_id, request.num_computed_tokens
        tokens = request.all_token_ids
        hits, num_cached = self.kv.get_computed_blocks(rid, tokens[:computed])
        n = next_chunk_size(request.num_tokens_to_compute, budget)
        # Room for the swapped-in blocks and this step's tokens, checked before anything changes.
        needed = self.kv.num_blocks_to_allocate(rid, computed + n - num_cached, hits, self._lookahead(request, n))
        if needed > self.kv.num_free_blocks:
            return None
        cpu_ids = self.cpu_blocks.pop(rid)
        # Hits stop one token short of what was computed, so at least one token's block is copied back.
        self.kv.allocate_slots(rid, computed - num_cached, hits, new_token_ids=tokens[num_cached:computed])
        first = num_cached // self.kv.block_size  # blocks still cached need no copy
        gpu_ids = self.kv.block_tables[rid][first:len(cpu_ids)]
        self.swap_space.swap_in(cpu_ids[first:], gpu_ids)
        self.swap_space.free(cpu_ids)
        scheduled = self._allocate(request, n)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(scheduled)
        out.swapped_in.append(rid)
        out.admitted.append(rid)
        return scheduled

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        rid = request.request_id
        request.spec_token_ids.clear()  # guessed for a step that will not come; proposed afresh once it runs again
        self.num_preemptions += 1
        request.num_preemptions += 1
        out.preempted.append(rid)
        if self.preemption_mode == "swap":
            # Only the blocks of computed tokens: lookahead blocks past them hold nothing worth keeping.
            table = self.kv.block_tables[rid][:num_blocks_needed(request.num_computed_tokens, self.kv.block_size)]
            cpu_ids = self.swap_space.swap_out(table)
            if cpu_ids is not None:
                self.kv.free(rid)
                self.cpu_blocks[rid] = cpu_ids
                request.status = RequestStatus.SWAPPED
                self.swapped.appendleft(request)
                out.swapped_out.append(rid)
                return
            # The CPU pool is full: kvlab falls back to recompute (vLLM's V0 stopped with an error instead).
        self.kv.free(rid)
        request.recompute_until = max(request.recompute_until, request.num_computed_tokens)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    # ----- after the step -----
    def finish(self, request: Request) -> None:
        """Release a request that stopped (or was aborted) from whichever queue holds it."""
        rid = request.request_id
        if request in self.running:
            self.running.remove(request)
            self.kv.free(rid)
        elif request in self.swapped:
            self.swapped.remove(request)
            self.swap_space.free(self.cpu_blocks.pop(rid))
        elif request in self.waiting:
            self.waiting.remove(request)
