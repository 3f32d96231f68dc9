"""Chapter 5's sharing: how many KV blocks do forked sequences save, beside Kwon et al. (SOSP 2023, §6.3)?

For a few prompts of the embedded model (block size 16, contexts under 256 tokens) it prints:

(a) parallel sampling, n = 2, 4, 6 (kvlab.parallel_sampling.sample_n): distinct blocks the n samples
    hold at the end with copy-on-write sharing, against n sequences each owning its own copy, the
    share of memory saved and the copy-on-write block copies;
(b) beam search, widths 2, 4, 8 (kvlab.beam_search.beam_search, its `stats` dict): peak used blocks
    with sharing against k beams of the final length each owning its blocks;
(c) vLLM V1's strategy for the same parallel-sampling case: n separate requests whose prompt is
    shared through prefix caching (kvlab.kv_cache_manager.KVCacheManager replayed with the samples'
    tokens, as PrefixCachingGenerator calls it): blocks held, block copies (none) and prompt tokens
    recomputed because only full blocks are cached and the last prompt token is always recomputed.

The paper's figures (memory saved by sharing): parallel sampling 6.1-9.8 % and beam search
37.6-55.2 % on the Alpaca trace; 16.2-30.5 % and 44.3-66.3 % on ShareGPT. The share saved grows with
the prompt's part of each sequence: these prompts (89-171 tokens) are long beside their 32-48 new
tokens, so sharing saves more here than on the paper's traces, whose outputs are longer.

Run from the repository root (about 10-30 seconds on a CPU)::

    OMP_NUM_THREADS=1 python benchmarks/sharing.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

from kvlab import load_model  # noqa: E402
from kvlab.beam_search import beam_search  # noqa: E402
from kvlab.kv_cache_manager import KVCacheManager  # noqa: E402
from kvlab.parallel_sampling import sample_n  # noqa: E402

BLOCK_SIZE = 16
PROMPTS = [
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles",
    "Now is the winter of our discontent made glorious summer by this sun of York; and all the "
    "clouds that lour'd upon our house in the deep bosom of the ocean buried.",
    "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him.",
]
SAMPLE_TOKENS = 48
BEAM_TOKENS = 32
PAPER = {"parallel sampling": "6.1-9.8 % (Alpaca), 16.2-30.5 % (ShareGPT)",
         "beam search": "37.6-55.2 % (Alpaca), 44.3-66.3 % (ShareGPT)"}


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


def main():
    start = time.perf_counter()
    model, tokenizer = load_model()
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    print(f"block size {BLOCK_SIZE}; prompt lengths {[len(p) for p in prompts]} tokens; "
          f"{SAMPLE_TOKENS} sampled / up to {BEAM_TOKENS} beam-search tokens\n")

    print(f"(a) parallel sampling (temperature 1, seed 0)   paper: {PAPER['parallel sampling']}")
    print(" prompt   n | blocks shared  own copies  saved | CoW copies | V1 prefix caching: blocks  saved  copies  recomputed")
    v1_rows = []
    for p, prompt in enumerate(prompts):
        for n in (2, 4, 6):
            r = sample_n(model, prompt, n, SAMPLE_TOKENS, seed=0, block_size=BLOCK_SIZE)
            v1_blocks, v1_copies, recomputed = v1_separate_requests(prompt, r.outputs)
            saved = 1 - r.blocks_with_sharing / r.blocks_without_sharing
            v1_saved = 1 - v1_blocks / r.blocks_without_sharing
            v1_rows.append(v1_saved)
            print(f" {p:>6} {n:>3} | {r.blocks_with_sharing:>13} {r.blocks_without_sharing:>11} {saved:>6.1%} |"
                  f" {r.copies:>10} | {v1_blocks:>24} {v1_saved:>6.1%} {v1_copies:>7} {recomputed:>11}")

    print(f"\n(b) beam search (length_penalty 1.0)   paper: {PAPER['beam search']}")
    print(" prompt   k | peak blocks shared  own copies  saved | CoW copies  forks")
    for p, prompt in enumerate(prompts):
        for k in (2, 4, 8):
            stats = {}
            beam_search(model, prompt, k, BEAM_TOKENS, stats=stats, block_size=BLOCK_SIZE)
            saved = 1 - stats["peak_used_blocks"] / stats["blocks_without_sharing"]
            print(f" {p:>6} {k:>3} | {stats['peak_used_blocks']:>18} {stats['blocks_without_sharing']:>11} {saved:>6.1%} |"
                  f" {stats['copies']:>10} {stats['forks']:>6}")
    print(f"\ntotal {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
