"""Hybrid models by arithmetic: blocks a request holds and requests that fit, hybrid against all-full attention.

For Gemma 3 27B (52 sliding layers of window 1024, 10 full), gpt-oss-120b (18 sliding of 128, 18 full) and
Qwen3-Next-80B-A3B (36 Gated DeltaNet layers, 12 full), at contexts 1k-32k: the block ids a request holds
once it has computed that many tokens (kvlab.analysis.hybrid.request_footprint) with vLLM's hybrid KV cache
manager and with every attention layer treated as full, and how many such requests a KV budget holds. bf16
K/V; block size 16, except Qwen3-Next, whose attention block vLLM raises so a page holds one layer's state.
Then a measured simulation on kvlab's KVCacheManager: prefix-cache hit rates of a shared-prefix workload at
block size 16 against the raised block, and under each mamba_cache_mode. No model runs: it is arithmetic.

Run from the repository root (a few seconds)::

    python benchmarks/hybrid_memory.py [--budget-gib 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

from kvlab.analysis import hybrid  # noqa: E402
from kvlab.analysis.kv_size import load_model_config  # noqa: E402

GiB = 1024 ** 3
MODELS = ("gemma-3-27b-it", "gpt-oss-120b", "qwen3-next-80b-a3b-instruct")
CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)


def model_block_size(config, mode: str = "none") -> int:
    """16, or the attention block vLLM raises to for a model with linear-attention layers."""
    if not hybrid.layer_pattern(config).count(hybrid.LINEAR):
        return 16
    state = hybrid.mamba_state_spec(config).page_size_bytes
    return hybrid.mamba_attention_block_size(hybrid.attention_page_bytes_per_token(config), state, mode)


def memory_table(budget_bytes: int) -> None:
    print(f"KV budget {budget_bytes / GiB:.0f} GiB, bf16 K/V. Blocks = block ids held per request "
          f"(each spans group_size layers); fit = concurrent requests.")
    print(f"{'model':<28}{'block':>6}{'group':>6}{'context':>9}{'hybrid blocks':>15}{'full blocks':>13}"
          f"{'hybrid GiB':>12}{'full GiB':>10}{'hybrid fit':>12}{'full fit':>10}")
    for name in MODELS:
        config = load_model_config(name)
        block = model_block_size(config)
        for context in CONTEXTS:
            f = hybrid.request_footprint(config, context, block_size=block)
            fit_h, fit_f = hybrid.requests_that_fit(f, budget_bytes, config)
            print(f"{name:<28}{block:>6}{f.group_size:>6}{context:>9}{f.hybrid_blocks:>15}{f.full_blocks:>13}"
                  f"{f.hybrid_bytes / GiB:>12.3f}{f.full_bytes / GiB:>10.3f}{fit_h:>12}{fit_f:>10}")


def hit_rate_table() -> None:
    config = load_model_config("qwen3-next-80b-a3b-instruct")
    raised = {mode: model_block_size(config, mode) for mode in hybrid.MAMBA_CACHE_MODES}
    print(f"\nQwen3-Next-80B-A3B: one layer's state {hybrid.mamba_state_spec(config).page_size_bytes:,} bytes, "
          f"attention {hybrid.attention_page_bytes_per_token(config):,} bytes per token per layer; attention block "
          f"raised to {raised['none']} (mamba_cache_mode none/align) or {raised['all']} (all).")
    workloads = {
        "short: 300 shared + 20-200": hybrid.shared_prefix_prompts(200, 300, (20, 200)),
        "long: 1200 shared + 50-600": hybrid.shared_prefix_prompts(200, 1200, (50, 600)),
    }
    print(f"{'workload (200 prompts, tokens)':<32}{'bs 16, no Mamba':>16}{'none':>8}"
          f"{'align @' + str(raised['align']):>12}{'all @' + str(raised['all']):>10}{'bs raised, no Mamba':>21}")
    for label, prompts in workloads.items():
        row = [hybrid.simulate_prefix_hit_rate(prompts, 16),
               hybrid.simulate_prefix_hit_rate(prompts, raised["none"], "none"),
               hybrid.simulate_prefix_hit_rate(prompts, raised["align"], "align"),
               hybrid.simulate_prefix_hit_rate(prompts, raised["all"], "all"),
               hybrid.simulate_prefix_hit_rate(prompts, raised["all"])]
        print(f"{label:<32}{row[0]:>16.3f}{row[1]:>8.3f}{row[2]:>12.3f}{row[3]:>10.3f}{row[4]:>21.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=20.0,
                        help="KV GiB per GPU (default 20: an 80 GiB H100 at 0.92 less ~54 GiB of bf16 Gemma 3 27B)")
    args = parser.parse_args()
    memory_table(int(args.budget_gib * GiB))
    hit_rate_table()


if __name__ == "__main__":
    main()
