"""Hybrid models measured by running them on kvlab's engine: memory, concurrency and prefix hits, with the hybrid
KV cache manager against disable_hybrid_kv_cache_manager (every layer keeps every block, vLLM's flag).

Two tiny transformers models with random weights (4 layers, 2 KV heads of 16, context 256, window 32, float32):
a Mistral (every layer windowed) and a Qwen2 (layers 2-3 windowed, 0-1 full); and, when it is shipped, the
course's trained sliding-window sibling of the embedded model (load_model("window"): a Qwen2 of the embedded
model's size whose layers 2-3 see 32 characters). Each is served by LLM(...) with blocks of 16 tokens,
greedy, prefix caching on, at most 64 tokens per step (chunked prefill). Reported, side by side:

1. one request of each context length (prompt, then 32 generated tokens): the most KV bytes it held at once;
2. 24 such requests in the same pool bytes (1 MiB for the tiny models, 64 blocks when all layers keep every
   block; 4 MiB for the trained one, also 64): the most that ran at once, and the steps the batch took;
3. a shared-prefix workload (16 requests in turn: one 128-token prefix plus 16-61 tokens of their own, 16
   generated, in 40 all-full blocks' worth of bytes), alone and with an unrelated 160-token request after each
   (in 14 blocks' worth, so the prefix must survive eviction): prompt tokens served from the prefix cache.

Run from the repository root (about a minute)::

    OMP_NUM_THREADS=1 python benchmarks/hybrid_run.py
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

import torch  # noqa: E402
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from kvlab import LLM, SamplingParams  # noqa: E402

WINDOW, BLOCK = 32, 16
COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
CONTEXTS = (64, 128, 192, 256)
GENERATED = 32
BUDGET = 64  # tokens per step: prompts go in chunks of 64, as a windowed group's blocks stay few during prefill too


def models():
    torch.manual_seed(0)
    yield "Mistral, every layer windowed", MistralForCausalLM(
        MistralConfig(**COMMON, sliding_window=WINDOW, head_dim=16)).eval(), 97, 2**20
    torch.manual_seed(0)
    yield "Qwen2, layers 2-3 windowed", Qwen2ForCausalLM(
        Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)).eval(), 97, \
        2**20
    from kvlab import paths

    shipped = getattr(paths, "SHIPPED_MODELS", {})
    if "window" in shipped and (shipped["window"] / "model.safetensors").exists():
        from kvlab.model.loader import load_model

        model, _ = load_model("window", device="cpu")
        yield "the course's window model (trained)", model, model.config.vocab_size, 4 * 2**20


def prompt(length: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def engine(model, hybrid: bool, **knobs):
    return LLM(model, block_size=BLOCK, max_num_batched_tokens=BUDGET, max_num_seqs=64,
               disable_hybrid_kv_cache_manager=not hybrid, **knobs)


def peak_bytes(llm) -> int:
    return llm.llm_engine.stats().peak_used_blocks * llm.llm_engine.block_bytes


def peak_running(llm) -> int:
    return max(sum(s == "running" for s in record.status.values()) for record in llm.llm_engine.history)


def main() -> None:
    started = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True)
    for name, model, vocab, pool_bytes in models():
        print(f"\n{name}: window {WINDOW}, blocks of {BLOCK}, pool {pool_bytes // 1024} KiB for the batch")
        print(f"{'context':>8} {'peak KiB: hybrid':>17} {'all full':>9} {'saved':>6} | "
              f"{'24 requests, at once: hybrid':>29} {'all full':>9} | {'steps: hybrid':>14} {'all full':>9}")
        for context in CONTEXTS:
            peak, running, steps = {}, {}, {}
            for hybrid in (True, False):
                llm = engine(model, hybrid, num_blocks=64)
                llm.generate([prompt(context - GENERATED, 0, vocab)], params)
                peak[hybrid] = peak_bytes(llm) / 1024
                llm = engine(model, hybrid, kv_cache_memory=pool_bytes)
                llm.generate([prompt(context - GENERATED, i, vocab) for i in range(24)], params)
                running[hybrid] = peak_running(llm)
                steps[hybrid] = llm.llm_engine.step_count
            print(f"{context:>8} {peak[True]:>17.0f} {peak[False]:>9.0f} {1 - peak[True] / peak[False]:>6.0%} | "
                  f"{running[True]:>29} {running[False]:>9} | {steps[True]:>14} {steps[False]:>9}")
        shared = prompt(128, 99, vocab)
        workload = [shared + prompt(16 + 3 * i, 100 + i, vocab) for i in range(16)]
        # The same, with an unrelated 160-token request after each: the prefix must survive eviction to hit.
        busy = [p for i, w in enumerate(workload) for p in (w, prompt(160, 500 + i, vocab))]
        all_full_block = engine(model, False, num_blocks=2).llm_engine.block_bytes
        for label, requests, pool in (("alone", workload, 40), ("with other traffic", busy, 14)):
            for hybrid in (True, False):
                llm = engine(model, hybrid, kv_cache_memory=pool * all_full_block)
                for p in requests:
                    llm.generate([p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
                kv, blocks = llm.llm_engine.kv_cache_manager, llm.llm_engine.num_blocks
                shared_hits = kv.hits
                print(f"shared prefix {label:>18}, {'hybrid' if hybrid else 'all full':>8} ({blocks:>3} blocks in "
                      f"the same bytes): {shared_hits:,} of {kv.queries:,} prompt tokens from the cache "
                      f"({shared_hits / kv.queries:.1%})")
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
