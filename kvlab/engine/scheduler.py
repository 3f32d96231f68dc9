"""Chapter 6's scheduler: each step, one batch of decodes and chunked prefills under a token budget.

Every step it walks the running requests in admission order and gives each its next tokens: one for
a decode, the next chunk of the prompt for a prefill, never more than max_num_batched_tokens in all.
When the pool has no block for a running request, the most recently admitted running request is
preempted (it has done the least work, so it loses the least): by recompute (free its blocks, put it
back at the front of the waiting queue, run its tokens again later) or by swap (copy its blocks to
the CPU pool, copy them back later). Only in a step without preemption are new requests admitted:
swapped ones first, then waiting ones, while the budget, max_num_seqs and the free blocks allow.
"""

from collections import deque
from dataclasses import dataclass, field

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.engine.request import Request, RequestStatus
from kvlab.cache.swap import SwapSpace


@dataclass(slots=True)
class ScheduledRequest:
    """A request's share of one step: its next num_new_tokens tokens and their cache slots."""

    request: Request
    num_new_tokens: int
    slots: list[int]


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
                 preemption_mode: str = "recompute", swap_space: SwapSpace | None = None):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        if preemption_mode == "swap" and swap_space is None:
            raise ValueError("preemption_mode='swap' needs a swap space (a CPU block pool)")
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.swap_space = swap_space
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
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens_to_compute, budget)
            while self.kv.num_blocks_to_allocate(request.request_id, n) > self.kv.num_free_blocks:
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, n, self._allocate(request, n)))
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted, and it was the last running one
        if out.preempted:
            return out  # no room to spare this step: admit nobody
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

    def _allocate(self, request: Request, n: int, computed_blocks=()) -> list[int]:
        start = request.num_computed_tokens
        # Only positions below recompute_until were computed before; prefix-cache hits already skipped some.
        self.num_recomputed_tokens += max(0, min(start + n, request.recompute_until) - start)
        return self.kv.allocate_slots(request.request_id, n, computed_blocks,
                                      new_token_ids=request.all_token_ids[start:start + n])

    def _admit(self, request: Request, budget: int, out: SchedulerOutput) -> ScheduledRequest | None:
        # A re-admitted (recompute-preempted) request looks up its prompt *and* outputs: the blocks it
        # freed may still be cached, which makes the recompute cheaper.
        hits, num_cached = self.kv.get_computed_blocks(request.request_id, request.all_token_ids)
        n = min(request.num_tokens - num_cached, budget)
        if self.kv.num_blocks_to_allocate(request.request_id, n, hits) > self.kv.num_free_blocks:
            return None
        request.num_computed_tokens = num_cached
        scheduled = ScheduledRequest(request, n, self._allocate(request, n, hits))
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(scheduled)
        out.admitted.append(request.request_id)
        return scheduled

    def _swap_in(self, request: Request, budget: int, out: SchedulerOutput) -> ScheduledRequest | None:
        rid, computed = request.request_id, request.num_computed_tokens
        tokens = request.all_token_ids
        hits, num_cached = self.kv.get_computed_blocks(rid, tokens[:computed])
        n = min(request.num_tokens_to_compute, budget)
        # Room for the swapped-in blocks and this step's tokens, checked before anything changes.
        needed = self.kv.num_blocks_to_allocate(rid, computed + n - num_cached, hits)
        if needed > self.kv.num_free_blocks:
            return None
        cpu_ids = self.cpu_blocks.pop(rid)
        # Hits stop one token short of what was computed, so at least one token's block is copied back.
        self.kv.allocate_slots(rid, computed - num_cached, hits, new_token_ids=tokens[num_cached:computed])
        first = num_cached // self.kv.block_size  # blocks still cached need no copy
        gpu_ids = self.kv.block_tables[rid][first:len(cpu_ids)]
        self.swap_space.swap_in(cpu_ids[first:], gpu_ids)
        self.swap_space.free(cpu_ids)
        scheduled = ScheduledRequest(request, n, self._allocate(request, n))
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(scheduled)
        out.swapped_in.append(rid)
        out.admitted.append(rid)
        return scheduled

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        rid = request.request_id
        self.num_preemptions += 1
        request.num_preemptions += 1
        out.preempted.append(rid)
        if self.preemption_mode == "swap":
            cpu_ids = self.swap_space.swap_out(self.kv.block_tables[rid])
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
