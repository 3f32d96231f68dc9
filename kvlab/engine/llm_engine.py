"""Chapter 6's engine: requests in, one scheduled forward pass per step, tokens out (vLLM's LLMEngine shape).

    engine = LLMEngine(model, tokenizer, block_size=16, num_blocks=64, max_num_seqs=8,
                       max_num_batched_tokens=64, preemption_mode="recompute")
    engine.add_request("r0", "OTHELLO.\\n", SamplingParams(temperature=0, max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():       # RequestOutputs of the requests that moved this step
            ...

A step is vLLM V1's three calls, and nothing else but bookkeeping:

    scheduler_output = scheduler.schedule()                                   # kvlab.engine.scheduler
    runner_output = model_runner.execute_model(scheduler_output)              # kvlab.engine.model_runner
    engine_core_outputs = scheduler.update_from_output(scheduler_output, runner_output)

then the output processor (kvlab.engine.output_processor) turns the per-request tokens into
RequestOutputs: text, stop strings, n > 1 completions gathered. Requests come in through the input
processor (kvlab.engine.input_processor), which checks them completely before anything changes, so a
bad request raises and the engine keeps serving the others.

The knobs are one EngineConfig (kvlab.engine.config, vLLM's VllmConfig): give them as keyword
arguments (block_size=16, kv_cache_dtype="int8", speculative_config={...}, ...) or as config=. With
kv_cache_dtype="int8" or "fp8" (vLLM's knob) K/V are stored in 8 bits with a scale per (block, KV
head): the same byte budget (kv_cache_memory) then holds about 4x the blocks of a float32 model, 2x of
a float16 one. speculative_config={"method": "ngram" or "draft_model", "num_speculative_tokens": k, ...}
makes every decode verify up to k guessed tokens in the same ragged pass as the other requests'
prefills and decodes; a draft model's K/V get pools of their own under the same block ids, counted in
kv_cache_memory. A request with n > 1 runs as n child requests (as in vLLM V1); with prefix caching on
they share the prompt's full blocks.
"""

import dataclasses
import time

from kvlab.analysis.contiguous import make_arena
from kvlab.cache.hybrid_cache import hybrid_groups, is_hybrid
from kvlab.core.block_views import counters_for
from kvlab.core.hybrid_kv_cache_manager import HybridKVCacheManager
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_events import KVEventBatch
from kvlab.engine.config import EngineConfig
from kvlab.engine.input_processor import InputProcessor
from kvlab.engine.kv_cache_utils import (
    check_hybrid_config,
    check_kv_transfer_config,
    determine_num_blocks,
    kv_block_bytes,
    resolve_max_model_len,
)
from kvlab.engine.kv_events import make_publisher
from kvlab.engine.metrics import Metric, engine_metrics
from kvlab.engine.model_runner import ModelRunner
from kvlab.engine.output_processor import OutputProcessor
from kvlab.engine.request import Request, RequestOutput, RequestStatus
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.stats import EngineStats, StepRecord
from kvlab.kv_transfer import KVConnectorFactory, KVConnectorRole
from kvlab.model.config import eos_token_ids
from kvlab.spec_decode.draft_model import load_draft_model


class LLMEngine:
    """A continuous-batching engine over kvlab's paged cache, block pool, prefix cache and scheduler."""

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, **knobs):
        if config is None:
            config = EngineConfig.from_kwargs(**knobs)
        elif knobs:
            config = config.replace(**knobs)
        self.config = config
        self.model, self.tokenizer = model, tokenizer
        cache_config, scheduler_config, spec = config.cache_config, config.scheduler_config, config.speculative_config
        self.max_model_len = resolve_max_model_len(config.model_config.max_model_len, model)
        draft_model = load_draft_model(spec.model, model) if spec is not None and spec.method == "draft_model" \
            else None
        # A model with sliding-window layers gets vLLM's hybrid KV cache manager: a block table per group of layers.
        groups = hybrid_groups(model, cache_config.block_size, scheduler_config.disable_hybrid_kv_cache_manager)
        self.kv_cache_groups = groups if is_hybrid(groups) else None
        if self.kv_cache_groups is not None:
            check_hybrid_config(config)
        check_kv_transfer_config(config, self.kv_cache_groups is not None)
        self.block_bytes = kv_block_bytes(model, cache_config.kv_cache_dtype, cache_config.block_size, draft_model,
                                          self.kv_cache_groups)
        self.num_blocks = determine_num_blocks(cache_config, scheduler_config.max_num_seqs, self.max_model_len,
                                               self.block_bytes)
        self.input_processor = InputProcessor(tokenizer, model.config.vocab_size, self.max_model_len,
                                              cache_config.block_size, self.num_blocks,
                                              scheduler_config.reservation_policy, scheduler_config.reservation_arena,
                                              kv_cache_groups=self.kv_cache_groups,
                                              max_num_batched_tokens=scheduler_config.max_num_batched_tokens)
        self.output_processor = OutputProcessor(tokenizer)
        events = config.kv_events_config
        self.kv_events_enabled = events is not None and events.enable_kv_cache_events
        if self.kv_events_enabled and (self.kv_cache_groups is not None or not cache_config.enable_prefix_caching):
            raise ValueError("kv_events_config.enable_kv_cache_events reports the prefix cache's blocks: it needs "
                             "enable_prefix_caching=True and a model without sliding-window layers")
        # Where the pool's events go after each step (kvlab.engine.kv_events): a ZMQ socket, or nowhere.
        self.kv_event_publisher = make_publisher(events) if self.kv_events_enabled else None
        if self.kv_cache_groups is not None:
            self.kv_cache_manager = HybridKVCacheManager(self.kv_cache_groups, self.num_blocks,
                                                         cache_config.enable_prefix_caching,
                                                         hash_seed=cache_config.hash_seed)
        else:
            self.kv_cache_manager = KVCacheManager(self.num_blocks, cache_config.block_size,
                                                   cache_config.enable_prefix_caching,
                                                   reservation_arena=make_arena(scheduler_config.reservation_arena,
                                                                                self.num_blocks)
                                                   if scheduler_config.reservation_arena else None,
                                                   enable_kv_cache_events=self.kv_events_enabled,
                                                   hash_seed=cache_config.hash_seed)
        # A KV connector is built twice, as in vLLM: its scheduler half here, its worker half in the runner.
        kv_connector = {role: self._make_connector(role) for role in KVConnectorRole} \
            if config.kv_transfer_config is not None else {}
        self.scheduler = Scheduler(self.kv_cache_manager, scheduler_config.max_num_seqs,
                                   scheduler_config.max_num_batched_tokens, scheduler_config.preemption_mode,
                                   cache_config.cpu_blocks_for(self.num_blocks) if
                                   scheduler_config.preemption_mode == "swap" else 0,
                                   spec.num_lookahead_tokens if spec else 0,
                                   spec.num_speculative_tokens if spec else 0,
                                   kv_connector.get(KVConnectorRole.SCHEDULER))
        self.model_runner = ModelRunner.from_config(model, config, self.num_blocks, draft_model,
                                                    max_model_len=self.max_model_len,
                                                    kv_cache_groups=self.kv_cache_groups,
                                                    kv_connector=kv_connector.get(KVConnectorRole.WORKER))
        if kv_connector:  # vLLM's handshake: the workers' addresses reach the scheduler's half, for kv_transfer_params
            metadata = kv_connector[KVConnectorRole.WORKER].get_handshake_metadata()
            if metadata is not None:
                kv_connector[KVConnectorRole.SCHEDULER].set_xfer_handshake_metadata(metadata)
        self.eos_token_ids = frozenset(eos_token_ids(model))
        self.step_count = 0
        self.num_tokens_computed = 0                 # token positions run through the model, recomputes included
        self.num_tokens_wasted = 0                   # positions computed for requests already finished
        self.history: list[StepRecord] = []          # one record per step, for the timeline widget
        self._arrivals = 0

    def _make_connector(self, role):
        """One half of the configured KV connector, sized for this engine's blocks."""
        return KVConnectorFactory.create_connector(self.config.kv_transfer_config, role,
                                                   block_size=self.config.cache_config.block_size,
                                                   bytes_per_block=self.block_bytes,
                                                   hash_seed=self.config.cache_config.hash_seed)

    @property
    def kv_connector(self):
        """The scheduler's half of the KV connector (its tier's bookkeeping), or None."""
        return self.scheduler.connector

    # ----- the configuration, read back -----
    @property
    def block_size(self) -> int:
        return self.config.cache_config.block_size

    @property
    def kv_cache_dtype(self) -> str:
        return self.config.cache_config.kv_cache_dtype

    @property
    def speculative_config(self):
        return self.config.speculative_config

    @property
    def reservation_policy(self) -> str | None:
        return self.config.scheduler_config.reservation_policy

    # ----- what the parts own, under the names the chapters use -----
    @property
    def requests(self) -> dict[str, Request]:
        """Every request ever added, children of n > 1 included (the scheduler's)."""
        return self.scheduler.requests

    @property
    def parents(self) -> dict[str, list[str]]:
        """User request id -> its child request ids, in order."""
        return {rid: state.children for rid, state in self.output_processor.requests.items()}

    @property
    def runner(self) -> ModelRunner:
        return self.model_runner

    @property
    def cache(self):
        """The target model's paged KV cache (the runner's)."""
        return self.model_runner.cache

    @property
    def drafter(self):
        return self.model_runner.drafter

    @property
    def swap_space(self):
        return self.model_runner.swap_space

    @property
    def spec_stats(self):
        return self.scheduler.spec_stats

    @property
    def last_rollbacks(self) -> dict:
        return self.scheduler.last_rollbacks

    @property
    def latencies(self):
        return self.output_processor.latencies

    @property
    def num_prompt_tokens(self) -> int:
        return self.output_processor.num_prompt_tokens

    @property
    def num_generation_tokens(self) -> int:
        return self.output_processor.num_generation_tokens

    @property
    def num_finished_requests(self) -> int:
        return self.output_processor.num_finished_requests

    # ----- requests -----
    def check_request(self, prompt, params: SamplingParams | None = None, request_id=None) -> tuple:
        """(text, token ids, params) of a request that the engine can serve; RequestRejected saying why otherwise."""
        return self.input_processor.process(prompt, params, request_id)

    def add_request(self, request_id, prompt, params: SamplingParams | None = None) -> None:
        """Queue a request (text or token ids); checked completely before anything changes."""
        request_id = str(request_id)
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids, params = self.input_processor.process(prompt, params, request_id)
        children = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        self.output_processor.add_request(request_id, text, ids, params, children)
        reserved = self.input_processor.reserved_len(len(ids), params.max_tokens)
        for i, child in enumerate(children):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + i
                child_params = dataclasses.replace(params, n=1, seed=seed)
            request = Request(child, ids, child_params, self._arrivals, self.eos_token_ids, text, self.max_model_len)
            request.reserved_len = reserved
            self._arrivals += 1
            self.scheduler.add_request(request)

    def abort_request(self, request_id) -> RequestOutput:
        """Stop a request now and free everything it holds (blocks, CPU blocks, its queue place)."""
        request_id = str(request_id)
        state = self.output_processor.requests.get(request_id)
        if state is None:
            known = ", ".join(list(self.output_processor.requests)[-5:]) or "none"
            raise ValueError(f"no request {request_id!r} to abort (known: {known})")
        if state.finished:
            raise ValueError(f"request {request_id!r} has already finished")
        self.scheduler.finish_requests(state.children, RequestStatus.FINISHED_ABORTED)
        self.output_processor.abort(request_id)
        return self.output(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_schedulable_requests(self) -> bool:
        """Whether a step has work besides polling a KV connector: a request running, waiting or swapped out."""
        return self.scheduler.has_schedulable_requests()

    def has_pending_kv_transfers(self) -> bool:
        """Whether a KV connector's copy is in flight (a load, or a save a peer has yet to pull): keep stepping."""
        return self.scheduler.has_pending_kv_transfers()

    def shutdown(self) -> None:
        """Stop the KV connector's and the event publisher's threads and sockets (a server's last call)."""
        for connector in (self.scheduler.connector, self.model_runner.kv_connector):
            if connector is not None:
                connector.shutdown()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()

    def is_running(self, request_id) -> bool:
        """Whether the request was added and some completion of it has not finished yet."""
        state = self.output_processor.requests.get(str(request_id))
        return state is not None and not state.finished

    def output(self, request_id) -> RequestOutput:
        """The request's RequestOutput now: one CompletionOutput per child, in order."""
        return self.output_processor.output(str(request_id))

    # ----- one step -----
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, update; returns the outputs of the requests that moved."""
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.num_scheduled_tokens and not scheduler_output.preempted_req_ids:
            # Nothing to run: a step that only polls a KV connector's copies in flight, neither counted nor recorded.
            self.scheduler.update_from_output(scheduler_output, self.model_runner.execute_model(scheduler_output))
            return []
        record = self._begin_record(scheduler_output)  # before the update changes what the requests are doing
        runner_output = self.model_runner.execute_model(scheduler_output)
        engine_core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, stopped = self.output_processor.process_outputs(engine_core_outputs)
        params = self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)  # a stop string ended them
        if params:  # a connector's params for a peer go out with the request's last output
            self.output_processor.set_kv_transfer_params(params, outputs)
        self._end_record(record)
        self._publish_kv_events()
        return outputs

    def _publish_kv_events(self) -> None:
        """Hand the step's KV-cache events, if any, to the publisher as one batch (vLLM's KVEventBatch)."""
        if self.kv_event_publisher is not None:
            events = self.kv_cache_manager.take_events()
            if events:
                self.kv_event_publisher.publish(KVEventBatch(time.time(), events))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block when no request holds one (vLLM's reset_prefix_cache); False otherwise."""
        reset = getattr(self.kv_cache_manager, "reset_prefix_cache", None)
        if reset is None:
            raise ValueError("reset_prefix_cache is not available for a model with sliding-window layers")
        done = reset()
        self._publish_kv_events()
        return done

    def _begin_record(self, scheduler_output) -> dict:
        self.step_count += 1
        requests, scheduled = self.scheduler.requests, scheduler_output.num_scheduled_tokens
        self.num_tokens_computed += scheduler_output.total_num_scheduled_tokens
        # Measured, not assumed: a finished request is never scheduled, so this stays 0 (static batching's is not).
        self.num_tokens_wasted += sum(n for rid, n in scheduled.items() if requests[rid].status.finished)
        return dict(step=self.step_count, tokens=dict(scheduled),
                    # Prompt (or recompute) tokens, rather than one decode (a decode may carry drafts too).
                    prefill=tuple(rid for rid in scheduled
                                  if not (requests[rid].output_token_ids and requests[rid].num_tokens_to_compute == 1)),
                    preempted=tuple(scheduler_output.preempted_req_ids),
                    batched_tokens=scheduler_output.total_num_scheduled_tokens)

    def _end_record(self, record: dict) -> None:
        self.history.append(StepRecord(
            status={rid: r.status.value for rid, r in self.scheduler.requests.items()},
            used_blocks=self.kv_cache_manager.num_used_blocks, num_blocks=self.num_blocks, **record))

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics now, under vLLM's names (kvlab.engine.metrics)."""
        return engine_metrics(self)

    def stats(self) -> EngineStats:
        """The run's counters so far, under the names static batching reports too."""
        return EngineStats(
            num_steps=self.step_count,
            num_forward_passes=self.model_runner.num_forward_passes,
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
            table = tables.get(rid, [])
            extra = {}
            if isinstance(table, tuple):  # a hybrid model: one table per KV-cache group, 0 where a window gave back
                extra["group_tables"] = [list(t) for t in table]
                table = list(table[0])
            sequences.append({
                **extra, "id": rid, "status": req.status.value, "block_table": table,
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
