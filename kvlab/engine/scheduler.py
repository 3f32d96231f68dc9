"""Chapter 6's scheduler: each step, one batch of decodes and chunked prefills under a token budget.

An engine step is three calls, as in vLLM V1's EngineCore.step:

    scheduler_output = scheduler.schedule()                              # who runs, which tokens, which blocks
    runner_output = model_runner.execute_model(scheduler_output)         # forward, sample, verify, propose
    outputs = scheduler.update_from_output(scheduler_output, runner_output)   # append, stop, roll back, free

The scheduler owns every request's state (its queue, status, num_computed_tokens and outputs); the
KV cache manager owns the blocks; the model runner owns the tensors. What the runner needs crosses
over as data (kvlab.engine.scheduler_output), copy orders included.

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
carries out what they decide. A model with sliding-window layers brings a HybridKVCacheManager
(kvlab.core.hybrid_kv_cache_manager, Chapter 11) under the same calls: block ids then go to the runner as one
table per KV-cache group, and after every step the windows give back the blocks no later query reads.

A KV connector (kvlab.kv_transfer, given as kv_connector) is called where vLLM V1's scheduler calls it: at
admission, after the GPU prefix-cache hit, get_num_new_matched_tokens says how many further tokens it can
load (they take blocks but no token budget) and update_state_after_alloc hears which blocks they land in;
at the end of schedule(), build_connector_meta puts the step's copy orders on the output; after the step,
update_connector_output; and request_finished when a request stops or is aborted.

Copies may outlast a step, as in vLLM V1 (vllm/v1/core/sched/scheduler.py):

* a load the connector does asynchronously (load_async) parks the request in WAITING_FOR_REMOTE_KVS: it
  holds the blocks the load writes, which nobody can hit in the prefix cache yet, and takes no budget. When
  the worker reports the load finished (finished_recving) the blocks are cached and the request waits again
  at the front of the queue, its loaded tokens computed. Blocks whose load failed (invalid_block_ids) are
  recomputed: the blocks before the first failed one are kept through the prefix cache, and the request asks
  the connector nothing more;
* a request the connector must still read from when it finishes (request_finished answers delay_free, as a
  prefill server's does until the decode server has pulled its blocks) keeps its blocks until the worker
  reports the save finished (finished_sending). The params request_finished returns go out with its last
  output (kv_transfer_params);
* a request aborted while its load is in flight keeps its blocks until the load ends, so no copy lands in a
  block that another request has since been given.
"""

from collections import deque
from collections.abc import Hashable, Iterable
from itertools import islice

from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.paging import num_blocks_needed
from kvlab.engine.outputs import EngineCoreOutput, ModelRunnerOutput
from kvlab.engine.request import Request, RequestStatus
from kvlab.engine.scheduler_output import NewRequestData, SchedulerOutput
from kvlab.spec_decode.metrics import SpecDecodingStats
from kvlab.validation import check_int

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


def _table_len(block_ids):
    """Entries of a block table, or of each group's table (a tuple) for a hybrid model."""
    return len(block_ids) if isinstance(block_ids, list) else tuple(len(table) for table in block_ids)


class Scheduler:
    """Waiting, running and swapped queues over one KVCacheManager (and a CPU block pool for swap preemption)."""

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str = "recompute", num_cpu_blocks: int = 0, num_lookahead_tokens: int = 0,
                 num_speculative_tokens: int = 0, kv_connector=None):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        check_int("num_cpu_blocks", num_cpu_blocks, minimum=0)
        self.kv = kv_cache_manager
        # The scheduler's half of a KV connector (kvlab.kv_transfer), called where vLLM V1's scheduler calls it.
        self.connector = kv_connector
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        # Which CPU blocks hold a swapped request's K/V: Chapter 4's BlockPool without prefix caching. The copies
        # themselves are the runner's (kvlab.cache.swap.SwapSpace), ordered through the scheduler output.
        self.cpu_block_pool = BlockPool(num_cpu_blocks, enable_prefix_caching=False) \
            if preemption_mode == "swap" and num_cpu_blocks else None
        # Slots past a sampling request's tokens for a draft model's K/V (vLLM's num_lookahead_tokens).
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_stats = SpecDecodingStats(num_speculative_tokens) if num_speculative_tokens else None
        self.requests: dict[str, Request] = {}  # every request ever added, finished ones included (the block map's)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []      # in admission order: the last one is the next victim
        self.swapped: deque[Request] = deque()
        self.cpu_blocks: dict[str, list[int]] = {}  # swapped request -> its CPU block ids
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # tokens that had K/V once, lost them to preemption and ran again
        # The last step's rollbacks, for the block map: request id -> (first rejected position, rejected, freed ids).
        self.last_rollbacks: dict[str, tuple[int, int, list[int]]] = {}
        # What the runner holds: per request, the length of the block table it was last sent; requests whose
        # table it must replace (re-admitted), blocks it must drop (rolled back) and requests it must forget.
        self._runner_table_len: dict[str, int] = {}
        self._resumed: set[str] = set()
        self._dropped_blocks: dict[str, int] = {}
        self._finished_req_ids: set[str] = set()
        # Per running request, its blocks that a running request admitted before it also holds (prefix-cache hits
        # on blocks in use), which its preemption would not free; recounted only after a request leaves from the
        # middle of the running list (see _blocks_freed_by_preemption).
        self._shared_before: dict[str, int] = {}
        self._num_hits: dict[str, int] = {}  # per running request, the cache hits it was admitted with
        self._shared_stale = False
        # A hybrid model's manager gives back the blocks its windows have left after every step (vLLM does it at
        # the request's next allocation; kvlab does it as soon as the step's tokens are computed).
        self._remove_skipped = getattr(kv_cache_manager, "remove_skipped_blocks", None)
        # A KV connector's copies in flight: requests waiting for a load (id -> the hits they were admitted with),
        # finished requests whose blocks a save still reads, aborted ones whose load has not ended, and requests
        # whose load failed (they recompute, asking the connector nothing more).
        self.waiting_for_remote_kvs: dict[str, tuple[Request, list]] = {}
        self._free_after_save: set[str] = set()
        self._free_after_load: set[str] = set()
        self._failed_loads: set[str] = set()
        self._invalid_block_ids: set[int] = set()  # blocks whose load failed, for requests still waiting on it
        self._admission_hits: dict[str, list] = {}  # loaded requests' hits, for when they join the running list
        self.num_failed_loads = 0

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks in the CPU pool (0 without swap preemption)."""
        return 0 if self.cpu_block_pool is None else self.cpu_block_pool.num_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        """CPU blocks a swap-out can still take."""
        return 0 if self.cpu_block_pool is None else self.cpu_block_pool.num_free_blocks

    def _free_cpu_blocks(self, cpu_ids: list[int]) -> None:
        if cpu_ids:
            self.cpu_block_pool.free_blocks([self.cpu_block_pool.blocks[i] for i in cpu_ids])

    def add_request(self, request: Request) -> None:
        """Queue a new request at the back of the waiting queue."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.waiting_for_remote_kvs)

    def has_schedulable_requests(self) -> bool:
        """Whether a request runs, waits or is swapped out (those waiting for a load only wait)."""
        return bool(self.waiting or self.running or self.swapped)

    def has_pending_kv_transfers(self) -> bool:
        """Whether a connector's copy is still in flight for a request that holds blocks: the engine keeps stepping
        (an idle step only polls the connector) until it ends, even with no unfinished request."""
        return bool(self.waiting_for_remote_kvs or self._free_after_save or self._free_after_load)

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting): preempted requests wait again, swapped ones wait to be swapped back in, and loading
        ones wait for their K/V."""
        return len(self.running), len(self.waiting) + len(self.swapped) + len(self.waiting_for_remote_kvs)

    # ----- one step -----
    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch, allocating cache slots for every scheduled token."""
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._schedule(out)
        if self.connector is not None:  # after every allocation: the step's loads and saves, for the worker
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _schedule(self, out: SchedulerOutput) -> None:
        self._finished_req_ids = set()
        running = list(self.running)
        # The budget goes to the running requests first, in admission order.
        # A speculating request asks for its draft tokens too; the budget may cut some of them off.
        shares = split_token_budget([r.num_tokens_with_spec - r.num_computed_tokens for r in running],
                                    self.max_num_batched_tokens)
        # Preempt until every request the budget reached has room for its tokens.
        lookaheads = [self._lookahead(r, n) for r, n in zip(running, shares)]
        blocks_to_allocate = self.kv.num_blocks_to_allocate
        victims = choose_preemption_victims(
            [(r.request_id, freed) for r, freed in zip(running, self._blocks_freed_by_preemption())],
            self.kv.num_free_blocks,
            {r.request_id: blocks_to_allocate(r.request_id, n, num_lookahead_tokens=lookahead)
             for r, n, lookahead in zip(running, shares, lookaheads)})
        # Every victim goes before anyone allocates, so the room choose_preemption_victims counted is free
        # when the requests the budget reached take their blocks.
        preempted = set(victims)
        if victims:
            by_id = {r.request_id: r for r in running}
            for request_id in victims:
                self._remove_running(by_id[request_id])
                self._preempt(by_id[request_id], out)
        for request, n, lookahead in zip(running, shares, lookaheads):
            if n and (not preempted or request.request_id not in preempted):
                self._allocate(request, n, out, lookahead=lookahead)
        if out.preempted_req_ids:
            return  # no room to spare this step: admit nobody
        budget = self.max_num_batched_tokens - out.total_num_scheduled_tokens
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            n = self._swap_in(self.swapped[0], budget, out)
            if n is None:
                break
            self.swapped.popleft()
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not self.swapped:
            n = self._admit(self.waiting[0], budget, out)
            if n is None:
                break
            self.waiting.popleft()
            budget -= n

    def _blocks_freed_by_preemption(self) -> list[int]:
        """Per running request, the blocks that preempting it returns to the pool once every later one is preempted.

        Victims go from the back, so those are its blocks that no earlier running request shares (with
        prefix caching, the n completions of one prompt share its full blocks). A request shares only blocks
        it found in the cache at admission while an earlier one held them (a block it took fresh can only be
        found later, by requests admitted after it), so that count is taken once, at admission, and the rest
        of its table, however it grows, is its own.
        """
        if self._shared_stale:
            self._count_shared_blocks()
        tables, shared = self.kv.req_to_blocks, self._shared_before
        return [len(tables[r.request_id]) - shared[r.request_id] for r in self.running]

    def _count_shared_blocks(self) -> None:
        """Count afresh, per running request, its blocks that an earlier running request holds too.

        Only blocks held more than once can be, and each such block is a cache hit of all its holders but
        perhaps one, at the same position of every table (its hash names its whole prefix): so only the first
        blocks of each table, as many as the most hits any running request was admitted with, are looked at.
        """
        tables = self.kv.req_to_blocks
        longest_hit = max(self._num_hits.values(), default=0)
        seen: set[int] = set()  # blocks held more than once, by a request already counted
        for request in self.running:
            shared = 0
            for block in islice(tables[request.request_id], longest_hit):
                if block.ref_cnt > 1:
                    if block.block_id in seen:
                        shared += 1
                    else:
                        seen.add(block.block_id)
            self._shared_before[request.request_id] = shared
        self._shared_stale = False

    def _admitted(self, request: Request, hits) -> None:
        """Join the running list, counting the cache hits that an earlier running request holds as well."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._shared_before[request.request_id] = sum(1 for block in hits if block.ref_cnt > 1)
        self._num_hits[request.request_id] = len(hits)

    def _remove_running(self, request: Request) -> None:
        """Leave the running list; from its middle, a later request may now be the first holder of a shared block."""
        last = self.running[-1] is request
        self.running.remove(request)
        del self._shared_before[request.request_id], self._num_hits[request.request_id]
        if not last and any(self._shared_before.values()):
            self._shared_stale = True

    def _lookahead(self, request: Request, n: int, start: int | None = None) -> int:
        """Slots held past a request's n new tokens from `start` (default: its computed tokens).

        A draft model's lookahead, only when the request samples and never past its longest length;
        or, for an Orca-style reservation (request.reserved_len), whatever of it is not yet allocated.
        """
        end = (request.num_computed_tokens if start is None else start) + n
        reserve = request.reserved_len - end
        if reserve < 0:
            reserve = 0
        if not self.num_lookahead_tokens or end < request.num_tokens:
            return reserve
        return max(reserve, min(self.num_lookahead_tokens, request.max_len - end))

    def _allocate(self, request: Request, n: int, out: SchedulerOutput, computed_blocks=(),
                  lookahead: int | None = None, num_query_tokens: int | None = None, preempted: bool = False) -> None:
        """Give a request n new tokens' slots and put it in this step's output (with its drafts and new blocks);
        lookahead: _lookahead(request, n), when the caller has it already; num_query_tokens: at admission, what
        the prefix-cache counters count as looked up, and preempted: whether it is a re-admission
        (KVCacheManager.allocate_slots)."""
        rid, start = request.request_id, request.num_computed_tokens
        # Only positions below recompute_until were computed before; prefix-cache hits already skipped some.
        if start < request.recompute_until:
            self.num_recomputed_tokens += min(start + n, request.recompute_until) - start
        num_drafts = max(0, start + n - request.num_tokens)
        if request.spec_token_ids:
            del request.spec_token_ids[num_drafts:]  # drafts the budget did not reach are dropped, as in vLLM V1
        if lookahead is None:
            lookahead = self._lookahead(request, n)
        tokens = request.token_ids_between(start, start + n - num_drafts)
        if num_drafts:
            tokens += request.spec_token_ids
        self.kv.allocate_blocks(rid, n, computed_blocks, new_token_ids=tokens, num_draft_tokens=num_drafts,
                                num_lookahead_tokens=lookahead, num_query_tokens=num_query_tokens, preempted=preempted)
        out.num_scheduled_tokens[rid] = n
        if num_drafts:
            out.scheduled_spec_decode_tokens[rid] = list(request.spec_token_ids)
        self._tell_runner(request, out)

    def _tell_runner(self, request: Request, out: SchedulerOutput) -> None:
        """Describe a scheduled request for the runner: in full the first time, else only what changed."""
        rid = request.request_id
        sent = self._runner_table_len.get(rid)
        if sent is None:
            block_ids = self.kv.get_block_ids(rid)
            out.scheduled_new_reqs.append(NewRequestData(rid, request.prompt_token_ids, list(request.output_token_ids),
                                                         request.params, block_ids, request.num_computed_tokens))
            self._runner_table_len[rid] = _table_len(block_ids)
            return
        if rid in self._resumed:  # re-admitted: its table starts over
            self._resumed.discard(rid)
            self._dropped_blocks.pop(rid, None)
            block_ids = self.kv.get_block_ids(rid)
            out.scheduled_cached_reqs.add(rid, True, block_ids, 0, request.num_computed_tokens)
            self._runner_table_len[rid] = _table_len(block_ids)
            return
        if isinstance(sent, tuple):  # a hybrid model: a table per group, only ever appended to (no drafts)
            new = self.kv.get_block_ids(rid, start=sent)
            out.scheduled_cached_reqs.add(rid, False, new, 0, request.num_computed_tokens)
            self._runner_table_len[rid] = tuple(k + len(n) for k, n in zip(sent, new))
            return
        dropped = self._dropped_blocks.pop(rid, 0)
        kept = sent - dropped
        new = self.kv.get_block_ids(rid, start=kept)
        out.scheduled_cached_reqs.add(rid, False, new, dropped, request.num_computed_tokens)
        self._runner_table_len[rid] = kept + len(new)

    def _admit(self, request: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Admit the request at the front of the waiting queue if its first chunk fits; its tokens, or None."""
        # A re-admitted (recompute-preempted) request looks up its prompt *and* outputs: the blocks it
        # freed may still be cached, which makes the recompute cheaper.
        rid = request.request_id
        if rid in self._admission_hits:  # its asynchronous load finished: it holds its blocks already
            return self._admit_loaded(request, budget, out)
        hits, num_cached = self.kv.get_computed_blocks(rid, request.all_token_ids)
        # After the GPU hit, a connector may supply the next tokens' K/V (vLLM's external tokens): they take
        # blocks but no budget, since they are loaded, not computed.
        num_external, load_async = 0, False
        if self.connector is not None and rid not in self._failed_loads:
            num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_cached)
            check_int("get_num_new_matched_tokens", num_external, minimum=0)
            if num_cached + num_external >= request.num_tokens:
                raise RuntimeError(f"the connector offered {num_external} tokens of request {rid!r} after "
                                   f"{num_cached} cached, but at least its last token must be computed "
                                   f"({request.num_tokens} in all)")
        if load_async and num_external:
            return self._start_remote_load(request, hits, num_cached, num_external)
        num_computed = num_cached + num_external
        n = next_chunk_size(request.num_tokens - num_computed, budget)
        lookahead = self._lookahead(request, n, start=num_computed)
        if self.kv.num_blocks_to_allocate(rid, num_external + n, hits, lookahead) > self.kv.num_free_blocks:
            return None
        # An Orca-style reservation must also find one contiguous range, where the manager places them.
        if request.reserved_len and not self.kv.reserve_range(rid, num_computed + n + lookahead):
            return None
        # The whole prompt was looked up, whatever this step's chunk. A re-admission after a preemption finds its own
        # blocks again, which is no prefix sharing: counted apart, as vLLM V1 does (preempted_queries and
        # preempted_hits of PrefixCacheStats, vllm/v1/metrics/stats.py, outside the exported hit rate).
        preempted = request.num_preemptions > 0
        if num_external:
            # The external tokens' blocks first (hashed and cached like computed ones: the load fills them before
            # this step's forward pass reads them), then this step's chunk after them.
            self.kv.allocate_blocks(rid, num_external, hits, new_token_ids=request.token_ids_between(num_cached,
                                                                                                     num_computed),
                                    num_query_tokens=request.num_tokens, preempted=preempted)
            request.num_computed_tokens = num_computed
            self._allocate(request, n, out, lookahead=lookahead)
        else:
            request.num_computed_tokens = num_cached
            self._allocate(request, n, out, hits, num_query_tokens=request.num_tokens, preempted=preempted)
        if self.connector is not None:
            self.connector.update_state_after_alloc(request, self.kv.get_block_ids(rid), num_external)
        self._admitted(request, hits)
        out.admitted.append(request.request_id)
        return n

    def _start_remote_load(self, request: Request, hits, num_cached: int, num_external: int) -> int | None:
        """Park a request whose external tokens load asynchronously: their blocks now, uncached; 0 tokens of budget."""
        rid = request.request_id
        if self.kv.num_blocks_to_allocate(rid, num_external, hits) > self.kv.num_free_blocks:
            return None
        self.kv.allocate_blocks(rid, num_external, hits,
                                new_token_ids=request.token_ids_between(num_cached, num_cached + num_external),
                                num_query_tokens=request.num_tokens, preempted=request.num_preemptions > 0,
                                delay_cache_blocks=True)
        request.num_computed_tokens = num_cached
        self.connector.update_state_after_alloc(request, self.kv.get_block_ids(rid), num_external)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote_kvs[rid] = (request, list(hits))
        return 0

    def _finish_remote_loads(self, finished_recving) -> None:
        """Requests whose loads ended: cache what arrived and queue them again at the front, or free an aborted one."""
        size = self.kv.block_size
        for rid in sorted(finished_recving, key=lambda r: self.requests[r].arrival if r in self.requests else 0,
                          reverse=True):  # appendleft in reverse arrival order keeps the earliest first
            if rid in self._free_after_load:
                self._free_after_load.discard(rid)
                self._invalid_block_ids.difference_update(self.kv.get_block_ids(rid))
                self.kv.free(rid)
                continue
            entry = self.waiting_for_remote_kvs.pop(rid, None)
            if entry is None:
                continue
            request, hits = entry
            loaded = self.kv.num_tokens[rid]  # the hit plus the loaded tokens
            table = self.kv.get_block_ids(rid)
            failed = [i for i, block_id in enumerate(table) if block_id in self._invalid_block_ids]
            self._invalid_block_ids.difference_update(table)
            request.status = RequestStatus.WAITING
            if failed:
                # Keep the blocks before the first failed one (cached, so the re-admission hits them), drop the rest.
                self.num_failed_loads += 1
                self._failed_loads.add(rid)
                keep = max(failed[0] * size, request.num_computed_tokens)
                self.kv.cache_blocks(rid, keep)
                self.kv.free(rid)
                request.num_computed_tokens = 0
            else:
                self.kv.cache_blocks(rid)
                request.num_computed_tokens = loaded
                self._admission_hits[rid] = hits
            self.waiting.appendleft(request)

    def _admit_loaded(self, request: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Admit a request whose load finished: it holds its blocks, and computes the rest of its prompt from there."""
        rid = request.request_id
        n = next_chunk_size(request.num_tokens - request.num_computed_tokens, budget)
        lookahead = self._lookahead(request, n)
        if self.kv.num_blocks_to_allocate(rid, n, (), lookahead) > self.kv.num_free_blocks:
            return None
        self._allocate(request, n, out, lookahead=lookahead)
        self._admitted(request, self._admission_hits.pop(rid))
        out.admitted.append(rid)
        return n

    def _swap_in(self, request: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Bring the front swapped request back if its blocks and next chunk fit; its tokens, or None."""
        rid, computed = request.request_id, request.num_computed_tokens
        tokens = request.all_token_ids
        hits, num_cached = self.kv.get_computed_blocks(rid, tokens[:computed])
        n = next_chunk_size(request.num_tokens_to_compute, budget)
        # Room for the swapped-in blocks and this step's tokens, checked before anything changes.
        needed = self.kv.num_blocks_to_allocate(rid, computed + n - num_cached, hits, self._lookahead(request, n))
        if needed > self.kv.num_free_blocks:
            return None
        if request.reserved_len and not self.kv.reserve_range(rid, computed + n + self._lookahead(request, n)):
            return None
        cpu_ids = self.cpu_blocks.pop(rid)
        # Hits stop one token short of what was computed, so at least one token's block is copied back.
        self.kv.allocate_blocks(rid, computed - num_cached, hits, new_token_ids=tokens[num_cached:computed],
                                num_query_tokens=computed, preempted=True)
        first = num_cached // self.kv.block_size  # blocks still cached need no copy
        gpu_ids = self.kv.get_block_ids(rid, start=first)[:len(cpu_ids) - first]
        out.blocks_to_swap_in += zip(cpu_ids[first:], gpu_ids)
        # Free now: the runner copies them back before this step's forward pass, and a step that swaps in never
        # swaps out (it preempted nobody), so no swap-out of this step can be handed these CPU blocks.
        self._free_cpu_blocks(cpu_ids)
        self._admitted(request, hits)
        self._allocate(request, n, out)
        out.swapped_in.append(rid)
        out.admitted.append(rid)
        return n

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        rid = request.request_id
        request.spec_token_ids.clear()  # guessed for a step that will not come; proposed afresh once it runs again
        self.num_preemptions += 1
        request.num_preemptions += 1
        out.preempted_req_ids.append(rid)
        self._resumed.add(rid)
        if self.preemption_mode == "swap":
            # Only the blocks of computed tokens: lookahead blocks past them hold nothing worth keeping.
            table = self.kv.get_block_ids(rid)[:num_blocks_needed(request.num_computed_tokens, self.kv.block_size)]
            if len(table) <= self.num_free_cpu_blocks:
                cpu_ids = [b.block_id for b in self.cpu_block_pool.get_new_blocks(len(table))] if table else []
                out.blocks_to_swap_out += zip(table, cpu_ids)
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
        # Behind the requests whose loads finished: they hold their blocks while they wait, and with nobody running
        # a victim in front of them that does not fit would wait forever for blocks only their admission frees.
        front = 0
        while front < len(self.waiting) and self.waiting[front].request_id in self._admission_hits:
            front += 1
        self.waiting.insert(front, request)

    # ----- after the step -----
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply the runner's tokens: append them up to a stop, roll back rejected drafts, keep the new drafts, and
        release the requests that finished. Returns one EngineCoreOutput per request that got tokens."""
        self.last_rollbacks = {}
        if self.connector is not None:
            self.connector.update_connector_output(runner_output.finished_sending, runner_output.finished_recving)
            if runner_output.invalid_block_ids:  # reported as soon as known, used when the load ends
                self._invalid_block_ids |= runner_output.invalid_block_ids
            if runner_output.finished_recving:
                self._finish_remote_loads(runner_output.finished_recving)
            for rid in runner_output.finished_sending or ():
                if rid in self._free_after_save:
                    self._free_after_save.discard(rid)
                    self.kv.free(rid)
        index = {rid: i for i, rid in enumerate(runner_output.req_ids)}
        requests, sampled = self.requests, runner_output.sampled_token_ids
        spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        outputs = []
        done = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            request = requests[rid]
            if request.status.finished:  # aborted after it was scheduled
                continue
            i = index.get(rid)
            tokens = sampled[i] if i is not None else []
            if not tokens:  # a prefill chunk that does not finish its prompt
                request.num_computed_tokens += n
                continue
            emitted = []
            for token in tokens:
                request.append_output(token)
                emitted.append(token)
                if request.status.finished:
                    break
            num_drafts = len(spec_decode_tokens[rid]) if spec_decode_tokens and rid in spec_decode_tokens else 0
            accepted = len(tokens) - 1  # every token but the last was a draft the target agreed with
            request.num_computed_tokens += n - (num_drafts - accepted)
            if self.spec_stats is not None:
                self.spec_stats.observe(num_drafts, accepted)
                freed = self.kv.rollback_draft_tokens(rid, accepted, self.num_lookahead_tokens)
                if freed:
                    self._dropped_blocks[rid] = self._dropped_blocks.get(rid, 0) + len(freed)
                if num_drafts > accepted:
                    self.last_rollbacks[rid] = (request.num_computed_tokens, num_drafts - accepted, freed)
            if request.spec_token_ids:
                request.spec_token_ids = []
            if request.status.finished:
                done.append(request)
            elif runner_output.spec_token_ids is not None:
                request.spec_token_ids = list(runner_output.spec_token_ids[i])
            outputs.append(EngineCoreOutput(rid, emitted, request.status, num_drafts, accepted))
        for request in done:  # after every rollback, so blocks go back to the pool in the same order each step
            params = self._free(request)
            if params is not None:  # for a peer (a decode server): on the request's last output
                for output in reversed(outputs):
                    if output.request_id == request.request_id:
                        output.kv_transfer_params = params
                        break
        if self._remove_skipped is not None:
            for rid in scheduler_output.num_scheduled_tokens:
                request = requests[rid]
                if request.status == RequestStatus.RUNNING:
                    self._remove_skipped(rid, request.num_computed_tokens)
        return outputs

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> dict[str, dict]:
        """Stop requests now (an abort, a stop string) and release whatever they hold: blocks, CPU blocks, a queue
        place. Returns the kv_transfer_params a connector has for a peer, by request id (most have none)."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status}")
        params = {}
        for rid in request_ids:
            request = self.requests[rid]
            if request.status.finished:
                continue
            request.status = status  # first: the connector's request_finished reads how it ended
            out = self._free(request)
            if out is not None:
                params[rid] = out
        return params

    def _free(self, request: Request) -> dict | None:
        """Release a request that stopped (or was aborted) from whichever queue holds it; returns the params its
        connector has for a peer (kv_transfer_params), if any."""
        rid = request.request_id
        request.spec_token_ids = []
        delay_free, params = False, None
        if self.connector is not None:
            delay_free, params = self.connector.request_finished(request, self.kv.get_block_ids(rid)
                                                                 if rid in self.kv.req_to_blocks else [])
        self._admission_hits.pop(rid, None)
        self._failed_loads.discard(rid)
        if rid in self.waiting_for_remote_kvs:  # its load still writes into its blocks: free them when it ends
            del self.waiting_for_remote_kvs[rid]
            self._free_after_load.add(rid)
        elif request in self.running:
            self._remove_running(request)
            if delay_free:  # a save still reads its blocks: free them when the worker reports it finished
                self._free_after_save.add(rid)
            else:
                self.kv.free(rid)
        elif request in self.swapped:
            self.swapped.remove(request)
            self._free_cpu_blocks(self.cpu_blocks.pop(rid))
        elif request in self.waiting:
            self.waiting.remove(request)
            if rid in self.kv.req_to_blocks:  # loaded, not yet running again
                if delay_free:
                    self._free_after_save.add(rid)
                else:
                    self.kv.free(rid)
        if self._runner_table_len.pop(rid, None) is not None:
            self._finished_req_ids.add(rid)  # the runner forgets it at the next step
        self._resumed.discard(rid)
        self._dropped_blocks.pop(rid, None)
        return params
