"""Turning what a caller sends into a request the engine can serve, or a clear refusal (vLLM's v1/engine/processor.py).

    processor = InputProcessor(tokenizer, vocab_size=..., max_model_len=256, block_size=16, num_blocks=64)
    text, ids, params = processor.process("OTHELLO.\\n", SamplingParams(max_tokens=32))

A prompt is text (tokenised here) or token ids. Everything is checked before anything is queued:
an empty prompt, a token outside the vocabulary, a prompt that leaves no room for a new token within
max_model_len, and a request whose longest length could never fit the whole pool. A refusal is a
RequestRejected (a ValueError) that names the field at fault, so a front end can answer with it as
it is: LLM raises it, the OpenAI server turns it into a 400 with `param` set.

LLM, LLMEngine, AsyncLLM, beam search, static batching and the server all take their prompts through
one InputProcessor.
"""

from collections.abc import Sequence

import torch

from kvlab.analysis.contiguous import make_arena, reservation_slots
from kvlab.core.paging import num_blocks_needed
from kvlab.engine.sampling_params import SamplingParams
from kvlab.validation import is_integer


class RequestRejected(ValueError):
    """A request the engine cannot serve: what was wrong, and which field of the request it concerns."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


def tokenize_text(tokenizer, text: str) -> list[int]:
    """A text prompt's token ids as the engine takes them (a router that must hash the same blocks calls this too)."""
    # verbose=False: a prompt beyond the model's context is refused with a message, not a warning.
    return list(tokenizer(text, verbose=False)["input_ids"])


class InputProcessor:
    """Tokenises prompts and checks requests against the engine's fixed limits (safe to call from any thread)."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, block_size: int, num_blocks: int,
                 reservation_policy: str | None = None, reservation_arena: str | None = None,
                 kv_cache_groups=None, max_num_batched_tokens: int | None = None):
        self.tokenizer = tokenizer
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.block_size, self.num_blocks = block_size, num_blocks
        self.reservation_policy = reservation_policy
        # A reservation placed in one range must fit the arena's largest range, not only the pool.
        self.reservation_arena = reservation_arena
        self.max_blocks = num_blocks if reservation_arena is None else make_arena(reservation_arena,
                                                                                 num_blocks).largest_range
        # A hybrid model's request holds blocks in every group, a windowed group only its window's; the pool lends
        # all but the null block.
        self.kv_cache_groups, self.max_num_batched_tokens = kv_cache_groups, max_num_batched_tokens
        if kv_cache_groups is not None:
            self.max_blocks = num_blocks - 1

    def blocks_needed(self, num_tokens: int) -> int:
        """The most blocks a request of num_tokens tokens holds at once."""
        if self.kv_cache_groups is None:
            return num_blocks_needed(num_tokens, self.block_size)
        return sum(g.kv_cache_spec.max_blocks_per_request(num_tokens, self.max_num_batched_tokens)
                   for g in self.kv_cache_groups)

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """(the prompt's text or None, its token ids) for a string, a list of token ids or a 1-D tensor."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("a text prompt needs a tokenizer: give LLMEngine(model, tokenizer) or token ids",
                                      "prompt")
            return prompt, tokenize_text(self.tokenizer, prompt)
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, Sequence) or any(not is_integer(t) for t in prompt):
            raise RequestRejected(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}",
                                  "prompt")
        return None, [int(t) for t in prompt]

    def check_context(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse prompt_len + max_tokens beyond max_model_len (the OpenAI server's and static batching's rule; the
        engine itself stops a request at max_model_len instead)."""
        if prompt_len + max_tokens > self.max_model_len:
            raise RequestRejected(f"this model's maximum context length is {self.max_model_len} tokens; you asked "
                                  f"for {prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to "
                                  f"generate)", "max_tokens")

    def process(self, prompt, params: SamplingParams | None = None,
                request_id: str | None = None) -> tuple[str | None, list[int], SamplingParams]:
        """(text, token ids, params) of a request the engine can serve; RequestRejected saying why otherwise."""
        who = "the request" if request_id is None else f"request {request_id!r}"
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RequestRejected(f"params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self.tokenize(prompt)
        if not ids:
            raise RequestRejected(f"{who} has an empty prompt: give at least one token", "prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRejected(f"{who} has token id {bad[0]} outside the vocabulary of {self.vocab_size}",
                                  "prompt")
        if len(ids) >= self.max_model_len:
            subject = "the prompt" if request_id is None else f"request {request_id!r}: its prompt"
            raise RequestRejected(f"{subject} of {len(ids)} tokens leaves no room for a new token within "
                                  f"max_model_len {self.max_model_len}", "prompt")
        longest = min(len(ids) + params.max_tokens, self.max_model_len)
        if self.reservation_policy is not None:  # the reservation must fit, not only the tokens
            longest = reservation_slots(self.reservation_policy, len(ids), longest - len(ids), self.max_model_len)
        needed = self.blocks_needed(longest)
        if needed > self.max_blocks:
            where = f"the pool has {self.max_blocks} blocks in all" if self.reservation_arena is None else \
                f"the {self.reservation_arena} arena's largest range is {self.max_blocks} blocks"
            groups = "" if self.kv_cache_groups is None else f" in its {len(self.kv_cache_groups)} KV-cache groups"
            raise RequestRejected(
                f"{who} can never fit: prompt and max_tokens need up to {longest} tokens = "
                f"{needed} blocks of {self.block_size}{groups}, but {where}",
                "max_tokens")
        return text, ids, params

    def reserved_len(self, prompt_len: int, max_tokens: int) -> int:
        """An Orca-style baseline's reservation at admission (0 with paging): its real length is prompt + max_tokens,
        since the baselines run each request to its max_tokens."""
        if self.reservation_policy is None:
            return 0
        return reservation_slots(self.reservation_policy, prompt_len, min(max_tokens, self.max_model_len - prompt_len),
                                 self.max_model_len)
