"""Chapter 6's model runner: one ragged forward pass for a whole scheduled step, then sampling, verification and
drafting (vLLM's v1/worker/gpu_model_runner.py).

    runner_output = model_runner.execute_model(scheduler_output)

The runner owns the tensors: the paged KV cache, the CPU swap space, a draft model's own pools. It keeps
its own state per request (CachedRequestState: the tokens, the block table, the sampling parameters and
seeded generator), which the scheduler's output brings up to date each step, so it never reads the
scheduler's Request objects. Each step it

  1. updates that state: forgets finished requests, adds new ones, appends (or replaces) block ids;
  2. carries out the copy orders (swap preemption's copies out to the CPU pool and back) and has a KV
     connector (kvlab.kv_transfer) load the step's external K/V;
  3. lays every scheduled request's new tokens end to end and runs the model once (no padding);
  4. samples the next token of every request whose new tokens reach its end (a prefill chunk that does
     not finish its prompt samples nothing), or verifies its draft tokens with the rejection sampler;
  5. proposes the next drafts (n-gram lookup, or a draft model on its own pools under the same block ids).

After the pass the connector saves what the step filled (vLLM's KVConnectorModelRunnerMixin brackets the
forward pass the same way). It returns the tokens in a ModelRunnerOutput; appending them, the stop rules
and the rollback of rejected drafts are the scheduler's (Scheduler.update_from_output).
"""

from dataclasses import dataclass

import torch

from kvlab.cache.hybrid_cache import HybridPagedCache
from kvlab.cache.paged_cache import PagedKVCache
from kvlab.cache.ragged_batch import SequenceChunk, forward_batch
from kvlab.cache.swap import SwapSpace
from kvlab.engine.outputs import ModelRunnerOutput
from kvlab.engine.rejection_sampler import greedy_verify, rejection_sample
from kvlab.engine.sampler import apply_min_tokens, sample, sample_with_probs, sampling_probs
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.scheduler_output import SchedulerOutput
from kvlab.model.config import eos_token_ids
from kvlab.spec_decode.draft_model import DraftModelProposer, DraftRequest
from kvlab.spec_decode.ngram_proposer import NgramProposer


@dataclass(slots=True)
class CachedRequestState:
    """What the runner keeps of one request between steps (vLLM's CachedRequestState)."""

    req_id: str
    token_ids: list[int]            # prompt, then every token the runner sampled for it
    prompt_len: int
    sampling_params: SamplingParams
    generator: torch.Generator | None   # the request's own, when it has a seed
    block_ids: list[int] | tuple[list[int], ...]   # a hybrid model's: one table per KV-cache group
    num_computed_tokens: int
    max_len: int                    # prompt + max_tokens, within max_model_len: never draft past it

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len


def _layer_name(layer: int) -> str:
    """A layer's name for the connector's per-layer hooks (the module path of its attention in the HF models)."""
    return f"model.layers.{layer}.self_attn"


def _own_tables(block_ids):
    """The runner's own copy of a block table, or of each group's (a tuple) for a hybrid model."""
    return list(block_ids) if isinstance(block_ids, list) else tuple(list(table) for table in block_ids)


class ModelRunner:
    """Runs a transformers model on kvlab's paged cache, one scheduled step at a time."""

    def __init__(self, model, cache: PagedKVCache, max_model_len: int | None = None, seed: int = 0,
                 drafter: NgramProposer | DraftModelProposer | None = None, swap_space: SwapSpace | None = None,
                 num_speculative_tokens: int = 0, kv_connector=None):
        self.model = model
        self.cache = cache
        self.max_model_len = max_model_len if max_model_len is not None else int(model.config.max_position_embeddings)
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed of their own
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens
        self.swap_space = swap_space
        self.kv_connector = kv_connector  # its worker half, registered with this cache
        if kv_connector is not None:
            kv_connector.register_kv_caches(cache)
        self.requests: dict[str, CachedRequestState] = {}
        self._draft_probs: dict[str, torch.Tensor] = {}  # request id -> its drafts' distributions [k, V]
        self.num_forward_passes = 0
        self.eos_token_ids = tuple(eos_token_ids(model))  # masked while a request has fewer than min_tokens outputs

    @classmethod
    def from_config(cls, model, config, num_blocks: int, draft_model=None,
                    max_model_len: int | None = None, kv_cache_groups=None, kv_connector=None) -> "ModelRunner":
        """The runner an EngineConfig describes, with its pools (and a draft model's, and the swap space) allocated;
        kv_cache_groups: a hybrid model's groups (its layers then read through their group's block table);
        kv_connector: a KV connector's worker half, given the pools."""
        cache_config, spec = config.cache_config, config.speculative_config
        if kv_cache_groups is not None:
            cache = HybridPagedCache.for_model(model, kv_cache_groups, num_blocks,
                                               attention_backend=cache_config.attention_backend,
                                               kv_cache_dtype=cache_config.kv_cache_dtype)
        else:
            cache = PagedKVCache.for_model(model, num_blocks, cache_config.block_size,
                                           attention_backend=cache_config.attention_backend,
                                           kv_cache_dtype=cache_config.kv_cache_dtype)
        drafter = None
        if spec is not None and spec.method == "ngram":
            drafter = NgramProposer(spec)
        elif spec is not None:
            drafter = DraftModelProposer(draft_model, num_blocks, cache_config.block_size,
                                         spec.num_speculative_tokens, sample_with_probs,
                                         attention_backend=cache_config.attention_backend,
                                         kv_cache_dtype=cache_config.kv_cache_dtype,
                                         keep_draft_probs=spec.use_draft_probs)
        swap_space = None
        if config.scheduler_config.preemption_mode == "swap":
            extra = (drafter.cache,) if isinstance(drafter, DraftModelProposer) else ()
            swap_space = SwapSpace(cache, cache_config.cpu_blocks_for(num_blocks), extra)
        return cls(model, cache, max_model_len or config.model_config.max_model_len, config.model_config.seed, drafter,
                   swap_space,
                   spec.num_speculative_tokens if spec is not None else 0, kv_connector)

    # ----- one step -----
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the scheduled tokens through the model; the tokens each request emits, and its next drafts."""
        self._update_states(scheduler_output)
        if scheduler_output.blocks_to_swap_out:  # before the pass: the freed device blocks may be written in it
            self.swap_space.swap_out(scheduler_output.blocks_to_swap_out)
        if scheduler_output.blocks_to_swap_in:
            self.swap_space.swap_in(scheduler_output.blocks_to_swap_in)
        connector = self.kv_connector
        if connector is not None:
            connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
            connector.start_load_kv()
        if not scheduler_output.num_scheduled_tokens:
            return self._finish_connector(ModelRunnerOutput(), scheduler_output)

        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        states, chunks, logits_indices, samples = [], [], [], []
        end = 0
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            state = self.requests[rid]
            drafts = spec_tokens.get(rid, ())
            start, verified = state.num_computed_tokens, n - len(drafts)
            chunks.append(SequenceChunk(state.token_ids[start:start + verified] + list(drafts), start, state.block_ids))
            end += n
            samples.append(start + verified >= len(state.token_ids))
            if samples[-1]:  # vLLM's logits_indices: the rows whose logits are kept, 1 + drafts per sampling request
                logits_indices.extend(range(end - 1 - len(drafts), end))
            states.append(state)
        if connector is not None:
            # forward_batch runs every layer in one call, so the per-layer hooks come around it: every layer's
            # loads are in before the pass, and every layer's K/V is written when the pass returns.
            for layer in range(self.cache.num_layers):
                connector.wait_for_layer_load(_layer_name(layer))
        logits, _ = forward_batch(self.model, self.cache, chunks, logits_indices)
        self.num_forward_passes += 1
        if connector is not None:
            for layer in range(self.cache.num_layers):
                connector.save_kv_layer(_layer_name(layer), (self.cache.k_pools[layer], self.cache.v_pools[layer]),
                                        None)

        sampled = self._sample(states, samples, spec_tokens, logits)
        for state, n, tokens in zip(states, scheduler_output.num_scheduled_tokens.values(), sampled):
            if tokens:  # rejected drafts were computed but do not count: their slots are overwritten later
                state.num_computed_tokens += n - (len(spec_tokens.get(state.req_id, ())) - (len(tokens) - 1))
                state.token_ids.extend(tokens)
            else:
                state.num_computed_tokens += n
        output = ModelRunnerOutput(req_ids=[s.req_id for s in states], sampled_token_ids=sampled,
                                   spec_token_ids=self._propose(states, sampled) if self.drafter else None,
                                   num_forward_passes=1)
        return self._finish_connector(output, scheduler_output) if connector is not None else output

    def _finish_connector(self, output: ModelRunnerOutput, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The connector's end of step: its saves done, the copies that finished reported, its metadata dropped."""
        connector = self.kv_connector
        if connector is None:
            return output
        connector.wait_for_save()
        output.finished_sending, output.finished_recving = connector.get_finished(scheduler_output.finished_req_ids)
        output.invalid_block_ids = connector.get_block_ids_with_load_errors() or None
        connector.clear_connector_metadata()
        return output

    def _update_states(self, so: SchedulerOutput) -> None:
        """Bring the per-request state up to date with what the scheduler did since the last step."""
        draft_model = self.drafter if isinstance(self.drafter, DraftModelProposer) else None
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self._draft_probs.pop(rid, None)
            if draft_model is not None:
                draft_model.free(rid)
        for rid in so.preempted_req_ids:
            self._draft_probs.pop(rid, None)
            if draft_model is not None:
                if rid in so.swapped_out:  # the swap kept the K/V of the computed tokens, the draft's too
                    draft_model.keep(rid, self.requests[rid].num_computed_tokens)
                else:
                    draft_model.free(rid)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.prompt_token_ids) + list(new.output_token_ids), len(new.prompt_token_ids),
                params, None if params.seed is None else torch.Generator().manual_seed(params.seed),
                _own_tables(new.block_ids), new.num_computed_tokens,
                min(len(new.prompt_token_ids) + params.max_tokens, self.max_model_len))
            if draft_model is not None:
                draft_model.admit(new.req_id, new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for rid, resumed, new_ids, dropped, computed in zip(cached.req_ids, cached.resumed_from_preemption,
                                                            cached.new_block_ids, cached.num_dropped_blocks,
                                                            cached.num_computed_tokens):
            state = self.requests[rid]
            if resumed:
                state.block_ids = _own_tables(new_ids)
                if draft_model is not None and rid not in so.swapped_in:
                    draft_model.admit(rid, computed)
            elif isinstance(state.block_ids, tuple):  # per group, only appended to
                for table, ids in zip(state.block_ids, new_ids):
                    table.extend(ids)
            else:
                if dropped:
                    del state.block_ids[len(state.block_ids) - dropped:]
                state.block_ids.extend(new_ids)
            state.num_computed_tokens = computed

    def _sample(self, states, samples, spec_tokens, logits) -> list[list[int]]:
        """Per request: the tokens it emits (none for a chunk that does not finish its prompt)."""
        sampled: list[list[int]] = [[] for _ in states]
        plain, row = [], 0  # requests without drafts that sample: one batched draw
        verify = []
        for i, (state, sampling) in enumerate(zip(states, samples)):
            if not sampling:
                continue
            drafts = spec_tokens.get(state.req_id, ())
            if drafts:
                verify.append((i, row, drafts))
            else:
                plain.append((i, row))
            row += 1 + len(drafts)
        if plain:
            params = [states[i].sampling_params for i, _ in plain]
            rows = apply_min_tokens(logits[[r for _, r in plain]], [states[i].num_output_tokens for i, _ in plain],
                                    params, self.eos_token_ids)
            tokens = sample(rows, params, [states[i].generator or self.generator for i, _ in plain])
            for (i, _), token in zip(plain, tokens):
                sampled[i] = [token]
        for i, r, drafts in verify:
            sampled[i] = self._verify(states[i], list(drafts), logits[r:r + len(drafts) + 1])
        for state, tokens in zip(states, sampled):
            if tokens:
                self._draft_probs.pop(state.req_id, None)
        return sampled

    def _verify(self, state: CachedRequestState, drafts: list[int], rows: torch.Tensor) -> list[int]:
        """The tokens a speculating request emits: its accepted drafts, then one recovered or bonus token."""
        params = state.sampling_params
        # min_tokens holds at every verified position (the j-th row samples output num_output_tokens + j + 1), so
        # a draft stop token is rejected like any token the target cannot draw there.
        rows = apply_min_tokens(rows, [state.num_output_tokens + j for j in range(len(rows))], [params] * len(rows),
                                self.eos_token_ids)
        if params.greedy:
            return greedy_verify(drafts, rows)
        draft_probs = self._draft_probs.get(state.req_id)
        if draft_probs is not None:
            draft_probs = draft_probs[:len(drafts)]
        return rejection_sample(drafts, sampling_probs(rows, params), draft_probs, state.generator or self.generator)

    def _propose(self, states: list[CachedRequestState], sampled: list[list[int]]) -> list[list[int]]:
        """After verification: new drafts for every request that sampled (and the draft model's catch-up)."""
        if isinstance(self.drafter, NgramProposer):
            return [self.drafter.propose(s.token_ids, self._max_drafts(s)) if tokens else []
                    for s, tokens in zip(states, sampled)]
        work = [DraftRequest(s.req_id, s.token_ids, s.block_ids, s.num_computed_tokens,
                             min(self.num_speculative_tokens, self._max_drafts(s)) if tokens else 0,
                             s.sampling_params, s.generator or self.generator)
                for s, tokens in zip(states, sampled)]
        drafts = []
        for s, (ids, probs) in zip(states, self.drafter.propose(work)):
            drafts.append(ids)
            if ids and probs is not None:
                self._draft_probs[s.req_id] = probs
        return drafts

    @staticmethod
    def _max_drafts(state: CachedRequestState) -> int:
        # d drafts give up to d + 1 tokens: never guess past the request's longest length.
        return max(0, state.max_len - len(state.token_ids) - 1)
