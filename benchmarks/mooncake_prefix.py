"""The Mooncake conversation trace (FAST'25, one hour of Kimi's traffic): its statistics, and prefix-cache hits
against KV capacity on kvlab's own block pool.

(a) The trace: input and output length percentiles, arrivals per 5-minute window, and the share of prompt
    tokens an unbounded prefix cache would serve (kvlab.analysis.mooncake.infinite_cache_hits).
(b) Hit rate against capacity: every request's prompt, in arrival order, through kvlab's BlockPool (LRU
    free queue) exactly as KVCacheManager admits and frees it (prefix_cache_hits), at block sizes 512 (the
    trace's own) and 16 (vLLM's default), capacities of 0.5M to 32M tokens. Compute time is ignored: each
    request is freed before the next arrives, so the whole capacity is prefix cache (the paper's Figure 9
    makes the same simplification). The unbounded column is the analytic figure; a replay on a pool large
    enough to evict nothing (block size 512) must give the same number, and does.
(c) The check and the cost: the first 300 requests replayed through KVCacheManager itself on prompts from
    PromptSynthesizer must give the same hits and evictions as (b), and the seconds each stage takes.

Run from the repository root (about 2.5 minutes; --quick: block size 512 only, about 20 s)::

    python benchmarks/mooncake_prefix.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

from kvlab.analysis.mooncake import (  # noqa: E402
    MOONCAKE_BLOCK_TOKENS,
    PromptSynthesizer,
    infinite_cache_hits,
    load_mooncake_trace,
    prefix_cache_hits,
    prefix_cache_hits_from_tokens,
)

CAPACITIES = (500_000, 1_000_000, 2_000_000, 4_000_000, 8_000_000, 16_000_000, 32_000_000)
CHECK_REQUESTS = 300


def _percentiles(values) -> str:
    p = np.percentile(values, [50, 90, 99])
    return f"mean {np.mean(values):,.0f} | p50 {p[0]:,.0f} | p90 {p[1]:,.0f} | p99 {p[2]:,.0f} | max {np.max(values):,}"


def trace_statistics(requests) -> None:
    inputs = np.array([r.input_length for r in requests])
    outputs = np.array([r.output_length for r in requests])
    arrivals = np.array([r.arrival_s for r in requests])
    print(f"{len(requests):,} requests over {arrivals[-1]:,.0f} s, {inputs.sum():,} prompt tokens, "
          f"{outputs.sum():,} output tokens")
    print(f"| input tokens | {_percentiles(inputs)} |")
    print(f"| output tokens | {_percentiles(outputs)} |")
    window = 300.0
    counts = np.bincount((arrivals // window).astype(int))
    rates = counts / window
    print(f"arrivals per {window:.0f} s window, requests/s: mean {len(requests) / arrivals[-1]:.2f}, "
          f"min {rates.min():.2f}, max {rates.max():.2f}; by window: {' '.join(f'{r:.2f}' for r in rates)}")
    token_rate = inputs.sum() / arrivals[-1]
    print(f"prompt tokens per second: {token_rate:,.0f}")
    distinct = len({h for r in requests for h in r.hash_ids})
    print(f"distinct {MOONCAKE_BLOCK_TOKENS}-token blocks: {distinct:,} of {sum(len(r.hash_ids) for r in requests):,}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="block size 512 only")
    args = parser.parse_args()
    gc.freeze()  # the pools' block objects live for the whole run: the collector need not walk them

    start = time.perf_counter()
    requests = load_mooncake_trace("conversation")
    load_s = time.perf_counter() - start
    print(f"## (a) the trace (loaded and validated in {load_s:.2f} s)\n")
    trace_statistics(requests)

    block_sizes = (512,) if args.quick else (512, 16)
    print("\n## (b) prefix-cache hit rate against KV capacity (each request freed before the next)\n")
    print("| capacity (tokens) | " + " | ".join(f"block {b}: hit rate (evicted blocks)" for b in block_sizes) + " |")
    print("|---:|" + "---:|" * len(block_sizes))
    replay_s: dict[int, list[float]] = {b: [] for b in block_sizes}
    for capacity in CAPACITIES:
        cells = []
        for b in block_sizes:
            t = time.perf_counter()
            result = prefix_cache_hits(requests, capacity, b)
            replay_s[b].append(time.perf_counter() - t)
            cells.append(f"{result.hit_rate:.1%} ({result.evictions:,})")
        print(f"| {capacity / 1e6:g}M | " + " | ".join(cells) + " |")
    t = time.perf_counter()
    unbounded = {b: infinite_cache_hits(requests, b) for b in block_sizes}
    infinite_s = (time.perf_counter() - t) / len(block_sizes)
    print("| unbounded | " + " | ".join(f"{unbounded[b].hit_rate:.2%} (0)" for b in block_sizes) + " |")
    distinct = len({h for r in requests for h in r.hash_ids})
    big = (distinct + 1) * MOONCAKE_BLOCK_TOKENS
    check = prefix_cache_hits(requests, big, 512)
    print(f"\nreplay on a pool of {big:,} tokens (every distinct block once, plus one): hit rate "
          f"{check.hit_rate:.2%}, {check.evictions} evictions, equal to the analytic figure: "
          f"{check.hit_tokens == unbounded[512].hit_tokens}")
    print(f"unbounded, {unbounded[block_sizes[-1]].hit_tokens:,} of {unbounded[block_sizes[-1]].prompt_tokens:,} "
          f"prompt tokens at block size {block_sizes[-1]}")

    print(f"\n## (c) the same replay through KVCacheManager on synthesized tokens (first {CHECK_REQUESTS} requests)\n")
    head = requests[:CHECK_REQUESTS]
    synthesizer = PromptSynthesizer(vocab_size=32000, max_hash_id=max(h for r in requests for h in r.hash_ids))
    for b in block_sizes:
        for capacity in (500_000, 2_000_000):
            fast = prefix_cache_hits(head, capacity, b)
            t = time.perf_counter()
            slow = prefix_cache_hits_from_tokens(head, capacity, b, synthesizer)
            dt = time.perf_counter() - t
            print(f"block {b}, {capacity / 1e6:g}M tokens: hits {slow.hit_tokens:,} / evictions {slow.evictions:,} "
                  f"(block keys: {fast.hit_tokens:,} / {fast.evictions:,}), identical: {slow == fast}; "
                  f"{dt / slow.prompt_tokens * 1e6:.2f} us per prompt token")
    t = time.perf_counter()
    total = sum(len(p) for p in synthesizer.iter_prompts(requests))
    synth_s = time.perf_counter() - t
    print(f"\nsynthesizing every prompt ({total:,} tokens, one request at a time): {synth_s:.1f} s")
    print("\n## seconds per whole-trace replay (median over the capacities above, min-max)\n")
    print(f"load and validate: {load_s:.2f} s; unbounded (analytic): {infinite_s:.2f} s")
    for b, times in replay_s.items():
        print(f"block {b}: {statistics.median(times):.2f} s ({min(times):.2f}-{max(times):.2f})")


if __name__ == "__main__":
    main()
