"""Chapter 4's block pool: is allocate + free O(1) per block, and what does prefix caching save on a chat trace?

(a) Times get_new_blocks + free_blocks, and a cache hit on a free block in the middle of the free
    queue (touch + free), in pools of 1,000 to 1,000,000 blocks, and prints nanoseconds per block
    beside the ratio to the smallest pool: flat ratios mean the cost does not grow with the pool.
(b) Replays assets/traces/shared_prefix.json (requests sharing four play openings of 28, 48, 80 and
    120 tokens) through a KVCacheManager at block sizes 8, 16 and 32 and prints the hit rate and the
    prefill tokens saved. Only full blocks are cached, so the part of a system prompt past its last
    full block is recomputed, and the 28-token prompt never hits at block size 32.

Run from the repository root (about 10-20 seconds, most of it building the 1M-block pool)::

    python benchmarks/block_pool.py
"""

from __future__ import annotations

import gc
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

from kvlab.analysis.chat_prompts import load_shared_prefix_trace  # noqa: E402
from kvlab.core.block_pool import BlockPool  # noqa: E402
from kvlab.core.kv_cache_manager import KVCacheManager  # noqa: E402

POOL_SIZES = (1_000, 10_000, 100_000, 1_000_000)
BATCH = 16          # blocks per allocate/free call, a request's worth
ROUNDS = 4_000      # calls timed per repeat
REPEATS = 5         # keep the fastest repeat: a busy machine's hiccups are not the pool's cost


def _time_allocate_free(pool: BlockPool) -> float:
    """Nanoseconds per block of get_new_blocks(BATCH) followed by freeing them last block first."""
    start = time.perf_counter()
    for _ in range(ROUNDS):
        pool.free_blocks(reversed(pool.get_new_blocks(BATCH)))
    return (time.perf_counter() - start) / (ROUNDS * BATCH) * 1e9


def _cached_picks(pool: BlockPool) -> list[list]:
    """Cache 1,000 blocks, free them, and pick ROUNDS * BATCH of them at random for hits."""
    held = pool.get_new_blocks(min(pool.num_blocks, 1_000))
    pool.cache_full_blocks(held, [("bench", block.block_id) for block in held])
    pool.free_blocks(held)
    rng = random.Random(0)
    return [[rng.choice(held)] for _ in range(ROUNDS * BATCH)]


def _time_hit_in_the_middle(pool: BlockPool, picks: list[list]) -> float:
    """Nanoseconds per touch + free of a free cached block (unlinked from the middle of the queue, appended back)."""
    start = time.perf_counter()
    for pick in picks:
        pool.touch(pick)
        pool.free_blocks(pick)
    return (time.perf_counter() - start) / len(picks) * 1e9


def pool_scaling() -> None:
    print("(a) cost per block, in ns (ratio to the 1,000-block pool)")
    pools, builds = [], []
    for size in POOL_SIZES:
        start = time.perf_counter()
        pools.append(BlockPool(size))
        builds.append(time.perf_counter() - start)
    picks = [_cached_picks(pool) for pool in pools]
    # The million block objects live as long as the pool: without freezing them, every full garbage
    # collection would walk them all, a cost of Python's collector rather than of the pool.
    gc.freeze()
    best = [[float("inf")] * 2 for _ in pools]
    # Pools take turns within each repeat so that a busy machine slows them all alike.
    # Hits first: allocating cycles through the whole small pool and would evict the cached blocks.
    for _ in range(REPEATS):
        for cost, pool, pool_picks in zip(best, pools, picks):
            cost[1] = min(cost[1], _time_hit_in_the_middle(pool, pool_picks))
    for _ in range(REPEATS):
        for cost, pool in zip(best, pools):
            cost[0] = min(cost[0], _time_allocate_free(pool))
    gc.unfreeze()
    print(f"{'blocks':>10} {'build s':>8} {'allocate+free':>20} {'hit mid-queue':>20}")
    for size, build, costs in zip(POOL_SIZES, builds, best):
        cells = [f"{c:8.0f} ({c / b:4.2f}x)" for c, b in zip(costs, best[0])]
        print(f"{size:>10,} {build:8.2f} {cells[0]:>20} {cells[1]:>20}")


def replay(trace: dict, block_size: int, num_blocks: int = 2_048) -> KVCacheManager:
    """Admit every request at its arrival step and hold its blocks while it decodes max_new_tokens tokens."""
    from transformers import AutoTokenizer

    from kvlab.paths import DEFAULT_MODEL_DIR

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    manager = KVCacheManager(num_blocks, block_size)
    pending = sorted(trace["requests"], key=lambda r: r["arrival_step"])
    running: dict[int, int] = {}  # request id -> tokens still to decode
    step = 0
    while pending or running:
        for rid in list(running):
            # A stand-in output token no prompt contains, so outputs never fake a hit.
            manager.allocate_slots(rid, 1, new_token_ids=[10_000 + rid])
            running[rid] -= 1
            if running[rid] == 0:
                manager.free(rid)
                del running[rid]
        while pending and pending[0]["arrival_step"] <= step:
            request = pending.pop(0)
            ids = tokenizer(request["prompt"])["input_ids"]
            blocks, cached = manager.get_computed_blocks(request["request_id"], ids)
            manager.allocate_slots(request["request_id"], len(ids) - cached, blocks, new_token_ids=ids[cached:])
            running[request["request_id"]] = request["max_new_tokens"] - 1
        step += 1
    return manager


def prefix_hits() -> None:
    trace = load_shared_prefix_trace()
    systems = trace["system_prompts"]
    seen: set[int] = set()
    ideal = 0  # tokens a token-granular cache (block size 1) would save on the system prompts
    for request in trace["requests"]:
        if request["system_prompt_id"] in seen:
            ideal += len(systems[request["system_prompt_id"]])
        seen.add(request["system_prompt_id"])
    total = sum(len(r["prompt"]) for r in trace["requests"])
    print(f"\n(b) {len(trace['requests'])} requests, {total} prompt tokens, system prompts of "
          f"{', '.join(str(len(s)) for s in systems)} tokens; a block-size-1 cache would save {ideal} of them")
    print(f"{'block size':>10} {'hit rate':>9} {'saved':>6} {'of ideal':>9}   saved per hit, by system prompt")
    for block_size in (8, 16, 32):
        manager = replay(trace, block_size)
        per_prompt = [len(s) // block_size * block_size for s in systems]
        print(f"{block_size:>10} {manager.hit_rate:9.1%} {manager.prefill_tokens_saved:>6} "
              f"{manager.prefill_tokens_saved / ideal:9.1%}   {per_prompt}")


if __name__ == "__main__":
    pool_scaling()
    prefix_hits()
