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

A request with n > 1 runs as n child requests (as in vLLM V1); with prefix caching on they share the
prompt's full blocks. Every problem with a new request is found before anything changes, so a bad
request raises and the engine keeps serving the others.
"""

import dataclasses
from collections.abc import Sequence

import torch

from kvlab.cache.batched_attention import BatchedPagedKVCache
from kvlab.cache.kv_storage import block_bytes as kv_block_bytes
from kvlab.cache.kv_storage import resolve_kv_cache_dtype
from kvlab.cache.swap import SwapSpace
from kvlab.core.block_views import counters_for
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.paging import num_blocks_needed
from kvlab.engine.model_runner import ModelRunner
from kvlab.engine.request import FINISH_REASONS, CompletionOutput, Request, RequestOutput, RequestStatus
from kvlab.engine.sampler import sample
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.stats import EngineStats, StepRecord
from kvlab.model.config import context_length, eos_token_ids
from kvlab.validation import check_block_size, check_positive_int, is_integer

DEFAULT_POOL_BYTES = 512 * 2**20  # the pool's size when neither num_blocks nor kv_cache_memory is given


class LLMEngine:
    """A continuous-batching engine over kvlab's paged cache, block pool, prefix cache and scheduler."""

    def __init__(self, model, tokenizer=None, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory: int | None = None, max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                 enable_prefix_caching: bool = True, preemption_mode: str = "recompute",
                 num_cpu_blocks: int | None = None, max_model_len: int | None = None, seed: int = 0,
                 decode_backend: str = "auto", kv_cache_dtype: str = "auto"):
        # First, so a bad name allocates nothing; "fp8" becomes "fp8_e4m3".
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype)
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
        swap_space = None
        if preemption_mode == "swap":
            swap_space = SwapSpace(self.cache, num_blocks if num_cpu_blocks is None else num_cpu_blocks)
        self.swap_space = swap_space
        self.scheduler = Scheduler(self.kv_cache_manager, max_num_seqs, max_num_batched_tokens, preemption_mode,
                                   swap_space)
        self.runner = ModelRunner(model, self.cache)
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed of their own
        self.requests: dict[str, Request] = {}       # every request ever added, children of n > 1 included
        self.parents: dict[str, list[str]] = {}      # user request id -> its child request ids (in order)
        self.step_count = 0
        self.num_tokens_computed = 0                 # token positions run through the model, recomputes included
        self.history: list[StepRecord] = []          # one record per step, for the timeline widget
        self.num_tokens_wasted = 0                   # positions computed for requests already finished
        self._arrivals = 0
        eos = eos_token_ids(model)
        self.eos_token_id = eos[0] if eos else None

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

    def add_request(self, request_id, prompt, params: SamplingParams | None = None) -> None:
        """Queue a request (text or token ids); checked completely before anything changes."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(request_id)
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
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
        if num_blocks_needed(longest, self.block_size) > self.num_blocks:
            raise ValueError(
                f"request {request_id!r} can never fit: prompt and max_tokens need up to {longest} tokens = "
                f"{num_blocks_needed(longest, self.block_size)} blocks of {self.block_size}, but the pool has "
                f"{self.num_blocks} blocks in all")
        children = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        self.parents[request_id] = children
        for i, child in enumerate(children):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + i
                child_params = dataclasses.replace(params, n=1, seed=seed)
            req = Request(child, ids, child_params, self._arrivals, self.eos_token_id, text)
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
                self.scheduler.finish(req)
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
        """Schedule, run one forward pass, sample; returns the outputs of the requests that got a token."""
        sched = self.scheduler.schedule()
        self.step_count += 1
        moved: dict[str, None] = {}
        prefills = [s.request.request_id for s in sched.scheduled
                    if not (s.request.output_token_ids and s.request.num_tokens_to_compute == 1)]
        if sched.scheduled:
            self.num_tokens_computed += sched.num_batched_tokens
            # Measured, not assumed: a finished request is never scheduled, so this stays 0 (static batching's is not).
            self.num_tokens_wasted += sum(s.num_new_tokens for s in sched.scheduled if s.request.status.finished)
            logits = self.runner.execute(sched, self.kv_cache_manager.block_tables)
            rows, params, gens, reqs = [], [], [], []
            for row, s in enumerate(sched.scheduled):
                req = s.request
                req.num_computed_tokens += s.num_new_tokens
                if req.num_computed_tokens == req.num_tokens:  # the prompt is done: this row gives a token
                    rows.append(row)
                    params.append(req.params)
                    gens.append(req.generator or self.generator)
                    reqs.append(req)
            tokens = sample(logits[rows], params, gens) if rows else []
            for req, token in zip(reqs, tokens):
                req.append_output(token, self.max_model_len)
                if req.status.finished:
                    self.scheduler.finish(req)
                moved[self._parent_of(req.request_id)] = None
        self._record(sched, prefills)
        return [self.output(rid) for rid in moved]

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
            })

        counters = counters_for(blocks, size, self.step_count)
        counters["extra"] = {"preemptions": self.scheduler.num_preemptions}
        return {
            "block_size": size, "num_blocks": self.num_blocks, "step": self.step_count,
            "done": not self.has_unfinished_requests(), "blocks": blocks, "sequences": sequences, "counters": counters,
        }
