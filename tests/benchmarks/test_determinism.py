"""Chapter 14's follow-up: why two greedy runs can differ, measured on kvlab's engine (kvlab.benchmarks.determinism)."""

import pytest
import torch

from kvlab.benchmarks.determinism import (
    SplitRuleBackend,
    compare_outputs,
    run_determinism_experiment,
    split_attention_differences,
    split_decode_attention,
)
from kvlab.benchmarks.quantization import held_out_prompts
from kvlab.cache.attention_backends import batched_decode_attention


def test_compare_outputs_counts_positions_requests_and_the_first_divergence():
    diff = compare_outputs([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]], [[1, 2, 0, 0], [5, 6, 7, 8], [0, 9]])
    assert (diff.num_tokens, diff.differing_tokens, diff.differing_requests) == (10, 3, 2)
    assert diff.first_divergence == [2, None, 0] and diff.earliest_divergence == 0
    same = compare_outputs([[1, 2]], [[1, 2]])
    assert same.differing_tokens == 0 and same.earliest_divergence is None


@pytest.mark.parametrize("a, b, message", [
    ([[1]], [[1], [2]], "1 and 2 requests"),
    ([[1, 2]], [[1]], "ignore_eos=True"),
])
def test_compare_outputs_refuses_runs_that_are_not_comparable(a, b, message):
    with pytest.raises(ValueError, match=message):
        compare_outputs(a, b)


@pytest.mark.parametrize("num_heads, num_kv_heads, num_segments", [(4, 2, 16), (4, 4, 3), (8, 1, 1)])
def test_split_attention_is_the_same_mathematics_as_one_piece(num_heads, num_kv_heads, num_segments):
    """In float64 the split-and-merge result equals fused attention: only rounding can tell them apart.

    Ragged lengths (padding masked) and a segment count that does not divide the length.
    """
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, num_heads, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 37, num_kv_heads, 16, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.arange(37)[None, :] >= torch.tensor([37, 20, 1])[:, None]
    whole = batched_decode_attention(q, k, v, mask, 0.25)
    split = split_decode_attention(q, k, v, mask, 0.25, num_segments)
    torch.testing.assert_close(split, whole.to(split.dtype), atol=1e-6, rtol=1e-6)


def test_the_order_changes_many_low_precision_outputs_by_their_last_bits():
    """Measured (seed 0): bfloat16 39 % of outputs differ by up to 0.002; float32 94 % by up to 5e-7."""
    bf16 = split_attention_differences(torch.bfloat16)
    fp32 = split_attention_differences(torch.float32)
    assert bf16.share_differing > 0.1 and 1e-4 < bf16.max_abs_diff < 0.05, bf16
    assert fp32.max_abs_diff < 1e-5 < bf16.max_abs_diff, fp32


def test_the_rule_splits_small_decode_batches_only_and_never_in_batch_invariant_mode():
    class Storage:
        def gather_slots(self, layer_idx, slots, dtype):
            kv = torch.ones(len(slots), 1, 8, dtype=dtype)
            return kv, kv

    class Meta:
        def __init__(self, batch):
            self.query_lens, self.decode_seqs = [1] * batch, list(range(batch))
            self.slot_index = torch.zeros(batch, 4, dtype=torch.long)
            self.padding_mask = torch.zeros(batch, 4, dtype=torch.bool)
            self.decode_rows = torch.arange(batch)

    for invariant, batch, splits in [(False, 2, 1), (False, 3, 0), (True, 2, 0)]:
        backend = SplitRuleBackend(max_split_seqs=2, num_segments=2, batch_invariant=invariant)
        query = torch.randn(1, 2, batch, 8)
        out = backend.forward(Storage(), 0, query, Meta(batch), 0.3)
        assert out.shape == (batch, 2, 8) and backend.split_passes == splits, (invariant, batch)
    with pytest.raises(ValueError, match="max_split_seqs"):
        SplitRuleBackend(0)


def test_the_engine_experiment_in_bfloat16(embedded):
    """Eight held-out prompts, 16 tokens, bfloat16: batch-invariant decoding gives the same tokens at batch 1
    and 8 and with a warm prefix cache; rows for every rule and comparison."""
    _, tokenizer = embedded
    from kvlab import load_model

    model, _ = load_model(dtype=torch.bfloat16)
    prompts = held_out_prompts(8, prompt_chars=40)
    rows = run_determinism_experiment(model, tokenizer, prompts, max_tokens=16, rules=("cpu", "invariant"))
    assert [(r.comparison, r.rule) for r in rows] == [
        ("cold vs warm prefix cache (batch 8)", "one order (torch on CPU)"),
        ("batch 1 vs batch 8", "one order (torch on CPU)"),
        ("cold vs warm prefix cache (batch 8)", "batch-invariant"),
        ("batch 1 vs batch 8", "batch-invariant"),
    ]
    for row in rows:
        assert row.diff.num_tokens == 8 * 16
        assert row.diff.differing_tokens == 0, f"{row.comparison}, {row.rule}: tokens differ"
    with pytest.raises(ValueError, match="at least 2 prompts"):
        run_determinism_experiment(model, tokenizer, prompts[:1])
    with pytest.raises(ValueError, match="unknown rules"):
        run_determinism_experiment(model, tokenizer, prompts, rules=("gpu",))
