"""The engine's own scheduler and KV cache manager on a simulated GPU: every decision real, no model forward.

A step is the live engine's three calls (kvlab.engine.llm_engine.LLMEngine.step), with one part swapped:

    scheduler_output = scheduler.schedule()                            # kvlab.engine.scheduler, unchanged
    runner_output = runner.execute_model(scheduler_output)             # SimulatedModelRunner: runs no model
    outputs = scheduler.update_from_output(scheduler_output, runner_output)

The runner keeps its own state per request from the scheduler's output, as the live ModelRunner does, and
returns the next token of every request whose scheduled tokens reach the end of its sequence (a prefill chunk
that does not finish its prompt samples nothing). The tokens are synthetic (the trace's own output ids when it
has them); every request runs to its trace's output length (max_tokens, ignore_eos). The runner also reads the
step's composition (its prefill chunks with their computed-token offsets, its decodes with their context
lengths), and a step-time function turns it into seconds: by default GPUStepTime, the roofline of
kvlab.simulation.step_time for a model on a GPU (and tensor parallelism), plus the fixed per-step cost. Any
callable of a StepComposition may replace it; the fidelity test gives it the live engine's measured step times.

The clock is virtual and follows kvlab.benchmarks.replay.replay_arrivals exactly: before each step the requests
whose arrival the clock has reached join; a step advances the clock by its time; every request that got a token
gets the step's end time; with nothing unfinished the clock jumps to the next arrival. Each request comes out
as a kvlab.benchmarks.replay.RequestTiming, so TTFT, TPOT, ITL and end-to-end latency come from
kvlab.benchmarks.latency, the definitions of the live server and of the replay. The pool defaults to what
kv_capacity gives the deployment (vLLM's start-up arithmetic).

Static batching (FasterTransformer-like) is kvlab's baseline (kvlab.baselines.static_batching) on the same
clock, as kvlab.benchmarks.replay.replay_static replays it: a batch of up to batch_size waiting requests starts
when the engine is free, prefills in one pass, then decodes every member each pass until its longest member is
done (finished members keep computing), and all of them return when it ends.

A KV offloading tier behind the GPU prefix cache (kv_connector: the scheduler's half of the real
kvlab.kv_transfer.OffloadingConnector) makes every tier decision the live engine's; the runner plays its worker
with kvlab.simulation.offload.SimulatedKVTransfers, which reads each step's copy orders and times them: loads
over PCIe host -> GPU, asynchronous as in vLLM (the request waits in WAITING_FOR_REMOTE_KVS and is reported
finished at the end of the first step that ends after its copy) or, for a connector that loads synchronously,
delaying the step's forward pass; saves GPU -> host beside the forward pass, a step lasting max(pass, saves). A
step with nothing to compute while a load is in flight lasts until that load ends (the engine only polls), and
an idle engine jumps to the next arrival or the end of a load, whichever comes first. With a disk tier
(kv_disk_size) the connector also orders disk loads, asynchronous at the drive's read rate, and write-through disk
writes, queued on the drive from the end of their step and reported in finished_sending once done, so a lookup
finds a block on disk only after its write's virtual end; while writes are in flight the engine keeps stepping (as
the live engine does while the connector has_pending_saves), an empty step lasting until the first copy ends.

Not modelled: swap preemption's copies over PCIe (the scheduler swaps; the copies cost no time), speculative
decoding, and the CPU's scheduling time beyond the stated per-step cost.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvlab.analysis.contiguous import POLICIES, make_arena, reservation_slots
from kvlab.analysis.kv_size import config_dict, load_model_config
from kvlab.benchmarks.replay import RequestTiming
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.paging import num_blocks_needed
from kvlab.engine.outputs import ModelRunnerOutput
from kvlab.engine.request import Request
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.scheduler_output import SchedulerOutput
from kvlab.simulation.capacity import kv_capacity
from kvlab.simulation.gpus import GPU, get_gpu
from kvlab.simulation.offload import KVTransferLinks, SimulatedDiskFiles, SimulatedKVTransfers
from kvlab.simulation.step_time import DEFAULT_STEP_OVERHEAD_S, ModelSpec, Op, layer_ops, op_seconds, step_time
from kvlab.validation import check_number, check_positive_int

# ---------------------------------------------------------------------------------------------
# What a trace request is, and what a step is made of.


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One trace request: arrival (s), prompt token ids, output length; output_token_ids if the trace has them."""

    arrival: float
    prompt_token_ids: Sequence[int]
    output_len: int
    output_token_ids: Sequence[int] | None = None


@dataclass(slots=True)
class StepComposition:
    """One step as the GPU sees it: prefill chunks (num_new_tokens, num_computed_tokens), decode context lengths
    (the new token included), the rows that sample, and the scheduler output it came from."""

    prefills: list[tuple[int, int]]
    decodes: list[int]
    num_sampled: int
    scheduler_output: SchedulerOutput

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _ in self.prefills) + len(self.decodes)


StepTimeFn = Callable[[StepComposition], float]

# The token a request emits when its trace brings no output ids: any id does, since a block's hash chains its
# prefix (two requests share output blocks only if they share the whole prompt, and then greedy outputs agree).
SYNTHETIC_TOKEN_ID = 0


# ---------------------------------------------------------------------------------------------
# The step time of a composition, fast.


class GPUStepTime:
    """step_time(model, gpu, prefills, decodes, tp).total_s of a StepComposition, computed without rebuilding the
    operator list each step.

    Every operator but attention depends on the step's token count alone (and the LM head on the rows that
    sample), so those parts are cached per count; the two attention operators are linear in the chunks' and
    decodes' sums, with coefficients read once off kvlab.simulation.step_time.layer_ops. The result equals
    step_time's to rounding (tests/simulation/test_sim_engine.py checks it on random compositions).
    """

    def __init__(self, model: ModelSpec, gpu: GPU | str, tensor_parallel_size: int = 1,
                 step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S, kv_dtype_bytes: int | None = None):
        self.model, self.gpu = model, get_gpu(gpu)
        self.tp = check_positive_int("tensor_parallel_size", tensor_parallel_size)
        model.heads_per_gpu(self.tp)  # raises now if the heads do not split
        self.step_overhead_s = float(check_number("step_overhead_s", step_overhead_s, what="number of seconds"))
        self.kv_dtype_bytes = kv_dtype_bytes
        self._by_tokens: dict[int, float] = {}
        self._lm_head: dict[int, float] = {}

        def attention(prefills=(), decodes=()) -> Op:
            name = "attn_prefill" if prefills else "attn_decode"
            return next(op for op in layer_ops(model, 0, self.tp, prefills, decodes, kv_dtype_bytes) if op.name == name)

        # Decode attention: bytes = ctx * per_ctx + n * per_request, flops = ctx * flops_per_ctx.
        one, two = attention(decodes=[1]), attention(decodes=[2])
        self._dec_bytes_ctx = two.bytes - one.bytes
        self._dec_bytes_req = one.bytes - self._dec_bytes_ctx
        self._dec_flops_ctx = one.flops
        # Prefill attention: bytes = sum(q + c) * per_kv_token + sum(q) * per_query, flops = pairs * per_pair.
        p10, p11 = attention(prefills=[(1, 0)]), attention(prefills=[(1, 1)])
        self._pre_bytes_kv = p11.bytes - p10.bytes
        self._pre_bytes_q = p10.bytes - self._pre_bytes_kv
        self._pre_flops_pair = p10.flops  # (1, 0) is one causal (query, key) pair

    def _tokens_part(self, num_tokens: int) -> float:
        """Seconds of every operator that depends on the token count alone: the layers' (attention aside),
        the embedding and the final norm."""
        cached = self._by_tokens.get(num_tokens)
        if cached is None:
            st = step_time(self.model, self.gpu, prefills=[(num_tokens, 0)], tensor_parallel_size=self.tp,
                           num_sampled=0, kv_dtype_bytes=self.kv_dtype_bytes, step_overhead_s=0.0)
            cached = st.total_s - st.num_layers * st.per_layer["attn_prefill"]
            self._by_tokens[num_tokens] = cached
        return cached

    def _lm_head_part(self, rows: int) -> float:
        cached = self._lm_head.get(rows)
        if cached is None:
            st = step_time(self.model, self.gpu, decodes=[1], tensor_parallel_size=self.tp, num_sampled=rows,
                           kv_dtype_bytes=self.kv_dtype_bytes, step_overhead_s=0.0)
            cached = st.once.get("lm_head", 0.0)
            self._lm_head[rows] = cached
        return cached

    def seconds(self, prefills: Sequence[tuple[int, int]], decodes: Sequence[int], num_sampled: int) -> float:
        """The step's time: the same figure as step_time(...).total_s; the overhead alone for an empty step."""
        num_tokens = sum(q for q, _ in prefills) + len(decodes)
        if not num_tokens:
            return self.step_overhead_s
        attention = 0.0
        if prefills:
            kv = q_sum = pairs = 0
            for q, c in prefills:
                kv += q + c
                q_sum += q
                pairs += q * c + q * (q + 1) // 2  # causal (query, key) pairs of the chunk
            attention += op_seconds(Op("attn_prefill", "attention", kv * self._pre_bytes_kv + q_sum * self._pre_bytes_q,
                                       pairs * self._pre_flops_pair), self.gpu, self.tp)
        if decodes:
            ctx = sum(decodes)
            attention += op_seconds(Op("attn_decode", "attention",
                                       ctx * self._dec_bytes_ctx + len(decodes) * self._dec_bytes_req,
                                       ctx * self._dec_flops_ctx), self.gpu, self.tp)
        return (self._tokens_part(num_tokens) + self.model.num_layers * attention + self._lm_head_part(num_sampled)
                + self.step_overhead_s)

    def __call__(self, step: StepComposition) -> float:
        return self.seconds(step.prefills, step.decodes, step.num_sampled)


# ---------------------------------------------------------------------------------------------
# The runner that runs no model.


class SimulatedModelRunner:
    """The model runner's seam without a model: per request, how far it is computed and how long it is; returns the
    next token of every request that samples, and the step's composition (kvlab.engine.model_runner's shape)."""

    def __init__(self):
        # request id -> [num_computed_tokens, num_tokens, prompt_len, output ids from the trace or None]
        self.requests: dict[str, list] = {}
        self.output_token_ids: dict[str, Sequence[int]] = {}  # filled by the engine for requests that bring them
        self.last_composition: StepComposition | None = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The tokens each scheduled request emits this step; the step's composition is left in last_composition."""
        states = self.requests
        for rid in scheduler_output.finished_req_ids:
            states.pop(rid, None)
        for new in scheduler_output.scheduled_new_reqs:
            num_tokens = len(new.prompt_token_ids) + len(new.output_token_ids)
            states[new.req_id] = [new.num_computed_tokens, num_tokens, len(new.prompt_token_ids),
                                  self.output_token_ids.pop(new.req_id, None)]
        cached = scheduler_output.scheduled_cached_reqs
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens):
            states[rid][0] = computed
        prefills, decodes, req_ids, sampled = [], [], [], []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            state = states[rid]
            computed, num_tokens, prompt_len, outputs = state
            if n == 1 and num_tokens > prompt_len and computed + 1 == num_tokens:
                decodes.append(num_tokens)          # one new token after its whole context
            else:
                prefills.append((n, computed))       # a prompt chunk, or the recompute of a preempted request
            req_ids.append(rid)
            if computed + n >= num_tokens:
                k = num_tokens - prompt_len          # the index of the output it samples now
                sampled.append([outputs[k] if outputs is not None else SYNTHETIC_TOKEN_ID])
                state[0] = computed + n
                state[1] = num_tokens + 1
            else:
                sampled.append([])
                state[0] = computed + n
        self.last_composition = StepComposition(prefills, decodes, sum(1 for s in sampled if s), scheduler_output)
        if not req_ids:
            return ModelRunnerOutput()
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, num_forward_passes=1)


# ---------------------------------------------------------------------------------------------
# The engine.


@dataclass(frozen=True, slots=True)
class SimStep:
    """One simulated step, as the live engine's StepRecord has it: who computed how many tokens, in batch order,
    whom it preempted, the blocks held after it, and its span on the virtual clock."""

    step: int
    tokens: tuple[tuple[str, int], ...]
    preempted: tuple[str, ...]
    used_blocks: int
    start: float
    end: float


@dataclass
class SimulationResult:
    """A simulated run: one RequestTiming per request (in trace order) and the run's counters."""

    timings: list[RequestTiming]
    num_steps: int
    num_preemptions: int
    num_prompt_tokens: int            # prompt tokens looked up at admission (whole prompts; re-admissions not counted)
    num_cached_prompt_tokens: int     # of which the prefix cache served
    num_tokens_computed: int          # every token position run, recomputes included
    peak_used_blocks: int
    num_blocks: int
    simulated_s: float                # the virtual clock at the end
    wall_s: float                     # what the simulation took on this machine
    steps: list[SimStep] = field(default_factory=list)   # only with record_steps=True
    # With an offloading tier (all 0 without one):
    num_tier_hit_tokens: int = 0      # prompt tokens loaded from the tier at first admission (beside the GPU hits)
    num_tier_reloaded_tokens: int = 0  # tokens a request re-admitted after a preemption loaded back from the tier
    num_loaded_blocks: int = 0        # blocks copied host -> GPU
    num_saved_blocks: int = 0         # blocks copied GPU -> host
    num_disk_hit_tokens: int = 0      # of num_tier_hit_tokens, those loaded from the disk tier
    num_disk_loaded_blocks: int = 0   # blocks read from the disk tier
    num_disk_written_blocks: int = 0  # blocks written to the disk tier
    disk_load_s: float = 0.0          # drive read time of every disk load
    disk_write_s: float = 0.0         # drive write time of every disk write
    load_s: float = 0.0               # copy time of every load
    save_s: float = 0.0               # copy time of every save
    load_wait_s: float = 0.0          # time forward passes waited for synchronous loads
    save_bound_s: float = 0.0         # time steps lasted beyond their forward pass because of saves

    @property
    def tier_hit_rate(self) -> float:
        """Share of the prompts' tokens loaded from the offloading tier (CPU or disk) at first admission."""
        return self.num_tier_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def disk_hit_rate(self) -> float:
        """Share of the prompts' tokens loaded from the disk tier at first admission."""
        return self.num_disk_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Share of the prompts' tokens served by the prefix cache (vLLM's exported hit rate)."""
        return self.num_cached_prompt_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


def resolve_model(model) -> ModelSpec:
    """A ModelSpec from a ModelSpec, a shipped config's name ('opt-13b'), a config dict, or a path to a config."""
    if isinstance(model, ModelSpec):
        return model
    return ModelSpec.from_config(model_config(model))


def model_config(model) -> dict:
    """The Hugging Face config dict of a shipped config's name, a dict or a path (FileNotFoundError naming the
    shipped ones for an unknown name)."""
    if isinstance(model, str) and not Path(model).exists():
        return load_model_config(model)
    return config_dict(model)


class SimulatedEngine:
    """kvlab's Scheduler and KVCacheManager over a SimulatedModelRunner; step() returns the step's time and outputs.

    The knobs are the live engine's, under the same names (kvlab.engine.config); step_time_fn turns each step's
    StepComposition into seconds. prefix_caching_hash_algo defaults to "builtin", where the live engine keeps
    "sha256": the same cache hits, hashed about ten times faster (kvlab.core.prefix_cache). kv_connector is a KV
    connector's scheduler half (an OffloadingConnector built with role SCHEDULER), kv_transfer_links the rates
    the runner times its copies at; give both or neither. enable_kv_cache_events makes the block pool record vLLM's
    KV-cache events (kvlab.core.kv_events), taken with kv_cache_manager.take_events() after a step, as the live
    engine publishes them. hash_seed: the root of every block-hash chain (kvlab.core.prefix_cache.none_hash; None:
    kvlab's fixed root), which a router must share to name the replica's blocks.
    """

    def __init__(self, step_time_fn: StepTimeFn, num_blocks: int, max_model_len: int, block_size: int = 16,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, enable_prefix_caching: bool = True,
                 preemption_mode: str = "recompute", num_cpu_blocks: int | None = None,
                 reservation_policy: str | None = None, prefix_caching_hash_algo: str = "builtin",
                 reservation_arena: str | None = None, kv_connector=None,
                 kv_transfer_links: KVTransferLinks | None = None, enable_kv_cache_events: bool = False,
                 hash_seed: str | None = None):
        if not callable(step_time_fn):
            raise ValueError(f"step_time_fn must be a function of a StepComposition returning seconds, "
                             f"got {step_time_fn!r}")
        if reservation_policy is not None and reservation_policy not in POLICIES:
            raise ValueError(f"reservation_policy must be None (paging) or one of {', '.join(POLICIES)}, "
                             f"got {reservation_policy!r}")
        if reservation_arena is not None and reservation_policy is None:
            raise ValueError(f"reservation_arena={reservation_arena!r} places Orca's reservations: give a "
                             f"reservation_policy too (paging reserves nothing)")
        if (kv_connector is None) != (kv_transfer_links is None):
            raise ValueError("give kv_connector and kv_transfer_links together: the connector decides the copies, "
                             "the links time them")
        if kv_connector is not None:
            from kvlab.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole
            if not isinstance(kv_connector, KVConnectorBase_V1) or kv_connector.role is not KVConnectorRole.SCHEDULER:
                raise ValueError(f"kv_connector must be a KV connector built with role KVConnectorRole.SCHEDULER, "
                                 f"got {kv_connector!r}")
            if getattr(kv_connector, "block_size", block_size) != block_size:
                raise ValueError(f"kv_connector has blocks of {kv_connector.block_size} tokens but the engine "
                                 f"{block_size}: build it with block_size={block_size}")
        self.step_time_fn = step_time_fn
        self.num_blocks = check_positive_int("num_blocks", num_blocks)
        self.max_model_len = check_positive_int("max_model_len", max_model_len)
        self.block_size = check_positive_int("block_size", block_size)
        self.reservation_policy = reservation_policy
        # "builtin" hashing (kvlab.core.prefix_cache): the same hits as sha256, barring a 64-bit collision, in a
        # tenth of the time; no K/V is served from it here.
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching,
                                               prefix_caching_hash_algo=prefix_caching_hash_algo,
                                               reservation_arena=None if reservation_arena is None else
                                               make_arena(reservation_arena, num_blocks),
                                               enable_kv_cache_events=enable_kv_cache_events, hash_seed=hash_seed)
        self.scheduler = Scheduler(self.kv_cache_manager, check_positive_int("max_num_seqs", max_num_seqs),
                                   check_positive_int("max_num_batched_tokens", max_num_batched_tokens),
                                   preemption_mode,
                                   (num_blocks if num_cpu_blocks is None else num_cpu_blocks)
                                   if preemption_mode == "swap" else 0, kv_connector=kv_connector)
        self.model_runner = SimulatedModelRunner()
        # The connector's worker half, as timings: when each step's copies end on the virtual clock.
        self.kv_transfers = None
        if kv_transfer_links is not None:
            disk_files = None
            if getattr(kv_connector, "disk_manager", None) is not None:
                # The scheduler half asks its store whether a loaded block's file still exists; here the files are
                # the simulated worker's, so that store is swapped for theirs (the directory stays untouched).
                disk_files = SimulatedDiskFiles()
                kv_connector.disk_store = disk_files
            self.kv_transfers = SimulatedKVTransfers(kv_transfer_links, disk_files)
        self.now = 0.0                    # the virtual clock at the start of the next step (run() keeps it)
        self.num_tier_hit_tokens = 0
        self.num_tier_reloaded_tokens = 0
        self.num_disk_hit_tokens = 0
        self._last_finished_recving = None
        self._last_finished_sending = None
        self.step_count = 0
        self.num_tokens_computed = 0
        self.num_prompt_tokens = 0
        self._arrivals = 0

    def check_request(self, request_id: str, prompt_len: int, output_len: int) -> None:
        """ValueError saying why the engine cannot serve a request of these lengths exactly as the trace has it."""
        if prompt_len < 1:
            raise ValueError(f"request {request_id}: empty prompt; give at least one prompt token")
        check_positive_int(f"request {request_id}: output_len", output_len)
        if prompt_len + output_len > self.max_model_len:
            raise ValueError(f"request {request_id}: {prompt_len} prompt + {output_len} output tokens = "
                             f"{prompt_len + output_len} is longer than max_model_len {self.max_model_len}; clip the "
                             f"trace (kvlab.benchmarks.datasets.fit_to_context) or raise max_model_len")
        longest = prompt_len + output_len
        if self.reservation_policy is not None:
            longest = reservation_slots(self.reservation_policy, prompt_len, output_len, self.max_model_len)
        arena = self.kv_cache_manager.arena
        room = self.num_blocks if arena is None else arena.largest_range
        if num_blocks_needed(longest, self.block_size) > room:
            where = f"the pool has {self.num_blocks} blocks in all" if arena is None else \
                f"the {type(arena).__name__}'s largest range is {room} blocks"
            raise ValueError(f"request {request_id} can never fit: it needs up to {longest} tokens = "
                             f"{num_blocks_needed(longest, self.block_size)} blocks of {self.block_size}, but {where}")

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], output_len: int,
                    output_token_ids: Sequence[int] | None = None) -> None:
        """Queue a request that generates exactly output_len tokens (max_tokens, ignore_eos), as the replay does."""
        self.check_request(request_id, len(prompt_token_ids), output_len)
        if output_token_ids is not None:
            if len(output_token_ids) < output_len:
                raise ValueError(f"request {request_id}: {len(output_token_ids)} output token ids for an output "
                                 f"of {output_len} tokens")
            self.model_runner.output_token_ids[request_id] = output_token_ids
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        request = Request(request_id, prompt_token_ids, params, self._arrivals, (), None, self.max_model_len)
        if self.reservation_policy is not None:  # the live engine's reservation (InputProcessor.reserved_len)
            request.reserved_len = reservation_slots(self.reservation_policy, len(prompt_token_ids), output_len,
                                                     self.max_model_len)
        self._arrivals += 1
        self.num_prompt_tokens += len(prompt_token_ids)
        self.scheduler.add_request(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> tuple[float, SchedulerOutput, list]:
        """One step: (its seconds, the scheduler output, the EngineCoreOutputs of the requests that got tokens)."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute_model(scheduler_output)
        seconds = float(self.step_time_fn(self.model_runner.last_composition))
        if self.kv_transfers is not None:
            seconds = self._time_copies(scheduler_output, runner_output, seconds)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        requests = self.scheduler.requests
        for out in outputs:
            if out.status.finished:
                # Forget it, as vLLM's scheduler does (_free_request): a long trace would otherwise keep every prompt.
                del requests[out.request_id]
        self.step_count += 1
        self.num_tokens_computed += scheduler_output.total_num_scheduled_tokens
        return seconds, scheduler_output, outputs

    def _stalled(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether the step changed nothing and nothing can change: no tokens, nobody running, no load ordered,
        finished or in flight (a waiting request that does not fit then never will)."""
        scheduler = self.scheduler
        if scheduler_output.total_num_scheduled_tokens or scheduler.running or scheduler.waiting_for_remote_kvs:
            return False
        if self.kv_transfers is not None and self.kv_transfers.pending_writes:
            return False
        metadata = scheduler_output.kv_connector_metadata
        return not (self._last_finished_recving or self._last_finished_sending or
                    (metadata is not None and (getattr(metadata, "loads", None) or
                                               getattr(metadata, "disk_loads", None))))

    def _time_copies(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                     compute_s: float) -> float:
        """The step's seconds with its connector copies (see the module docstring); the asynchronous loads that end
        by the step's end go into runner_output.finished_recving, as the live worker's get_finished reports them."""
        transfers, now = self.kv_transfers, self.now
        metadata = scheduler_output.kv_connector_metadata
        size, requests = self.block_size, self.scheduler.requests
        disk_loads = getattr(metadata, "disk_loads", {})
        for rid in metadata.loads.keys() | disk_loads.keys():
            tokens = (len(metadata.loads.get(rid, ())) + len(disk_loads.get(rid, ()))) * size
            if requests[rid].num_preemptions:
                self.num_tier_reloaded_tokens += tokens
            else:
                self.num_tier_hit_tokens += tokens
                self.num_disk_hit_tokens += len(disk_loads.get(rid, ())) * size
        wait = transfers.start_load_kv(metadata, scheduler_output.num_scheduled_tokens, now)
        save = transfers.save_seconds(metadata)
        if scheduler_output.total_num_scheduled_tokens:
            transfers.save_bound_s += max(0.0, save - compute_s)
            end = now + wait + max(compute_s, save)
        else:  # nothing to compute: the engine polls until the first load or disk write in flight ends
            first = transfers.next_copy_end()
            end = now + compute_s if first is None else max(now + compute_s, first)
        transfers.start_disk_writes(metadata, end)
        runner_output.finished_recving = self._last_finished_recving = transfers.get_finished(end)
        runner_output.finished_sending = self._last_finished_sending = (
            transfers.get_finished_sending(end) if transfers.disk_files is not None else None)
        return end - now

    def run(self, requests: Iterable[SimRequest], record_steps: bool = False,
            max_steps: int = 10**8) -> SimulationResult:
        """Serve the requests (sorted by arrival; an iterable is read as the clock reaches each arrival) on the
        virtual clock; request i gets id str(i)."""
        started = time.perf_counter()
        source = iter(requests)
        timings: list[RequestTiming] = []
        active: dict[str, RequestTiming] = {}
        steps: list[SimStep] = []
        peak = 0
        pending = _next_request(source, None, 0)
        now, last_arrival, done = 0.0, 0.0, 0
        for _ in range(max_steps):
            while pending is not None and pending.arrival <= now:
                rid = str(len(timings))
                timing = RequestTiming(pending.arrival, len(pending.prompt_token_ids), pending.output_len)
                self.add_request(rid, pending.prompt_token_ids, pending.output_len, pending.output_token_ids)
                timings.append(timing)
                active[rid] = timing
                last_arrival = pending.arrival
                pending = _next_request(source, last_arrival, len(timings))
            writing = self.kv_transfers is not None and bool(self.kv_transfers.pending_writes)
            if not self.has_unfinished_requests() and not writing:
                if pending is None:
                    break
                now = max(now, pending.arrival)  # idle: jump to the next arrival
                continue
            if pending is not None and self.kv_transfers is not None and \
                    not self.scheduler.has_schedulable_requests():
                first = self.kv_transfers.next_copy_end()
                if first is not None and pending.arrival < first:
                    now = pending.arrival  # only loads in flight: the next arrival comes before any ends
                    continue
            self.now = now
            seconds, scheduler_output, outputs = self.step()
            if self._stalled(scheduler_output):
                raise RuntimeError(f"the scheduler is stuck at {now:.6g} s: nothing runs, no load is in flight and "
                                   f"the first of {len(self.scheduler.waiting)} waiting requests does not fit in the "
                                   f"{self.kv_cache_manager.num_free_blocks} free blocks")
            began, now = now, now + seconds
            used = self.kv_cache_manager.num_used_blocks
            peak = max(peak, used)
            if record_steps:
                steps.append(SimStep(self.step_count, tuple(scheduler_output.num_scheduled_tokens.items()),
                                     tuple(scheduler_output.preempted_req_ids), used, began, now))
            for out in outputs:
                active[out.request_id].got_tokens(now, out.status.finished)
                if out.status.finished:
                    del active[out.request_id]
                    done += 1
        else:
            raise RuntimeError(f"only {done} of {len(timings)} requests finished within {max_steps} steps")
        self.now = now
        kv = self.kv_cache_manager
        result = SimulationResult(timings, self.step_count, self.scheduler.num_preemptions, kv.queries, kv.hits,
                                  self.num_tokens_computed, peak, self.num_blocks, now,
                                  time.perf_counter() - started, steps)
        transfers = self.kv_transfers
        if transfers is not None:
            result.num_tier_hit_tokens, result.num_tier_reloaded_tokens = (self.num_tier_hit_tokens,
                                                                           self.num_tier_reloaded_tokens)
            result.num_loaded_blocks, result.num_saved_blocks = transfers.num_loaded_blocks, transfers.num_saved_blocks
            result.load_s, result.save_s = transfers.load_s, transfers.save_s
            result.load_wait_s, result.save_bound_s = transfers.load_wait_s, transfers.save_bound_s
            result.num_disk_hit_tokens = self.num_disk_hit_tokens
            result.num_disk_loaded_blocks = transfers.num_disk_loaded_blocks
            result.num_disk_written_blocks = transfers.num_disk_written_blocks
            result.disk_load_s, result.disk_write_s = transfers.disk_load_s, transfers.disk_write_s
        return result


def _next_request(source, last_arrival: float | None, index: int) -> SimRequest | None:
    """The trace's next request, checked: a number of seconds, not before the previous one."""
    request = next(source, None)
    if request is None:
        return None
    arrival = request.arrival
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival) or arrival < 0:
        raise ValueError(f"request {index}: arrival must be a finite number of seconds >= 0, got {arrival!r}")
    if last_arrival is not None and arrival < last_arrival:
        raise ValueError(f"the trace is not sorted by arrival: request {index} arrives at {arrival:g} s, before "
                         f"request {index - 1} at {last_arrival:g} s; sort it (sorted(requests, key=lambda r: "
                         f"r.arrival))")
    return request


# ---------------------------------------------------------------------------------------------
# Static batching on the same clock.


def run_static(requests: Iterable[SimRequest], step_time_fn: StepTimeFn, batch_size: int, max_model_len: int,
               block_size: int = 16) -> SimulationResult:
    """kvlab's static-batching baseline on the virtual clock (replay_static's rules): batches of up to batch_size
    waiting requests, each run to its longest member, every member returned at the batch's end."""
    started = time.perf_counter()
    check_positive_int("batch_size", batch_size)
    check_positive_int("max_model_len", max_model_len)
    source = iter(requests)
    queue: list[SimRequest] = []
    timings: list[RequestTiming] = []
    pending = _next_request(source, None, 0)
    now, num_steps, computed, peak = 0.0, 0, 0, 0
    empty = SchedulerOutput()

    def take_arrivals(until: float):
        nonlocal pending
        while pending is not None and pending.arrival <= until:
            p, n = len(pending.prompt_token_ids), pending.output_len
            if p < 1 or p + check_positive_int(f"request {len(timings)}: output_len", n) > max_model_len:
                raise ValueError(f"request {len(timings)}: {p} prompt + {n} output tokens = {p + n} is longer than "
                                 f"max_model_len {max_model_len} (or the prompt is empty)")
            queue.append(pending)
            timings.append(RequestTiming(pending.arrival, p, n))
            pending = _next_request(source, pending.arrival, len(timings))

    first = 0  # index (in timings) of the queue's first request
    while pending is not None or queue:
        if not queue:
            now = max(now, pending.arrival)
        take_arrivals(now)
        batch, queue = queue[:batch_size], queue[batch_size:]
        members = [len(r.prompt_token_ids) for r in batch]
        longest_out = max(r.output_len for r in batch)
        limit = min(max(members) + longest_out, max_model_len)  # the padded row of every member
        peak = max(peak, num_blocks_needed(max(members) + longest_out, block_size) * len(batch))
        seconds = step_time_fn(StepComposition([(p, 0) for p in members], [], len(batch), empty))
        lens = list(members)
        num_steps += 1
        computed += sum(members)
        for _ in range(longest_out - 1):  # one decode pass per further token of the longest member
            live = [n for n in lens if n < limit]
            seconds += step_time_fn(StepComposition([], [n + 1 for n in live], len(live), empty))
            lens = [n + 1 if n < limit else n for n in lens]
            num_steps += 1
            computed += len(live)
        now += seconds
        for i in range(first, first + len(batch)):
            timings[i].got_tokens(now, finished=True)
        first += len(batch)
    return SimulationResult(timings, num_steps, 0, sum(t.prompt_len for t in timings), 0, computed, peak, 0, now,
                            time.perf_counter() - started)


# ---------------------------------------------------------------------------------------------
# One call: a trace on a model on a GPU.

SYSTEMS = ("paged", "orca-oracle", "orca-pow2", "orca-max", "static")


def simulate(requests: Iterable[SimRequest], model="llama-3-8b", gpu: GPU | str = "A100-80GB",
             tensor_parallel_size: int = 1, system: str = "paged", max_model_len: int | None = None,
             num_blocks: int | None = None, block_size: int = 16, max_num_seqs: int = 256,
             max_num_batched_tokens: int = 8192, enable_prefix_caching: bool = True,
             gpu_memory_utilization: float = 0.92, step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S,
             step_time_fn: StepTimeFn | None = None, static_batch_size: int | None = None,
             record_steps: bool = False, kv_offloading_size: int = 0, eviction_policy: str = "lru",
             async_kv_loads: bool = True, host_link_bytes_per_s: float | None = None, kv_disk_size: int = 0,
             **engine_knobs) -> SimulationResult:
    """Serve a trace with one system on a simulated deployment.

    model: a shipped config's name, a config dict or path, or a ModelSpec (then give num_blocks); gpu: a name of
    kvlab.simulation.GPUS. system: paged (kvlab), orca-oracle / orca-pow2 / orca-max (the reservation baselines)
    or static (static batching; batch_size defaults to the full-length sequences the pool holds, as
    benchmarks/figure12.py sizes it). num_blocks defaults to kv_capacity(...).num_blocks; max_model_len to the
    config's max_position_embeddings.

    kv_offloading_size: bytes of host memory for a CPU tier (vLLM's --kv-offloading-size, the whole deployment's;
    0: no tier, the engine without a connector), an OffloadingConnector with eviction_policy (lru or arc) and
    asynchronous loads unless async_kv_loads=False. Copies run at host_link_bytes_per_s per GPU and direction,
    by default the GPU's host link (kvlab.simulation.offload.host_link_bytes_per_s). kv_disk_size: bytes of a
    disk tier behind the CPU tier (the connector's disk_size; 0: none, exactly the CPU tier alone), its copies at
    kvlab.simulation.offload's NVMe rates.
    """
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {', '.join(SYSTEMS)}, got {system!r}")
    config = None if isinstance(model, ModelSpec) else model_config(model)
    spec = resolve_model(model if config is None else config)
    gpu = get_gpu(gpu)
    if max_model_len is None:
        if config is None or not config.get("max_position_embeddings"):
            raise ValueError("give max_model_len: the model config has no max_position_embeddings")
        max_model_len = int(config["max_position_embeddings"])
    check_positive_int("max_model_len", max_model_len)
    if num_blocks is None:
        if config is None:
            raise ValueError("a ModelSpec has no config to size the KV pool from: give num_blocks")
        budget = kv_capacity(config, gpu, tensor_parallel_size, gpu_memory_utilization, block_size,
                             max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len)
        if budget.num_blocks < 1:
            raise ValueError(f"{spec.name} leaves no memory for KV blocks on {tensor_parallel_size} x {gpu.name} "
                             f"(available {budget.available_bytes / 2**30:.1f} GiB): add GPUs (tensor_parallel_size)")
        num_blocks = budget.num_blocks
    if step_time_fn is None:
        step_time_fn = GPUStepTime(spec, gpu, tensor_parallel_size, step_overhead_s)
    if system == "static":
        if engine_knobs:
            raise ValueError(f"static batching takes no engine knobs, got {', '.join(engine_knobs)}")
        batch = static_batch_size or max(1, num_blocks * block_size // max_model_len)
        return run_static(requests, step_time_fn, batch, max_model_len, block_size)
    if isinstance(kv_offloading_size, bool) or not isinstance(kv_offloading_size, int) or kv_offloading_size < 0:
        raise ValueError(f"kv_offloading_size must be a number of bytes >= 0 (0: no CPU tier), got "
                         f"{kv_offloading_size!r}")
    if isinstance(kv_disk_size, bool) or not isinstance(kv_disk_size, int) or kv_disk_size < 0:
        raise ValueError(f"kv_disk_size must be a number of bytes >= 0 (0: no disk tier), got {kv_disk_size!r}")
    if kv_disk_size and not kv_offloading_size:
        raise ValueError(f"kv_disk_size={kv_disk_size} needs a CPU tier in front of the disk: give "
                         "kv_offloading_size too")
    if kv_offloading_size:
        engine_knobs.update(offloading_tier(spec, gpu, tensor_parallel_size, block_size, kv_offloading_size,
                                            eviction_policy, async_kv_loads, host_link_bytes_per_s, kv_disk_size))
    engine = SimulatedEngine(step_time_fn, num_blocks, max_model_len, block_size, max_num_seqs,
                             max_num_batched_tokens, enable_prefix_caching,
                             reservation_policy=None if system == "paged" else system.removeprefix("orca-"),
                             **engine_knobs)
    return engine.run(requests, record_steps=record_steps)



def offloading_tier(model: ModelSpec, gpu: GPU | str, tensor_parallel_size: int, block_size: int,
                    kv_offloading_size: int, eviction_policy: str = "lru", async_kv_loads: bool = True,
                    host_link_bytes_per_s: float | None = None, kv_disk_size: int = 0) -> dict:
    """SimulatedEngine's kv_connector (the real OffloadingConnector's scheduler half, sized by kv_offloading_size
    bytes over the model's whole blocks, with a disk tier of kv_disk_size bytes unless 0) and kv_transfer_links
    (each GPU's share of a block over its host link and its drive)."""
    from kvlab.kv_offload import kv_bytes_per_block
    from kvlab.kv_transfer import KVConnectorFactory, KVConnectorRole, KVTransferConfig

    bytes_per_block = kv_bytes_per_block(model.num_layers, block_size, model.num_kv_heads, model.head_dim,
                                         model.dtype_bytes)
    extra = {"kv_offloading_size": kv_offloading_size, "eviction_policy": eviction_policy,
             "async_loads": async_kv_loads}
    disk_path = None
    if kv_disk_size:
        # The connector's store makes its directory; the scheduler half writes nothing there and the simulated
        # worker keeps its files in memory, so the directory is removed at once (rmdir fails if anything was written).
        disk_path = tempfile.mkdtemp(prefix="kvlab-sim-disk-")
        extra.update(disk_path=disk_path, disk_size=kv_disk_size)
    config = KVTransferConfig("OffloadingConnector", "kv_both", extra)
    try:
        connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, block_size=block_size,
                                                        bytes_per_block=bytes_per_block)
    finally:
        if disk_path is not None:
            os.rmdir(disk_path)
    if host_link_bytes_per_s is None:
        links = KVTransferLinks.for_deployment(bytes_per_block, gpu, tensor_parallel_size)
    else:
        tp = check_positive_int("tensor_parallel_size", tensor_parallel_size)
        links = KVTransferLinks(-(-bytes_per_block // tp), host_link_bytes_per_s, host_link_bytes_per_s)
    return dict(kv_connector=connector, kv_transfer_links=links)
