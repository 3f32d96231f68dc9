"""Chapter 6's baseline: static batching, where a batch is admitted together and leaves together.

Requests are taken in order, batch_size at a time. Each member reserves blocks for the batch's
longest possible sequence up front (what a padded [batch, max_len] cache holds), the batch prefills
in one pass and then decodes every member at every step until its longest member is done: a member
that finished early keeps computing (its tokens are thrown away, as padded batches do) and no new
request can take its place. The passes are the same ragged ones, on the same cache (decodes attended
in one batch), that the continuous engine runs, so the comparison measures scheduling alone.
"""

import torch

from kvlab.cache.paged_cache import PagedKVCache
from kvlab.cache.ragged_batch import SequenceChunk, forward_batch, last_token_logits
from kvlab.core.paging import num_blocks_needed
from kvlab.engine.input_processor import InputProcessor
from kvlab.engine.output_processor import OutputProcessor
from kvlab.engine.outputs import EngineCoreOutput
from kvlab.engine.request import Request, RequestOutput
from kvlab.engine.sampler import apply_min_tokens, sample
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.stats import EngineStats
from kvlab.model.config import context_length, eos_token_ids
from kvlab.validation import check_positive_int


class StaticBatchingEngine:
    """Fixed-size batches that wait for their longest member; `generate` has LLM.generate's shape."""

    def __init__(self, model, tokenizer=None, batch_size: int = 8, block_size: int = 16, seed: int = 0):
        check_positive_int("batch_size", batch_size)
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.block_size = batch_size, block_size
        self.max_model_len = context_length(model)
        # The engine's own input and output processing; each batch then reserves its own padded cache.
        self.input_processor = InputProcessor(tokenizer, model.config.vocab_size, self.max_model_len, block_size,
                                              num_blocks=num_blocks_needed(self.max_model_len, block_size))
        self.eos_token_ids = frozenset(eos_token_ids(model))
        self.generator = torch.Generator().manual_seed(seed)
        self.num_tokens_computed = 0  # token positions run through the model, wasted ones included
        self.num_tokens_wasted = 0    # decode positions of members that had already finished
        self.peak_used_blocks = 0     # the padded reservation of the largest batch
        self.num_forward_passes = 0

    def generate(self, prompts, sampling_params=None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order."""
        prompts = list(prompts)
        params = sampling_params if isinstance(sampling_params, list) \
            else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if any(p.n != 1 for p in params):
            raise ValueError("the static-batching baseline serves n = 1 only")
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            text, ids = self.input_processor.tokenize(prompt)
            if not ids:
                raise ValueError(f"prompt {i} is empty: give at least one token")
            self.input_processor.check_context(len(ids), p.max_tokens)
            requests.append(Request(str(i), ids, p, i, self.eos_token_ids, text, self.max_model_len))
        generators = {r.request_id: None if r.params.seed is None else torch.Generator().manual_seed(r.params.seed)
                      for r in requests}
        for start in range(0, len(requests), self.batch_size):
            self._run_batch(requests[start:start + self.batch_size], generators)
        outputs = OutputProcessor(self.tokenizer)
        for r in requests:
            outputs.add_request(r.request_id, r.prompt, r.prompt_token_ids, r.params, [r.request_id])
        outputs.process_outputs([EngineCoreOutput(r.request_id, r.output_token_ids, r.status) for r in requests])
        return [outputs.output(r.request_id) for r in requests]

    def stats(self) -> EngineStats:
        """The run's counters so far, under the continuous engine's names (it never preempts: a batch holds its
        blocks)."""
        return EngineStats(num_steps=self.num_forward_passes, num_forward_passes=self.num_forward_passes,
                           num_tokens_computed=self.num_tokens_computed, num_tokens_wasted=self.num_tokens_wasted,
                           num_preemptions=0, peak_used_blocks=self.peak_used_blocks)

    def _run_batch(self, batch: list[Request], generators: dict) -> None:
        size = self.block_size
        # The padded cache of a batch: every member gets room for the longest prompt plus the most new tokens.
        reserved = max(len(r.prompt_token_ids) for r in batch) + max(r.params.max_tokens for r in batch)
        limit = min(reserved, self.max_model_len)
        per_member = num_blocks_needed(reserved, size)
        cache = PagedKVCache.for_model(self.model, per_member * len(batch), size, attention_backend="auto")
        self.peak_used_blocks = max(self.peak_used_blocks, per_member * len(batch))
        tables = [list(range(i * per_member, (i + 1) * per_member)) for i in range(len(batch))]
        members = list(range(len(batch)))           # who computes in the next pass
        feed = [list(r.prompt_token_ids) for r in batch]  # the tokens each member feeds next
        lens = [0] * len(batch)                      # tokens each member has in the cache
        while members:
            chunks = [SequenceChunk(feed[i], lens[i], tables[i]) for i in members]  # slots from the fixed tables
            logits, layout = forward_batch(self.model, cache, chunks)
            for i in members:
                lens[i] += len(feed[i])
            self.num_forward_passes += 1
            self.num_tokens_computed += sum(layout.query_lens)
            params = [batch[i].params for i in members]
            rows = apply_min_tokens(last_token_logits(logits, layout.query_lens),
                                    [len(batch[i].output_token_ids) for i in members], params, self.eos_token_ids)
            tokens = sample(rows, params, [generators[batch[i].request_id] or self.generator for i in members])
            for i, t in zip(members, tokens):
                r = batch[i]
                if r.status.finished:
                    self.num_tokens_wasted += 1
                else:
                    r.append_output(t)
                feed[i] = [t]
            if all(r.status.finished for r in batch):
                break
            # Finished members keep decoding until the longest member is done, as long as their padded row has room.
            members = [i for i in members if lens[i] < limit]
