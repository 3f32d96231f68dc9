"""Chapter 6's engine: requests in, one scheduled forward pass per step, tokens out (vLLM's LLMEngine shape).

    engine = LLMEngine(model, tokenizer, block_size=16, num_blocks=64, max_num_seqs=8,
                       max_num_batched_tokens=64, preemption_mode="recompute")
    engine.add_request("r0", "OTHELLO.\\n", SamplingParams(temperature=0, max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():       # RequestOutputs of the requests that moved this step
            ...

kv_cache_dtype="int8" or "fp8" (vLLM's knob) keeps K/V in 8 bits with a scale per (block, KV head):
the same byte budget (kv_cache_memory) then holds about 4x the blocks of a float32 model, 2x of a
float16 one. Every decode backend, swap preemption and LLM.beam_search (whose copy-on-write carries
the scales) run on it.

speculative_config={"method": "ngram" or "draft_model", "num_speculative_tokens": k, ...} (vLLM's
knob, kvlab.spec_decode.config) makes every decode verify up to k guessed tokens in the same ragged
pass as the other requests' prefills and decodes: greedy output stays exactly the target's, sampled
output follows the target's distribution (kvlab.engine.rejection_sampler). A draft model's K/V get
pools of their own under the same block ids, counted in kv_cache_memory.

A request with n > 1 runs as n child requests (as in vLLM V1); with prefix caching on they share the
prompt's full blocks. Every problem with a new request is found before anything changes, so a bad
request raises and the engine keeps serving the others.
"""

import dataclasses
import time
from collections.abc import Sequence

import torch

from kvlab.analysis.contiguous import POLICIES as RESERVATION_POLICIES
from kvlab.analysis.contiguous import reservation_slots
from kvlab.cache.batched_attention import BatchedPagedKVCache
from kvlab.cache.kv_storage import block_bytes as kv_block_bytes
from kvlab.cache.kv_storage import resolve_kv_cache_dtype
from kvlab.cache.swap import SwapSpace
from kvlab.core.block_views import counters_for
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.paging import num_blocks_needed
from kvlab.engine.metrics import Metric, RequestLatencies, engine_metrics
from kvlab.engine.model_runner import ModelRunner
from kvlab.engine.rejection_sampler import greedy_verify, rejection_sample
from kvlab.engine.request import FINISH_REASONS, CompletionOutput, Request, RequestOutput, RequestStatus
from kvlab.engine.sampler import sample, sample_with_probs, sampling_probs
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.scheduler import ScheduledRequest, Scheduler
from kvlab.engine.stats import EngineStats, StepRecord
from kvlab.model.config import context_length, eos_token_ids
from kvlab.spec_decode.config import SpeculativeConfig
from kvlab.spec_decode.draft_model import DraftModelProposer, DraftRequest
from kvlab.spec_decode.metrics import SpecDecodingStats
from kvlab.spec_decode.ngram_proposer import NgramProposer
from kvlab.validation import check_block_size, check_positive_int, is_integer

DEFAULT_POOL_BYTES = 512 * 2**20  # the pool's size when neither num_blocks nor kv_cache_memory is given


class LLMEngine:
    """A continuous-batching engine over kvlab's paged cache, block pool, prefix cache and scheduler."""

    def __init__(self, model, tokenizer=None, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory: int | None = None, max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                 enable_prefix_caching: bool = True, preemption_mode: str = "recompute",
                 num_cpu_blocks: int | None = None, max_model_len: int | None = None, seed: int = 0,
                 decode_backend: str = "auto", kv_cache_dtype: str = "auto", speculative_config=None,
                 reservation_policy: str | None = None):
        # First, so a bad name allocates nothing; "fp8" becomes "fp8_e4m3".
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype)
        self.speculative_config = None if speculative_config is None \
            else SpeculativeConfig.from_dict(speculative_config)
        if reservation_policy is not None and reservation_policy not in RESERVATION_POLICIES:
            raise ValueError(f"reservation_policy must be None (paging) or one of {', '.join(RESERVATION_POLICIES)}, "
                             f"got {reservation_policy!r}")
        # The paper's baselines on this engine: Orca reserves a request's blocks at admission, for its maximum
        # length (max), the next power of two of its real length (pow2) or its real length (oracle).
        self.reservation_policy = reservation_policy
        spec = self.speculative_config
        draft_model = self._load_draft_model(model) if spec is not None and spec.method == "draft_model" else None
        self.model, self.tokenizer = model, tokenizer
        self.block_size = check_block_size(block_size)
        self.max_model_len = context_length(model) if max_model_len is None \
            else check_positive_int("max_model_len", max_model_len)
        if self.max_model_len > context_length(model):
            raise ValueError(f"max_model_len {self.max_model_len} is beyond the model's context of "
                             f"{context_length(model)} tokens")
        check_positive_int("max_num_seqs", max_num_seqs)
        check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        # One block's bytes in the chosen storage, scales included: the same formula the cache's nbytes obeys.
        stored = str(model.dtype).removeprefix("torch.") if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        block_bytes = kv_block_bytes(model.config, stored, block_size)
        if draft_model is not None:  # the draft's own K/V under the same block ids: one block costs both
            draft_stored = str(draft_model.dtype).removeprefix("torch.") if self.kv_cache_dtype == "auto" \
                else self.kv_cache_dtype
            block_bytes += kv_block_bytes(draft_model.config, draft_stored, block_size)
        if num_blocks is not None and kv_cache_memory is not None:
            raise ValueError("give num_blocks or kv_cache_memory (a byte budget for the pool), not both")
        if kv_cache_memory is not None:
            if not is_integer(kv_cache_memory) or kv_cache_memory < block_bytes:
                raise ValueError(f"kv_cache_memory must be an integer number of bytes, at least one block "
                                 f"({block_bytes} bytes), got {kv_cache_memory!r}")
            num_blocks = kv_cache_memory // block_bytes
        elif num_blocks is None:
            # Room for max_num_seqs full-length sequences, but never more than DEFAULT_POOL_BYTES (a 32k-context
            # model would otherwise ask for gigabytes) and never less than one full-length sequence.
            full = num_blocks_needed(self.max_model_len, block_size)
            num_blocks = max(full, min(max_num_seqs * full, DEFAULT_POOL_BYTES // block_bytes))
        check_positive_int("num_blocks", num_blocks)
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        # Decodes are attended in one batch (torch), or by the Triton kernel on a GPU; "torch" forces the batched
        # torch path. Either reads the storage kv_cache_dtype chose.
        self.cache = BatchedPagedKVCache.for_model(model, num_blocks, block_size, decode_backend,
                                                   kv_cache_dtype=self.kv_cache_dtype)
        self.drafter = None
        if spec is not None and spec.method == "ngram":
            self.drafter = NgramProposer(spec)
        elif spec is not None:
            self.drafter = DraftModelProposer(draft_model, num_blocks, block_size, spec.num_speculative_tokens,
                                              sample_with_probs, decode_backend, kv_cache_dtype=self.kv_cache_dtype)
        self.spec_stats = None if spec is None else SpecDecodingStats(spec.num_speculative_tokens)
        swap_space = None
        if preemption_mode == "swap":
            extra = (self.drafter.cache,) if isinstance(self.drafter, DraftModelProposer) else ()
            swap_space = SwapSpace(self.cache, num_blocks if num_cpu_blocks is None else num_cpu_blocks, extra)
        self.swap_space = swap_space
        self.scheduler = Scheduler(self.kv_cache_manager, max_num_seqs, max_num_batched_tokens, preemption_mode,
                                   swap_space, num_lookahead_tokens=spec.num_lookahead_tokens if spec else 0)
        self.runner = ModelRunner(model, self.cache)
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed of their own
        self.requests: dict[str, Request] = {}       # every request ever added, children of n > 1 included
        self.parents: dict[str, list[str]] = {}      # user request id -> its child request ids (in order)
        self.step_count = 0
        self.num_tokens_computed = 0                 # token positions run through the model, recomputes included
        self.history: list[StepRecord] = []          # one record per step, for the timeline widget
        self.num_tokens_wasted = 0                   # positions computed for requests already finished
        self._arrivals = 0
        self.num_prompt_tokens = 0                   # prompt tokens of requests that produced their first token
        self.num_generation_tokens = 0
        self.num_finished_requests = 0
        self.latencies = RequestLatencies()          # TTFT, inter-token and end-to-end, from add_request on
        self._draft_probs: dict[str, torch.Tensor] = {}  # request id -> its drafts' distributions [k, V]
        # The last step's rollbacks, for the block map: request id -> (first rejected position, rejected, freed ids).
        self.last_rollbacks: dict[str, tuple[int, int, list[int]]] = {}
        eos = eos_token_ids(model)
        self.eos_token_id = eos[0] if eos else None

    def _load_draft_model(self, model):
        """The speculative config's draft model, loaded in the target's dtype and on its device; checked against it."""
        source = self.speculative_config.model
        if source is None or isinstance(source, str) or hasattr(source, "__fspath__"):
            from kvlab.model.loader import load_model
            from kvlab.paths import DEFAULT_DRAFT_MODEL_DIR

            draft, _ = load_model(DEFAULT_DRAFT_MODEL_DIR if source is None else source, dtype=model.dtype,
                                  device=str(model.device))
        else:
            draft = source
        if draft.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) differs from the "
                             f"target's ({model.config.vocab_size}): a draft must share the target's tokenizer")
        if context_length(draft) < context_length(model):
            raise ValueError(f"the draft model's context ({context_length(draft)} tokens) is shorter than the "
                             f"target's ({context_length(model)})")
        return draft

    # ----- requests -----
    def _token_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: give LLMEngine(model, tokenizer) or token ids")
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, Sequence) or any(not is_integer(t) for t in prompt):
            raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        return None, list(prompt)

    def check_request(self, prompt, params: SamplingParams | None = None, request_id="request") -> tuple:
        """(text, token ids, params) of a request that the engine can serve; ValueError saying why otherwise.

        Reads only the engine's fixed limits, so a front end may call it from any thread.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self._token_ids(prompt)
        if not ids:
            raise ValueError(f"request {request_id!r} has an empty prompt: give at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r} has token id {bad[0]} outside the vocabulary of {vocab}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {request_id!r}: its prompt of {len(ids)} tokens leaves no room for a new "
                             f"token within max_model_len {self.max_model_len}")
        longest = min(len(ids) + params.max_tokens, self.max_model_len)
        if self.reservation_policy is not None:  # the reservation must fit, not only the tokens
            longest = reservation_slots(self.reservation_policy, len(ids), longest - len(ids), self.max_model_len)
        if num_blocks_needed(longest, self.block_size) > self.num_blocks:
            raise ValueError(
                f"request {request_id!r} can never fit: prompt and max_tokens need up to {longest} tokens = "
                f"{num_blocks_needed(longest, self.block_size)} blocks of {self.block_size}, but the pool has "
                f"{self.num_blocks} blocks in all")
        return text, ids, params

    def add_request(self, request_id, prompt, params: SamplingParams | None = None) -> None:
        """Queue a request (text or token ids); checked completely before anything changes."""
        request_id = str(request_id)
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids, params = self.check_request(prompt, params, request_id)
        children = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        self.parents[request_id] = children
        for i, child in enumerate(children):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + i
                child_params = dataclasses.replace(params, n=1, seed=seed)
            req = Request(child, ids, child_params, self._arrivals, self.eos_token_id, text, self.max_model_len)
            req.arrival_time = req.last_token_time = time.perf_counter()
            if self.reservation_policy is not None:
                # The real length is prompt + max_tokens: the baselines run each request to its max_tokens.
                req.reserved_len = reservation_slots(self.reservation_policy, len(ids),
                                                     min(params.max_tokens, self.max_model_len - len(ids)),
                                                     self.max_model_len)
            self._arrivals += 1
            self.requests[child] = req
            self.scheduler.add(req)

    def abort_request(self, request_id) -> RequestOutput:
        """Stop a request now and free everything it holds (blocks, CPU blocks, its queue place)."""
        request_id = str(request_id)
        if request_id not in self.parents:
            raise ValueError(f"no request {request_id!r} to abort "
                             f"(known: {', '.join(list(self.parents)[-5:]) or 'none'})")
        reqs = [self.requests[c] for c in self.parents[request_id]]
        if all(r.status.finished for r in reqs):
            raise ValueError(f"request {request_id!r} has already finished")
        for req in reqs:
            if not req.status.finished:
                self._finish(req)
                req.status = RequestStatus.FINISHED_ABORTED
        return self.output(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ----- outputs -----
    def _decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    def output(self, request_id) -> RequestOutput:
        """The request's RequestOutput now: one CompletionOutput per child, in order."""
        reqs = [self.requests[c] for c in self.parents[str(request_id)]]
        first = reqs[0]
        return RequestOutput(
            request_id=str(request_id), prompt=first.prompt, prompt_token_ids=list(first.prompt_token_ids),
            outputs=[CompletionOutput(i, self._decode(r.output_token_ids), list(r.output_token_ids),
                                      FINISH_REASONS.get(r.status)) for i, r in enumerate(reqs)],
            finished=all(r.status.finished for r in reqs))

    def _parent_of(self, child: str) -> str:
        if child in self.parents:
            return child
        return child.split("_", 1)[1]

    # ----- one step -----
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample (or verify drafts); returns the outputs of the requests that moved."""
        sched = self.scheduler.schedule()
        self.step_count += 1
        moved: dict[str, None] = {}
        prefills = [s.request.request_id for s in sched.scheduled
                    if not (s.request.output_token_ids and s.request.num_tokens_to_compute == 1)]
        self._track_drafter(sched)
        self.last_rollbacks = {}
        if sched.scheduled:
            self.num_tokens_computed += sched.num_batched_tokens
            # Measured, not assumed: a finished request is never scheduled, so this stays 0 (static batching's is not).
            self.num_tokens_wasted += sum(s.num_new_tokens for s in sched.scheduled if s.request.status.finished)
            logits = self.runner.execute(sched, self.kv_cache_manager.block_tables)
            rows = torch.tensor([s.num_draft_tokens + 1 for s in sched.scheduled]).cumsum(0).tolist()
            plain = []  # requests without drafts that sample: one batched draw
            for i, s in enumerate(sched.scheduled):
                if s.samples and not s.num_draft_tokens:
                    plain.append((s, rows[i] - 1))
            tokens = sample(logits[[row for _, row in plain]], [s.request.params for s, _ in plain],
                            [s.request.generator or self.generator for s, _ in plain]) if plain else []
            sampled = {id(s): [t] for (s, _), t in zip(plain, tokens)}
            for i, s in enumerate(sched.scheduled):
                if s.num_draft_tokens:
                    sampled[id(s)] = self._verify(s, logits[rows[i] - s.num_draft_tokens - 1:rows[i]])
            for s in sched.scheduled:
                req = s.request
                if not s.samples:  # a prefill chunk that does not finish its prompt
                    req.num_computed_tokens += s.num_new_tokens
                    continue
                self._emit(s, sampled[id(s)])
                moved[self._parent_of(req.request_id)] = None
            self._propose(sched)
            for s in sched.scheduled:
                if s.request.status.finished:
                    self._finish(s.request)
                    self.num_finished_requests += 1
                    self.latencies.e2e.observe(s.request.last_token_time - s.request.arrival_time)
        self._record(sched, prefills)
        return [self.output(rid) for rid in moved]

    def _verify(self, s: ScheduledRequest, rows: torch.Tensor) -> list[int]:
        """The tokens a speculating request emits: its accepted drafts, then one recovered or bonus token."""
        req = s.request
        drafts = req.spec_token_ids[:s.num_draft_tokens]
        if req.params.greedy:
            return greedy_verify(drafts, rows)
        draft_probs = self._draft_probs.get(req.request_id)
        if draft_probs is not None:
            draft_probs = draft_probs[:len(drafts)]
        return rejection_sample(drafts, sampling_probs(rows, req.params), draft_probs,
                                req.generator or self.generator)

    def _emit(self, s: ScheduledRequest, tokens: list[int]) -> None:
        """Append a request's new tokens (stopping where it finishes) and roll back its rejected drafts."""
        req = s.request
        now = time.perf_counter()
        if not req.output_token_ids:
            self.num_prompt_tokens += len(req.prompt_token_ids)
            self.latencies.ttft.observe(now - req.arrival_time)
        else:
            self.latencies.itl.observe(now - req.last_token_time)
        req.last_token_time = now
        emitted = 0
        for token in tokens:
            req.append_output(token, self.max_model_len)
            emitted += 1
            if req.status.finished:
                break
        self.num_generation_tokens += emitted
        accepted = len(tokens) - 1  # every emitted token but the last was a draft the target agreed with
        req.num_computed_tokens += s.num_new_tokens - (s.num_draft_tokens - accepted)
        if self.spec_stats is not None:
            self.spec_stats.observe(s.num_draft_tokens, accepted)
            freed = self.kv_cache_manager.rollback_draft_tokens(req.request_id, accepted,
                                                                self.scheduler.num_lookahead_tokens)
            if s.num_draft_tokens > accepted:
                self.last_rollbacks[req.request_id] = (req.num_computed_tokens, s.num_draft_tokens - accepted, freed)
        req.spec_token_ids = []
        self._draft_probs.pop(req.request_id, None)

    def _propose(self, sched) -> None:
        """After verification: new drafts for every request still decoding (and the draft model's catch-up)."""
        if self.drafter is None:
            return
        k = self.speculative_config.num_speculative_tokens
        if isinstance(self.drafter, NgramProposer):
            for s in sched.scheduled:
                req = s.request
                if s.samples and not req.status.finished:
                    req.spec_token_ids = self.drafter.propose(req.all_token_ids, self._max_drafts(req))
            return
        tables = self.kv_cache_manager.block_tables
        work = []
        for s in sched.scheduled:
            req = s.request
            proposing = s.samples and not req.status.finished
            work.append(DraftRequest(req.request_id, req.all_token_ids, tables[req.request_id],
                                     req.num_computed_tokens, min(k, self._max_drafts(req)) if proposing else 0,
                                     req.params, req.generator or self.generator))
        for s, (drafts, probs) in zip(sched.scheduled, self.drafter.propose(work)):
            if drafts:
                s.request.spec_token_ids = drafts
                if probs is not None:
                    self._draft_probs[s.request.request_id] = probs

    @staticmethod
    def _max_drafts(req: Request) -> int:
        # d drafts give up to d + 1 tokens: never guess past the request's longest length.
        return max(0, req.max_len - req.num_tokens - 1)

    def _track_drafter(self, sched) -> None:
        """Keep the draft model's view of each request in step with what the scheduler just did to its blocks."""
        if not isinstance(self.drafter, DraftModelProposer):
            return
        for rid in sched.preempted:
            req = self.requests[rid]
            if req.status == RequestStatus.SWAPPED:
                self.drafter.keep(rid, req.num_computed_tokens)  # the swap kept the blocks of computed tokens
            else:
                self.drafter.free(rid)
        for rid in sched.admitted:
            if rid not in sched.swapped_in:
                self.drafter.admit(rid, self.requests[rid].num_computed_tokens)

    def _finish(self, req: Request) -> None:
        self.scheduler.finish(req)
        req.spec_token_ids = []
        self._draft_probs.pop(req.request_id, None)
        if isinstance(self.drafter, DraftModelProposer):
            self.drafter.free(req.request_id)

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics now, under vLLM's names (kvlab.engine.metrics)."""
        return engine_metrics(self)

    def _record(self, sched, prefills: list[str]) -> None:
        self.history.append(StepRecord(
            step=self.step_count,
            status={rid: r.status.value for rid, r in self.requests.items()},
            tokens={s.request.request_id: s.num_new_tokens for s in sched.scheduled},
            prefill=tuple(prefills),
            preempted=tuple(sched.preempted),
            used_blocks=self.kv_cache_manager.num_used_blocks,
            num_blocks=self.num_blocks,
            batched_tokens=sched.num_batched_tokens,
        ))

    def stats(self) -> EngineStats:
        """The run's counters so far, under the names static batching reports too."""
        return EngineStats(
            num_steps=self.step_count,
            num_forward_passes=self.runner.num_forward_passes,
            num_tokens_computed=self.num_tokens_computed,
            num_tokens_wasted=self.num_tokens_wasted,
            num_preemptions=self.scheduler.num_preemptions,
            peak_used_blocks=max((record.used_blocks for record in self.history), default=0),
        )

    # ----- the block map -----
    def snapshot(self) -> dict:
        """The pool and block tables as the block map's plain data (kvlab.widgets.block_map)."""
        manager, size = self.kv_cache_manager, self.block_size
        blocks = manager.block_views()
        tables = manager.block_tables
        sequences = []
        for rid, req in self.requests.items():
            sequences.append({
                "id": rid, "status": req.status.value, "block_table": tables.get(rid, []),
                "tokens_stored": manager.num_tokens.get(rid, 0), "prompt_ids": req.prompt_token_ids,
                "output_ids": req.output_token_ids,
                "num_cached_tokens": manager.num_cached_tokens.get(rid),
                "spec_token_ids": list(req.spec_token_ids),
            })

        if self.speculative_config is not None:
            self._mark_draft_slots(blocks, tables)
        counters = counters_for(blocks, size, self.step_count)
        counters["extra"] = {"preemptions": self.scheduler.num_preemptions}
        return {
            "block_size": size, "num_blocks": self.num_blocks, "step": self.step_count,
            "done": not self.has_unfinished_requests(), "blocks": blocks, "sequences": sequences, "counters": counters,
        }

    def _mark_draft_slots(self, blocks: list[dict], tables: dict) -> None:
        """Per block: slots of pending draft tokens ("draft") and of drafts rolled back in the last step."""
        size = self.block_size
        for rid, table in tables.items():
            req = self.requests[rid]
            for pos in range(req.num_tokens, req.num_tokens + len(req.spec_token_ids)):
                if pos // size < len(table):
                    entry = blocks[table[pos // size]]
                    entry["draft"] = entry.get("draft", 0) + 1
        for rid, (first, count, freed) in self.last_rollbacks.items():
            # Rejected slots inside kept blocks, then the blocks given back whole (their slots were all past the end).
            table = tables.get(rid, [])
            for pos in range(first, first + count):
                if pos // size < len(table):
                    entry = blocks[table[pos // size]]
                    entry["rolled_back"] = entry.get("rolled_back", 0) + 1
            for block_id in freed:
                blocks[block_id]["rolled_back"] = blocks[block_id].get("rolled_back", 0) or 1
