"""Why two runs at temperature 0 can give different tokens: the same sums added in another order, and near-ties.

    split_attention_differences(torch.bfloat16)                  # one attention, two orders: how many outputs differ
    run_determinism_experiment(model_bf16, tokenizer, prompts)    # kvlab's engine: cold vs warm, batch 1 vs 64
    python -m kvlab.benchmarks.determinism [--save]              # the README's table, float32 / bf16 / fp16

Floating-point addition is not associative: a sum of the same numbers in another order can round
to a different last bit, and in bfloat16 (8 significant bits) the last bit is large. Greedy decoding
takes an argmax, so where the two best logits are closer than that rounding the token flips, and
every later token follows the flipped one. What changes the order between two runs of the same
prompt is the kernel's choice of how to split its work, and that choice depends on the batch: a
GEMM library picks its tiling and split-K by the number of rows, and an attention backend splits a
decode's keys into segments when the batch is too small to fill the GPU (vLLM's Triton backend:
decode-only batches of at most 128 // num_kv_heads sequences, 16 segments merged by a second kernel,
`vllm/v1/attention/backends/triton_attn.py`). A warm prefix cache changes the pass too: the prompt's
cached blocks are read, not recomputed, so the rest of the prompt runs as a shorter chunk.

torch's CPU kernels compute each row the same way whatever the batch (measured here, every
dtype), so on a CPU kvlab's engine is batch-invariant by accident. `SplitRuleBackend` gives the
engine a GPU backend's rule (split the decode's keys when the batch is small), and the experiment
counts the tokens that then differ; with `batch_invariant=True` it keeps one order for every batch,
which is what vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1,
`vllm/model_executor/layers/batch_invariant.py`) does for every reduction: matmuls without
batch-dependent split-K, softmax, log-softmax, mean and RMSNorm in fixed-order kernels, and fixed
NCCL settings.
"""

import argparse
import json
import math
from dataclasses import asdict, dataclass

import torch

from kvlab.cache.attention_backends import TorchBackend, batched_decode_attention
from kvlab.engine.llm import LLM
from kvlab.engine.sampling_params import SamplingParams
from kvlab.validation import check_positive_int

__all__ = ["DeterminismRow", "OrderEffect", "SplitRuleBackend", "TokenDiff", "compare_outputs",
           "run_determinism_experiment", "split_attention_differences", "split_decode_attention"]


@dataclass(slots=True)
class TokenDiff:
    """Two runs' greedy outputs for the same prompts, compared position by position."""

    num_tokens: int                      # tokens of the first run
    differing_tokens: int                # positions whose tokens differ
    differing_requests: int              # requests with at least one differing token
    first_divergence: list[int | None]   # per request: the first differing position, None if identical

    @property
    def earliest_divergence(self) -> int | None:
        """The first differing position over all requests, None if every output is identical."""
        return min((d for d in self.first_divergence if d is not None), default=None)


def compare_outputs(reference: list[list[int]], other: list[list[int]]) -> TokenDiff:
    """Compare two runs' token ids [requests][tokens]; both runs must have the same requests and lengths."""
    if len(reference) != len(other):
        raise ValueError(f"the runs have {len(reference)} and {len(other)} requests; compare the same prompts")
    differing, first = 0, []
    for i, (a, b) in enumerate(zip(reference, other)):
        if len(a) != len(b):
            raise ValueError(f"request {i} has {len(a)} tokens in one run and {len(b)} in the other; "
                             "use ignore_eos=True and the same max_tokens")
        positions = [j for j, (x, y) in enumerate(zip(a, b)) if x != y]
        differing += len(positions)
        first.append(positions[0] if positions else None)
    return TokenDiff(sum(map(len, reference)), differing, sum(f is not None for f in first), first)


@dataclass(slots=True)
class OrderEffect:
    """One attention computed in one piece and in segments, in one dtype: how many outputs differ, and by how much."""

    dtype: str
    share_differing: float     # output elements whose two results differ
    max_abs_diff: float


def split_attention_differences(dtype: torch.dtype = torch.bfloat16, seq_len: int = 256, num_segments: int = 16,
                                batch: int = 64, seed: int = 0) -> OrderEffect:
    """Decode attention over random q, K, V in dtype, once in one piece and once split into num_segments and merged.

    The mathematics is the same; only the order of the additions differs, as between a GPU backend's
    one-piece kernel and its split-KV kernel.
    """
    check_positive_int("seq_len", seq_len)
    check_positive_int("num_segments", num_segments)
    check_positive_int("batch", batch)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 4, 64, generator=g).to(dtype)
    k, v = (torch.randn(batch, seq_len, 2, 64, generator=g).to(dtype) for _ in range(2))
    mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    whole = batched_decode_attention(q, k, v, mask, 0.125).float()
    split = split_decode_attention(q, k, v, mask, 0.125, num_segments).float()
    return OrderEffect(str(dtype).removeprefix("torch."), float((whole != split).float().mean()),
                       float((whole - split).abs().max()))


class SplitRuleBackend(TorchBackend):
    """Chapter 6's batched torch decode with a GPU backend's rule for its reduction order.

    A decode-only pass of at most max_split_seqs sequences splits each sequence's keys into num_segments
    segments: each segment's softmax partials (max, sum, weighted values) in float32, merged by a reduce,
    then rounded to the model's dtype; a larger or mixed pass attends in one piece. batch_invariant=True
    never splits, so a sequence's reduction order is the same whatever the batch.
    """

    name = "torch-split-rule"

    def __init__(self, max_split_seqs: int, num_segments: int = 16, batch_invariant: bool = False):
        check_positive_int("max_split_seqs", max_split_seqs)
        check_positive_int("num_segments", num_segments)
        self.max_split_seqs, self.num_segments, self.batch_invariant = max_split_seqs, num_segments, batch_invariant
        self.split_passes = 0    # layer calls that took the split path, to show the rule fired

    def forward(self, storage, layer_idx, query, metadata, scaling, sliding_window=None) -> torch.Tensor:
        self._decode_only = len(metadata.decode_seqs) == len(metadata.query_lens)
        return super().forward(storage, layer_idx, query, metadata, scaling, sliding_window)

    def decode(self, storage, layer_idx, q, metadata, scaling, sliding_window=None) -> torch.Tensor:
        """q [B, H, D] of the decodes -> [B, H, D], split or not by the rule."""
        if self.batch_invariant or not self._decode_only or q.shape[0] > self.max_split_seqs:
            return super().decode(storage, layer_idx, q, metadata, scaling, sliding_window)
        self.split_passes += 1
        index, mask = self.decode_inputs(metadata, sliding_window)
        k, v = storage.gather_slots(layer_idx, index.reshape(-1), q.dtype)
        shape = (*index.shape, *k.shape[1:])
        return split_decode_attention(q, k.view(shape), v.view(shape), mask, scaling, self.num_segments)


def split_decode_attention(q, k, v, mask, scaling, num_segments: int) -> torch.Tensor:
    """Decode attention with the keys in num_segments segments merged afterwards: q [B, H, D], k, v [B, L, Hkv, D],
    mask [B, L] (True at padding) -> [B, H, D] in q's dtype; the same result as batched_decode_attention up to rounding.
    """
    batch, num_heads, _ = q.shape
    length, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    seg = math.ceil(length / num_segments)
    qf = q.float().view(batch, num_kv_heads, group, -1)                         # [B, Hkv, g, D]
    maxes, sums, outs = [], [], []
    for start in range(0, length, seg):
        ks, vs = k[:, start:start + seg].float(), v[:, start:start + seg].float()  # [B, s, Hkv, D]
        scores = torch.einsum("bhgd,bshd->bhgs", qf, ks) * scaling
        scores = scores.masked_fill(mask[:, None, None, start:start + seg], float("-inf"))
        m = scores.amax(dim=-1, keepdim=True)                                      # [B, Hkv, g, 1]
        p = torch.exp(scores - torch.where(torch.isinf(m), torch.zeros_like(m), m))
        maxes.append(m)
        sums.append(p.sum(dim=-1, keepdim=True))
        outs.append(torch.einsum("bhgs,bshd->bhgd", p, vs))
    m_all = torch.stack(maxes).amax(dim=0)                                          # the reduce kernel's merge
    weights = [torch.exp(torch.where(torch.isinf(m), torch.full_like(m, -math.inf), m - m_all)) for m in maxes]
    total = sum(w * s for w, s in zip(weights, sums))
    out = sum(w * o for w, o in zip(weights, outs)) / total
    return out.reshape(batch, num_heads, -1).to(q.dtype)


@dataclass(slots=True)
class DeterminismRow:
    """One comparison of the experiment: two runs of the same prompts, greedy, and how their tokens differ."""

    comparison: str          # e.g. "batch 1 vs batch 64"
    rule: str                # "one order (CPU kernels)", "split when small", "batch-invariant"
    diff: TokenDiff


def _outputs(llm, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def run_determinism_experiment(model, tokenizer, prompts: list[str], max_tokens: int = 32, block_size: int = 16,
                               rules: tuple[str, ...] = ("cpu", "split", "invariant")) -> list[DeterminismRow]:
    """The same greedy prompts run cold and warm (prefix cache) and at batch 1 and batch len(prompts).

    rules: which attention the engine decodes with: "cpu" (torch's, one order whatever the batch),
    "split" (SplitRuleBackend with vLLM's threshold 128 // num_kv_heads, capped below the full batch),
    "invariant" (the same rule in batch-invariant mode).
    """
    if len(prompts) < 2:
        raise ValueError("give at least 2 prompts: the experiment compares batch 1 with a batch of all of them")
    unknown = set(rules) - {"cpu", "split", "invariant"}
    if unknown:
        raise ValueError(f"unknown rules {sorted(unknown)}; choose from 'cpu', 'split', 'invariant'")
    check_positive_int("max_tokens", max_tokens)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    num_kv_heads = model.config.num_key_value_heads
    # vLLM's threshold, kept below the batch so that the full batch takes the other path.
    threshold = max(1, min(128 // num_kv_heads, len(prompts) - 1))
    rows = []
    for rule in rules:
        def engine(max_num_seqs, caching, rule=rule):
            llm = LLM(model, tokenizer, block_size=block_size, num_blocks=len(prompts) * (
                (max_tokens + 256) // block_size + 1), max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max(2048, max_num_seqs * 64), enable_prefix_caching=caching,
                attention_backend="torch")
            if rule != "cpu":
                llm.llm_engine.model_runner.cache.attn_backend = SplitRuleBackend(
                    threshold, batch_invariant=rule == "invariant")
            return llm
        label = {"cpu": "one order (torch on CPU)", "split": f"split when <= {threshold} decodes",
                 "invariant": "batch-invariant"}[rule]
        big = engine(len(prompts), True)
        cold = _outputs(big, prompts, params)
        warm = _outputs(big, prompts, params)  # the same engine: every prompt's full blocks now hit the cache
        single = _outputs(engine(1, False), prompts, params)
        rows.append(DeterminismRow(f"cold vs warm prefix cache (batch {len(prompts)})", label,
                                   compare_outputs(cold, warm)))
        rows.append(DeterminismRow(f"batch 1 vs batch {len(prompts)}", label, compare_outputs(single, cold)))
    return rows


def main(argv=None) -> None:
    """The experiment on 64 held-out prompts in float32, bfloat16 and float16, printed (and saved)."""
    from kvlab.benchmarks.quantization import held_out_prompts
    from kvlab.model.loader import load_model
    from kvlab.paths import REPO_ROOT

    parser = argparse.ArgumentParser(description="two greedy runs of the same prompts: where their tokens differ")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    parser.add_argument("--save", action="store_true", help="write benchmarks/saved/determinism.json")
    args = parser.parse_args(argv)
    prompts = held_out_prompts(args.num_prompts, prompt_chars=48)
    saved = {"num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "prompt_chars": 48,
             "attention_order": {}, "rows": []}
    for name in args.dtypes:
        dtype = getattr(torch, name)
        effect = split_attention_differences(dtype)
        saved["attention_order"][name] = asdict(effect)
        print(f"{name}: decode attention in one piece vs 16 segments: {effect.share_differing:.1%} of outputs "
              f"differ, by up to {effect.max_abs_diff:.2g}")
        model, tokenizer = load_model(dtype=dtype)
        for row in run_determinism_experiment(model, tokenizer, prompts, args.max_tokens):
            d = row.diff
            print(f"  {row.comparison:<40} {row.rule:<26} {d.differing_tokens:>5,} of {d.num_tokens:,} tokens differ, "
                  f"{d.differing_requests} of {len(prompts)} requests, first at token {d.earliest_divergence}")
            saved["rows"].append({"dtype": name, "comparison": row.comparison, "rule": row.rule, **asdict(d)})
    if args.save:
        out = REPO_ROOT / "benchmarks" / "saved" / "determinism.json"
        out.write_text(json.dumps(saved, indent=1) + "\n")
        print("saved", out)


if __name__ == "__main__":
    main()
