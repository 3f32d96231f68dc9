"""Greedy decoding of a hybrid model (sliding-window and full-attention layers) on one shared block pool.

The loop of Chapters 3-6 (chunked prefill under a token budget, prefix caching, preemption by recompute) over a
HybridKVCacheCoordinator: each request has one block table per KV-cache group, a sliding-window group gives its
blocks back as they leave the window, and each layer of the model reads through its own group's table
(HybridPagedCache). The model's layer pattern and window are read from its config as transformers reads them
(kvlab.analysis.hybrid.layer_pattern):

    gen = HybridGenerator(model, num_blocks=64, block_size=16, max_num_batched_tokens=64)
    outputs = gen.generate([prompt_ids, ...], max_new_tokens=32)      # one list of new token ids per prompt
    gen.peak_blocks                                                    # the most blocks the pool ever lent out
    gen.peak_blocks * gen.bytes_per_block                              # ... in bytes, as vLLM lays the pool out

disable_hybrid_kv_cache_manager=True (vLLM's flag) keeps every layer's blocks, as if all were full attention:
the same outputs, and the memory a hybrid pool saves is the difference.
"""

from collections import deque
from dataclasses import dataclass, field

import torch

from kvlab.cache.hybrid_cache import HybridPagedCache, hybrid_groups
from kvlab.cache.ragged_batch import SequenceChunk, build_batch
from kvlab.core.kv_cache_coordinator import HybridKVCacheCoordinator
from kvlab.model.attention_hook import forward
from kvlab.model.config import check_fits_context
from kvlab.validation import check_positive_int


@dataclass(slots=True)
class _Request:
    rid: str
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    preempted: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class HybridGenerator:
    """Runs a real hybrid model greedily over many requests whose K/V live in one pool of per-group block tables."""

    def __init__(self, model, num_blocks: int, block_size: int = 16, max_num_batched_tokens: int = 64,
                 enable_prefix_caching: bool = True, attention_backend: str = "reference",
                 disable_hybrid_kv_cache_manager: bool = False):
        self.model = model
        self.block_size = check_positive_int("block_size", block_size)
        self.budget = check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        self.groups = hybrid_groups(model, block_size, disable_hybrid_kv_cache_manager)
        self.coordinator = HybridKVCacheCoordinator(self.groups, num_blocks, enable_prefix_caching)
        self.cache = HybridPagedCache.for_model(model, self.groups, num_blocks, attention_backend=attention_backend)
        # As vLLM lays the pool out, a block id spans one layer of each group's position: group_size layers' pages.
        self.bytes_per_block = max(len(g.layer_ids) for g in self.groups) * self.groups[0].kv_cache_spec.page_size_bytes
        self.num_preemptions = 0
        self.peak_blocks = 0
        self.peak_running = 0
        self.prefill_tokens_fed = 0

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations of every prompt, max_new_tokens each, all sharing the pool."""
        check_positive_int("max_new_tokens", max_new_tokens)
        requests = []
        for i, prompt in enumerate(prompts):
            prompt = [int(t) for t in prompt]
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            check_fits_context(self.model, len(prompt), max_new_tokens)
            requests.append(_Request(str(i), prompt, max_new_tokens))
        waiting, running = deque(requests), []
        while waiting or running:
            self._step(waiting, running)
        return [r.output for r in requests]

    def _step(self, waiting: deque, running: list) -> None:
        kv, budget, scheduled = self.coordinator, self.budget, []
        # Running requests first (their next chunk or one decode), preempting the newest when the pool is short.
        for request in list(running):
            if request not in running:
                continue  # preempted earlier in this step
            n = min(len(request.tokens) - request.num_computed, budget)
            if n <= 0:
                break
            while kv.num_blocks_to_allocate(request.rid, n) > kv.num_free_blocks:
                victim = running[-1]
                self._preempt(victim, running, waiting)
                if victim is request:
                    break
            if request not in running:
                continue
            start = request.num_computed
            kv.allocate_slots(request.rid, n, new_token_ids=request.tokens[start:start + n])
            scheduled.append((request, n))
            budget -= n
        # Then waiting requests, in order, while their first chunk fits.
        while waiting and budget > 0:
            request = waiting[0]
            tokens = request.tokens
            hits, num_cached = kv.get_computed_blocks(request.rid, tokens)
            n = min(len(tokens) - num_cached, budget)
            if kv.num_blocks_to_allocate(request.rid, n, hits) > kv.num_free_blocks:
                if not running and not scheduled:
                    raise MemoryError(f"request {request.rid} alone needs more blocks than the pool of "
                                      f"{kv.num_blocks} has")
                break
            waiting.popleft()
            # The whole sequence was looked up, whatever this step's chunk; a re-admission is counted apart.
            kv.allocate_slots(request.rid, n, hits, new_token_ids=tokens[num_cached:num_cached + n],
                              computed_token_ids=tokens[:num_cached], num_query_tokens=len(tokens),
                              preempted=request.preempted)
            request.num_computed = num_cached
            running.append(request)
            scheduled.append((request, n))
            budget -= n
        if not scheduled:
            return
        self.peak_blocks = max(self.peak_blocks, kv.block_pool.num_used_blocks - 1)
        self.peak_running = max(self.peak_running, len(running))
        layouts = []
        for g in range(len(self.groups)):
            chunks = [SequenceChunk(r.tokens[r.num_computed:r.num_computed + n], r.num_computed,
                                    kv.get_block_ids(r.rid)[g]) for r, n in scheduled]
            batch = build_batch(chunks, self.block_size)
            layouts.append(batch.layout)
        self.cache.set_batch(layouts)
        last_rows = torch.tensor([n for _, n in scheduled]).cumsum(0) - 1
        logits = forward(self.model, batch.input_ids, batch.positions, self.cache, last_rows)
        self.cache.finish_pass()
        for (request, n), row in zip(scheduled, logits):
            if request.num_computed < len(request.prompt):
                self.prefill_tokens_fed += min(n, len(request.prompt) - request.num_computed)
            request.num_computed += n
            if request.num_computed == len(request.tokens):  # the chunk reached the end: its last row samples
                request.output.append(int(row.argmax()))
            kv.remove_skipped_blocks(request.rid, request.num_computed)
            if request.done:
                kv.free(request.rid)
                running.remove(request)

    def _preempt(self, request: _Request, running: list, waiting: deque) -> None:
        """Recompute later: free every group's blocks, keep the tokens, rejoin the queue's front."""
        self.coordinator.free(request.rid)
        request.num_computed = 0
        running.remove(request)
        waiting.appendleft(request)
        request.preempted = True
        self.num_preemptions += 1
