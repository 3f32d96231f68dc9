"""Chapter 14's measurements of 8-bit KV caches: how many tokens a byte budget holds, and what rounding costs.

    compare_capacity(config, 1 << 30, "int8", "float16")     # tokens in 1 GiB: ~2x in int8 against fp16
    logit_and_perplexity_change(model, tokenizer, text, "int8")
    compare_kv_formats(model, tokenizer, ("int8", "int8_per_token_head"))   # side by side, on held-out text

The formats themselves (a float32 scale per block and KV head with requantisation as a block fills,
static scales, or vLLM's scale per token and KV head) are kvlab.cache.kv_storage; any PagedKVCache
and the engine store them with kv_cache_dtype="int8", "fp8", "int8_per_token_head" or
"fp8_per_token_head". Here they are only measured: capacity from the one block_bytes formula, the
model's logits and perplexity teacher-forced through an unquantised and a quantised paged cache, and
the engine's greedy output against the full-precision cache's, on prompts the embedded model never
trained on (the last 10 % of the shipped text, its validation split).

    python -m kvlab.benchmarks.quantization [--save]          # the README's Chapter 14 table
"""

import argparse
import json
import math
import random
from dataclasses import asdict, dataclass

import torch

from kvlab.analysis.kv_size import load_model_config
from kvlab.cache.kv_storage import block_bytes
from kvlab.cache.paged_cache import PagedKVCache
from kvlab.cache.ragged_batch import SequenceChunk, forward_batch
from kvlab.core.paging import num_blocks_needed
from kvlab.engine.llm import LLM
from kvlab.engine.sampling_params import SamplingParams
from kvlab.model.config import context_length
from kvlab.paths import ASSETS_DIR, REPO_ROOT
from kvlab.quantization import scale_granularity, storage_format
from kvlab.validation import check_positive_int

__all__ = ["CapacityComparison", "GreedyAgreement", "KVFormatComparison", "QuantizationEffect", "compare_capacity",
           "compare_kv_formats", "greedy_agreement", "held_out_prompts", "held_out_text",
           "logit_and_perplexity_change", "tokens_that_fit"]

HELD_OUT_SHARE = 0.1  # tools/train_model.py trains on the first 90 % of the text and validates on the rest

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


# ---------------------------------------------------------------------------------------------
# The engine's greedy output against the full-precision cache's, on text the model never trained on.

def held_out_text() -> str:
    """The last 10 % of the shipped Shakespeare: the embedded model's validation split, never trained on."""
    text = (ASSETS_DIR / "text" / "shakespeare.txt").read_text(encoding="utf-8")
    return text[int((1 - HELD_OUT_SHARE) * len(text)):]


def held_out_prompts(num_prompts: int, prompt_chars: int = 64, seed: int = 0) -> list[str]:
    """num_prompts stretches of prompt_chars characters at random (seeded) places of the held-out text."""
    check_positive_int("num_prompts", num_prompts)
    check_positive_int("prompt_chars", prompt_chars)
    text = held_out_text()
    starts = sorted(random.Random(seed).sample(range(len(text) - prompt_chars), num_prompts))
    return [text[s:s + prompt_chars] for s in starts]


@dataclass(slots=True)
class GreedyAgreement:
    """The engine's greedy tokens with a quantised cache against the same engine's with the model's dtype."""

    kv_cache_dtype: str
    num_tokens: int             # generated tokens over all prompts
    equal_tokens: int           # positions whose token equals the full-precision run's
    identical_requests: int     # prompts whose whole output is the same
    num_requests: int
    tokens_before_divergence: int  # summed over prompts: tokens up to each one's first difference

    @property
    def share_equal(self) -> float:
        """equal_tokens / num_tokens: the issue's "share of greedy tokens that agree"."""
        return self.equal_tokens / self.num_tokens if self.num_tokens else 1.0


def greedy_agreement(model, tokenizer, prompts: list[str], kv_cache_dtype: str, max_tokens: int = 160,
                     block_size: int = 16, reference: list[list[int]] | None = None) -> tuple[GreedyAgreement, list]:
    """Greedy output of every prompt with kv_cache_dtype against the model's dtype ('auto').

    Returns (the agreement, the reference token ids), so that several formats share one reference run.
    """
    check_positive_int("max_tokens", max_tokens)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run(dtype):
        llm = LLM(model, tokenizer, block_size=block_size, kv_cache_dtype=dtype, max_num_seqs=len(prompts),
                  num_blocks=len(prompts) * (num_blocks_needed(context_length(model), block_size) + 1))
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]

    if reference is None:
        reference = run("auto")
    quantized = run(kv_cache_dtype)
    equal = before = identical = 0
    for ref, out in zip(reference, quantized):
        same = [a == b for a, b in zip(ref, out)]
        equal += sum(same)
        before += same.index(False) if False in same else len(same)
        identical += all(same)
    total = sum(map(len, reference))
    return GreedyAgreement(kv_cache_dtype, total, equal, identical, len(prompts), before), reference


@dataclass(slots=True)
class KVFormatComparison:
    """One KV format measured every way: bytes, greedy agreement, teacher-forced perplexity and top-1 agreement."""

    kv_cache_dtype: str
    scale_granularity: str              # "block" or "token"
    bytes_per_token: float              # the model's, scales included, at block size 16
    llama3_8b_bytes_per_token: float    # the same format for Llama-3-8B's shape
    agreement: GreedyAgreement
    perplexity: QuantizationEffect


def compare_kv_formats(model, tokenizer, formats=("int8", "int8_per_token_head"), num_prompts: int = 32,
                       prompt_chars: int = 64, max_tokens: int = 160, perplexity_chars: int = 2048,
                       seed: int = 0) -> list[KVFormatComparison]:
    """Every format in `formats` measured on held-out prompts and text, against the model's own dtype."""
    prompts = held_out_prompts(num_prompts, prompt_chars, seed)
    passage = held_out_text()[:perplexity_chars]
    llama3 = load_model_config("llama-3-8b")
    rows, reference = [], None
    for name in formats:
        agreement, reference = greedy_agreement(model, tokenizer, prompts, name, max_tokens, reference=reference)
        effect = logit_and_perplexity_change(model, tokenizer, passage, name, chunk_size=64)
        rows.append(KVFormatComparison(
            name, scale_granularity(name), block_bytes(model.config, name) / 16,
            block_bytes(llama3, name) / 16, agreement, effect))
    return rows


def main(argv=None) -> None:
    """Print the formats side by side, one row per format and seed (each figure a count over all its prompts)."""
    from kvlab.model.loader import load_model

    parser = argparse.ArgumentParser(description="8-bit KV formats side by side on held-out text")
    parser.add_argument("--formats", nargs="+", default=["int8", "int8_per_token_head", "fp8_e4m3",
                                                         "fp8_per_token_head"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--save", action="store_true", help="write benchmarks/saved/kv_formats.json")
    args = parser.parse_args(argv)
    model, tokenizer = load_model()
    saved = []
    print(f"{'format':<22} {'scales':>6} {'B/token':>8} {'Llama-3-8B B/token':>18} {'seed':>4} "
          f"{'greedy tokens equal':>20} {'identical':>9} {'ppl ref -> quant':>18} {'top-1':>6}")
    for seed in args.seeds:
        for row in compare_kv_formats(model, tokenizer, args.formats, args.num_prompts, max_tokens=args.max_tokens,
                                      seed=seed):
            a, e = row.agreement, row.perplexity
            print(f"{row.kv_cache_dtype:<22} {row.scale_granularity:>6} {row.bytes_per_token:8.0f} "
                  f"{row.llama3_8b_bytes_per_token:18,.0f} {seed:>4} {a.equal_tokens:>6,}/{a.num_tokens:,} "
                  f"{a.share_equal:6.1%} {a.identical_requests:>4}/{a.num_requests} "
                  f"{e.perplexity_reference:7.4f} -> {e.perplexity_quantized:7.4f} {e.top1_agreement:6.1%}")
            saved.append({"seed": seed, **asdict(row)})
    if args.save:
        out = REPO_ROOT / "benchmarks" / "saved" / "kv_formats.json"
        out.write_text(json.dumps(saved, indent=1) + "\n")
        print("saved", out)


if __name__ == "__main__":
    main()
