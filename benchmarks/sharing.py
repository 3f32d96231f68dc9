"""Chapter 5's sharing: how many KV blocks do forked sequences save, beside Kwon et al. (SOSP 2023, §6.3)?

The workload is the shipped chat trace (assets/traces/chat.csv, ShareGPT-like lengths): its first
REQUESTS requests, each scaled to the embedded model's 256-token context with its prompt-to-output
ratio kept (prompt + output <= 240 tokens), with prompts cut from the shipped Shakespeare text. For
each request, with block size 16, it measures:

(a) parallel sampling, n = 2, 4, 6 (kvlab.decoding.parallel_sampling.sample_n): distinct blocks the n samples
    hold at the end with copy-on-write sharing, against n sequences each owning its own copy;
(b) beam search, widths 2, 4, 8 (kvlab.decoding.beam_search.beam_search, its `stats` dict): peak used blocks
    with sharing against k beams of the final length each owning its blocks;
(c) vLLM V1's strategy for the parallel-sampling case: n separate requests whose prompt is shared
    through prefix caching (kvlab.core.kv_cache_manager.KVCacheManager replayed with the samples' tokens):
    blocks held, block copies (none) and prompt tokens recomputed because only full blocks are cached
    and the last prompt token is always recomputed.

Each row sums blocks over the whole trace (the share saved on the trace) and gives the range of the
per-request shares. The paper's figures (memory saved by sharing): parallel sampling 6.1-9.8 % and
beam search 37.6-55.2 % on the Alpaca trace; 16.2-30.5 % and 44.3-66.3 % on ShareGPT.

Run from the repository root (2-3 minutes on a 2-core CPU)::

    OMP_NUM_THREADS=1 python benchmarks/sharing.py [--requests 24]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

from tqdm import tqdm  # noqa: E402

from kvlab import load_model  # noqa: E402
from kvlab.analysis.traces import load_trace  # noqa: E402
from kvlab.benchmarks.datasets import fit_to_context, prompts_from_text  # noqa: E402
from kvlab.core.kv_cache_manager import KVCacheManager  # noqa: E402
from kvlab.decoding.beam_search import beam_search  # noqa: E402
from kvlab.decoding.parallel_sampling import sample_n  # noqa: E402
from kvlab.paths import ASSETS_DIR  # noqa: E402

BLOCK_SIZE = 16
MAX_TOKENS = 240  # prompt + output of a scaled request: fits the embedded model's 256-token context
REQUESTS = 24
PAPER = {"parallel sampling": "6.1-9.8 % (Alpaca), 16.2-30.5 % (ShareGPT)",
         "beam search": "37.6-55.2 % (Alpaca), 44.3-66.3 % (ShareGPT)"}


def scaled_requests(count: int, tokenizer) -> list[tuple[list[int], int, int, int]]:
    """(prompt ids, output tokens, original prompt len, original output len) for the trace's first `count` requests."""
    original = load_trace(ASSETS_DIR / "traces" / "chat.csv")[:count]
    fitted = fit_to_context(original, MAX_TOKENS)
    text = (ASSETS_DIR / "text" / "shakespeare.txt").read_text()
    prompts = prompts_from_text(fitted, text, lambda s: tokenizer(s)["input_ids"])
    return [(p, f.output_len, o.prompt_len, o.output_len) for p, f, o in zip(prompts, fitted, original)]


def v1_separate_requests(prompt, outputs, block_size=BLOCK_SIZE):
    """vLLM V1: each sample is its own request; the prompt's full blocks are shared by prefix caching.

    Replays the n requests' tokens through a KVCacheManager (joining together, as in
    PrefixCachingGenerator.step) up to the state sample_n ends in: prompt + all but the last output
    token stored. Returns (distinct blocks held, block copies, prompt tokens recomputed).
    """
    n, P = len(outputs), len(prompt)
    manager = KVCacheManager(n * (-(-(P + len(outputs[0])) // block_size)) + 1, block_size, enable_prefix_caching=True)
    fed = 0
    for i in range(n):
        hits, num_cached = manager.get_computed_blocks(i, prompt)
        manager.allocate_slots(i, P - num_cached, hits, new_token_ids=prompt[num_cached:])
        fed += P - num_cached
    for step in range(len(outputs[0]) - 1):
        for i in range(n):
            manager.allocate_slots(i, 1, new_token_ids=[outputs[i][step]])
    held = {b for table in manager.block_tables.values() for b in table}
    return len(held), 0, fed - P


def saved(shared: int, own: int) -> float:
    return 1 - shared / own


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=REQUESTS, help="how many trace requests to run")
    args = parser.parse_args()
    start = time.perf_counter()
    model, tokenizer = load_model()
    rows = scaled_requests(args.requests, tokenizer)
    prompt_share = sum(len(p) for p, *_ in rows) / sum(len(p) + o for p, o, *_ in rows)
    orig_share = sum(op for *_, op, _ in rows) / sum(op + oo for *_, op, oo in rows)
    print(f"{len(rows)} requests of {ASSETS_DIR.name}/traces/chat.csv, block size {BLOCK_SIZE}; "
          f"scaled to <= {MAX_TOKENS} tokens each; prompts are {prompt_share:.0%} of all tokens "
          f"(unscaled trace: {orig_share:.0%})\n")

    table = {}
    for n in (2, 4, 6):
        sums = [0, 0, 0, 0, 0]
        per = []
        for prompt, out_len, *_ in tqdm(rows, desc=f"parallel sampling n={n}", leave=False):
            r = sample_n(model, prompt, n, out_len, seed=0, block_size=BLOCK_SIZE)
            v1_blocks, _, recomputed = v1_separate_requests(prompt, r.outputs)
            for i, v in enumerate((r.blocks_with_sharing, r.blocks_without_sharing, r.copies, v1_blocks, recomputed)):
                sums[i] += v
            per.append(saved(r.blocks_with_sharing, r.blocks_without_sharing))
        table[("sampling", n)] = (sums, per)
    for k in (2, 4, 8):
        sums = [0, 0, 0]
        per = []
        for prompt, out_len, *_ in tqdm(rows, desc=f"beam search k={k}", leave=False):
            stats = {}
            beam_search(model, prompt, k, out_len, stats=stats, block_size=BLOCK_SIZE)
            for i, v in enumerate((stats["peak_used_blocks"], stats["blocks_without_sharing"], stats["copies"])):
                sums[i] += v
            per.append(saved(stats["peak_used_blocks"], stats["blocks_without_sharing"]))
        table[("beam", k)] = (sums, per)

    print(f"(a) parallel sampling (temperature 1, seed 0)   paper: {PAPER['parallel sampling']}")
    print("   n | blocks shared  own copies  saved (per request) | CoW copies "
          "| V1 prefix caching: blocks  saved  recomputed tokens")
    for n in (2, 4, 6):
        (shared, own, copies, v1, recomputed), per = table[("sampling", n)]
        print(f" {n:>3} | {shared:>13} {own:>11} {saved(shared, own):>6.1%} ({min(per):.0%}-{max(per):.0%}) |"
              f" {copies:>10} | {v1:>24} {saved(v1, own):>6.1%} {recomputed:>18}")
    print(f"\n(b) beam search (length_penalty 1.0)   paper: {PAPER['beam search']}")
    print("   k | peak blocks shared  own copies  saved (per request) | CoW copies")
    for k in (2, 4, 8):
        (shared, own, copies), per = table[("beam", k)]
        print(f" {k:>3} | {shared:>18} {own:>11} {saved(shared, own):>6.1%} ({min(per):.0%}-{max(per):.0%}) "
              f"| {copies:>10}")
    print(f"\ntotal {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
