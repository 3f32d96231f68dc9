"""Chapter 10's measurements of 8-bit KV caches: how many tokens a byte budget holds, and what rounding costs.

    compare_capacity(config, 1 << 30, "int8", "float16")     # tokens in 1 GiB: ~2x in int8 against fp16
    logit_and_perplexity_change(model, tokenizer, text, "int8")

The format itself (a float32 scale per block and KV head, requantisation as a block fills, static
scales) is kvlab.cache.kv_storage; any PagedKVCache stores it with kv_cache_dtype="int8" or "fp8". Here
it is only measured: capacity from the one block_bytes formula, and the model's logits and perplexity
teacher-forced through an unquantised and a quantised paged cache on the same text.
"""

import math
from dataclasses import dataclass

import torch

from kvlab.cache.kv_storage import block_bytes
from kvlab.cache.paged_cache import PagedKVCache
from kvlab.cache.ragged_batch import SequenceChunk, forward_batch
from kvlab.core.paging import num_blocks_needed
from kvlab.model.config import context_length
from kvlab.quantization import storage_format
from kvlab.validation import check_positive_int

__all__ = ["CapacityComparison", "QuantizationEffect", "compare_capacity", "logit_and_perplexity_change",
           "tokens_that_fit"]

# ---------------------------------------------------------------------------------------------
# Capacity: how many tokens a byte budget holds, unquantised or quantised (block_bytes: kvlab.cache.kv_storage).

def tokens_that_fit(config, memory_bytes: int, kv_cache_dtype: str, block_size: int = 16) -> int:
    """Tokens a pool of whole blocks holds in memory_bytes."""
    if memory_bytes < 0:
        raise ValueError(f"memory_bytes must not be negative, got {memory_bytes}")
    return int(memory_bytes // block_bytes(config, kv_cache_dtype, block_size)) * block_size


@dataclass(slots=True)
class CapacityComparison:
    """Tokens that fit in one byte budget, unquantised vs quantised."""

    memory_bytes: int
    baseline_dtype: str      # e.g. "float16"
    quantized_dtype: str     # e.g. "int8"
    baseline_tokens: int
    quantized_tokens: int
    ratio: float             # quantized_tokens / baseline_tokens


def compare_capacity(config, memory_bytes: int, kv_cache_dtype: str = "int8", baseline: str = "float16",
                     block_size: int = 16) -> CapacityComparison:
    """How many more tokens an 8-bit pool holds than a `baseline` one in the same bytes (~2x vs fp16, ~4x vs fp32)."""
    base = tokens_that_fit(config, memory_bytes, baseline, block_size)
    quant = tokens_that_fit(config, memory_bytes, kv_cache_dtype, block_size)
    return CapacityComparison(memory_bytes, baseline, kv_cache_dtype, base, quant, quant / base if base else math.inf)


# ---------------------------------------------------------------------------------------------
# What quantisation costs the model: logits and perplexity, teacher-forced through the cache.

@dataclass(slots=True)
class QuantizationEffect:
    """Quantised vs unquantised paged cache on the same text, teacher-forced."""

    kv_cache_dtype: str
    num_tokens: int               # tokens fed through the model
    max_abs_logit_diff: float     # over every position and vocabulary entry
    mean_abs_logit_diff: float
    perplexity_reference: float   # unquantised paged cache (the model's dtype)
    perplexity_quantized: float
    relative_perplexity_change: float  # (quantized - reference) / reference
    top1_agreement: float         # share of positions whose argmax agrees


def _teacher_forced_logits(model, token_ids: list[int], cache, chunk_size: int, block_table: list[int]) -> torch.Tensor:
    """Logits [n, vocab] of one sequence fed chunk by chunk, so later chunks read earlier chunks' K/V from the cache."""
    outs = []
    for start in range(0, len(token_ids), chunk_size):
        chunk = SequenceChunk(token_ids[start:start + chunk_size], start, block_table)
        logits, _ = forward_batch(model, cache, [chunk])  # every row: teacher forcing scores each position
        outs.append(logits.float().cpu())
    return torch.cat(outs)


def logit_and_perplexity_change(model, tokenizer, text: str, kv_cache_dtype: str = "int8", chunk_size: int = 8,
                                block_size: int = 16, seed: int = 0) -> QuantizationEffect:
    """Run `text` through the model on an unquantised and a quantised paged cache and compare logits and perplexity.

    The text is cut into windows of the model's context; each window is one sequence fed in chunks
    of chunk_size tokens, its blocks placed at random in the pool (seeded).
    """
    storage_format(kv_cache_dtype)  # reject a bad dtype before any work
    check_positive_int("chunk_size", chunk_size)
    # verbose=False: the text may be longer than the model's context; it is cut into windows below.
    ids = [int(t) for t in tokenizer(text, verbose=False)["input_ids"]]
    if len(ids) < 2:
        raise ValueError("the text must have at least 2 tokens to measure perplexity")
    window = context_length(model)
    num_blocks = num_blocks_needed(min(window, len(ids)), block_size)
    generator = torch.Generator().manual_seed(seed)
    ref_logits, quant_logits, targets = [], [], []
    for start in range(0, len(ids), window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        table = torch.randperm(num_blocks, generator=generator).tolist()
        reference = PagedKVCache.for_model(model, num_blocks, block_size)
        quantized = PagedKVCache.for_model(model, num_blocks, block_size, kv_cache_dtype=kv_cache_dtype)
        ref_logits.append(_teacher_forced_logits(model, chunk, reference, chunk_size, table)[:-1])
        quant_logits.append(_teacher_forced_logits(model, chunk, quantized, chunk_size, table)[:-1])
        targets.append(torch.tensor(chunk[1:]))
    ref, quant, target = torch.cat(ref_logits), torch.cat(quant_logits), torch.cat(targets)
    diff = (quant - ref).abs()
    ppl_ref = math.exp(float(torch.nn.functional.cross_entropy(ref, target)))
    ppl_quant = math.exp(float(torch.nn.functional.cross_entropy(quant, target)))
    return QuantizationEffect(
        kv_cache_dtype=kv_cache_dtype, num_tokens=len(ids),
        max_abs_logit_diff=float(diff.max()), mean_abs_logit_diff=float(diff.mean()),
        perplexity_reference=ppl_ref, perplexity_quantized=ppl_quant,
        relative_perplexity_change=(ppl_quant - ppl_ref) / ppl_ref,
        top1_agreement=float((quant.argmax(-1) == ref.argmax(-1)).float().mean()),
    )
