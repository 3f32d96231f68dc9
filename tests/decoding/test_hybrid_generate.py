"""Real hybrid models on kvlab's hybrid pool: Mistral's windowed layers and Qwen2's mix of full and windowed ones.

Greedy outputs must equal transformers' generate token for token, for prompts and generations longer than the
window, with chunked prefill, prefix caching and preemption on; the windowed groups must hold only the blocks
their window reaches, and a cache that cannot honour a window must refuse such a model.
"""

import pytest
import torch
from transformers import MistralForCausalLM

from conftest import make_tiny_hybrid_model
from kvlab.cache.naive_cache import NaiveKVCache
from kvlab.core.kv_cache_interface import SlidingWindowSpec
from kvlab.decoding.hybrid_generate import HybridGenerator, hybrid_groups
from kvlab.model.attention_hook import forward

WINDOW = 8


def tiny(family: str):
    return make_tiny_hybrid_model(family, WINDOW)


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def model(request):
    return tiny(request.param)


def prompts():
    base = [[(7 * i + 3 * j) % 97 for j in range(20 + 3 * i)] for i in range(4)]
    base[1] = base[0][:12] + base[1][12:]      # shares three blocks of 4 with the first
    base[3] = base[2][:16] + base[3][16:]
    return base


def reference(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("pool", ["roomy", "tight"])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_greedy_outputs_equal_transformers_generate(model, pool, backend):
    # Mistral's windowed layers hold a few blocks per request; Qwen2's full layers hold every token's.
    tight = 10 if isinstance(model, MistralForCausalLM) else 30
    num_blocks, budget = (64, 10) if pool == "roomy" else (tight, 12)
    gen = HybridGenerator(model, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget,
                          attention_backend=backend)
    outs = gen.generate(prompts(), 16)
    for i, (prompt, out) in enumerate(zip(prompts(), outs)):
        assert out == reference(model, prompt, 16), \
            f"prompt {i} ({len(prompt)} tokens, window {WINDOW}): kvlab's hybrid pool differs from transformers"
    assert gen.coordinator.hits > 0, "set-up: shared prefixes must hit the prefix cache"
    if pool == "tight":
        assert gen.num_preemptions > 0, "set-up: the tight pool must force preemptions"
    assert gen.coordinator.num_free_blocks == gen.coordinator.num_blocks, "every block back at the end"


def test_windowed_groups_hold_only_what_their_window_reaches(model):
    gen = HybridGenerator(model, num_blocks=64, block_size=4, max_num_batched_tokens=64)
    seen = []
    original = gen.coordinator.remove_skipped_blocks

    def after_step(rid, num_computed):
        freed = original(rid, num_computed)
        for manager in gen.coordinator.managers:
            if isinstance(manager.kv_cache_spec, SlidingWindowSpec):
                live = [b for b in manager.req_to_blocks[rid] if b is not gen.coordinator.null_block]
                seen.append(len(live))
        return freed

    gen.coordinator.remove_skipped_blocks = after_step
    gen.generate([list(range(40))], 24)
    # The next query reads 7 older tokens: they span at most 3 blocks of 4, plus the block it writes into.
    assert seen and max(seen[1:]) <= 3, f"a windowed group held {max(seen)} blocks for a window of {WINDOW} tokens"


def test_groups_follow_the_models_layer_pattern(model):
    groups = hybrid_groups(model, 4)
    windowed = sorted(layer for g in groups if isinstance(g.kv_cache_spec, SlidingWindowSpec) for layer in g.layer_ids)
    assert windowed == ([0, 1, 2, 3] if isinstance(model, MistralForCausalLM) else [2, 3])


def test_a_cache_without_windows_refuses_a_windowed_model(model):
    with pytest.raises(ValueError, match=f"sliding window of {WINDOW} tokens, but NaiveKVCache computes full"):
        forward(model, list(range(12)), list(range(12)), NaiveKVCache(model.config.num_hidden_layers))


def test_disabling_the_hybrid_manager_keeps_every_block_and_changes_no_token(model):
    on = HybridGenerator(model, num_blocks=64, block_size=4, max_num_batched_tokens=64)
    off = HybridGenerator(model, num_blocks=64, block_size=4, max_num_batched_tokens=64,
                          disable_hybrid_kv_cache_manager=True)
    assert len(off.groups) == 1 and not isinstance(off.groups[0].kv_cache_spec, SlidingWindowSpec)
    prompt = [list(range(40))]
    assert on.generate(prompt, 24) == off.generate(prompt, 24), "where blocks live changes no token"
    # A block id spans one layer per group position: compare bytes (Qwen2 here: 2 groups of 2 layers, or 1 of 4).
    assert on.peak_blocks * on.bytes_per_block < off.peak_blocks * off.bytes_per_block, \
        "freeing behind the window holds fewer bytes at the peak"
