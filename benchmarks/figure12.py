"""The paper's Figure 12 on this CPU: normalized latency against request rate, paging against Orca's reservations.

Kwon et al. (SOSP 2023, Fig. 12) serve ShareGPT requests arriving as a Poisson process and plot the
normalized latency (mean end-to-end latency / output length, s/token) against the request rate, for
vLLM, Orca with three reservation rules (Max, Pow2, Oracle) and FasterTransformer (static batching):
the rate at which each curve shoots up is the load it sustains. Here the same kvlab engine, the same
KV memory (--num-blocks blocks of 16) and the same scheduler run every system; the only difference is
the allocation policy:

  paged (kvlab)   blocks as tokens come (this course)
  orca-oracle     at admission, blocks for the request's real length (prompt + output)
  orca-pow2       ... for the next power of two of its real length
  orca-max        ... for the model's maximum length (256)
  static          static batching (kvlab.baselines.static_batching): batches of num_blocks x 16 / 256
                  requests, each padded to its batch's longest, returned when the batch is done

Requests: the first --requests of the shipped chat trace (ShareGPT-like lengths) scaled to the 256-token
context, greedy, each to its output length. Arrivals and latencies on a virtual clock made of measured
step times (kvlab.benchmarks.replay: each step's CPU time, so other work on the machine does not
inflate it; run with one torch thread, or the CPU time of several threads adds up), so a sweep takes
minutes. Every system and rate is run once per --seeds (each seed draws other Poisson arrivals).
Reported: normalized latency per system and rate (median over the seeds, and its range), the highest
rate each sustains under --bound x paging's unloaded normalized latency (per seed, and on the median
curves), and the paged / baseline ratios of those rates (the paper: 1.7-2.7x over Orca Oracle, 2.7-8x
over Orca Max on ShareGPT). About 14 minutes for three seeds on a 2-core CPU::

    OMP_NUM_THREADS=1 python benchmarks/figure12.py [--requests 64] [--num-blocks 64] [--bound 2]
        [--seeds 0 1 2] [--json benchmarks/saved/figure12.json]   (the saved sweep Chapter 9 plots)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

SYSTEMS = ("paged", "orca-oracle", "orca-pow2", "orca-max", "static")
RATES = (1, 8, 16, 24, 32, 48)
BLOCK_SIZE, CONTEXT = 16, 256


def workload(tokenizer, count: int):
    from kvlab.benchmarks.datasets import chat_workload

    return chat_workload(count, tokenizer, CONTEXT)


def run_system(system: str, model, tokenizer, prompts, lens, rate: float, num_blocks: int, seed: int):
    from kvlab.baselines.static_batching import StaticBatchingEngine
    from kvlab.benchmarks.replay import replay, replay_static
    from kvlab.engine.llm_engine import LLMEngine

    if system == "static":
        batch = max(1, num_blocks * BLOCK_SIZE // CONTEXT)
        engine = StaticBatchingEngine(model, tokenizer, batch_size=batch, block_size=BLOCK_SIZE)
        return replay_static(engine, prompts, lens, rate, batch, seed)
    policy = None if system == "paged" else system.removeprefix("orca-")
    return replay(lambda: LLMEngine(model, tokenizer, block_size=BLOCK_SIZE, num_blocks=num_blocks,
                                    max_num_seqs=256, max_num_batched_tokens=256, reservation_policy=policy),
                  prompts, lens, rate, seed)


def sustained_rates(curves: dict, bound_factor: float, reference: str) -> tuple[dict, float]:
    """({system: highest rate within the bound}, bound in s/token): the bound is bound_factor x the reference's
    normalized latency at the lowest rate; a system already above it at the lowest rate sustains 0."""
    from kvlab.benchmarks.latency import knee_rate

    low = min(next(iter(curves.values())))
    bound = bound_factor * curves[reference][low]
    # knee_rate's bound is relative to a curve's own first point: scale it to the reference's.
    return ({s: knee_rate(list(c), list(c.values()), bound / c[low]) if c[low] <= bound else 0.0
             for s, c in curves.items()}, bound)


def main(argv=None) -> dict:
    import statistics

    from tqdm.std import tqdm

    from kvlab import load_model
    from kvlab.benchmarks.latency import normalized_latency

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--num-blocks", type=int, default=64, help="KV memory: blocks of 16 tokens (64 = 4 x 256)")
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--bound", type=float, default=2.0,
                        help="a rate is sustained while normalized latency <= bound x paging's at the lowest rate")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="one run of every system and rate per seed (the Poisson arrivals differ)")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "saved" / "figure12.json")
    args = parser.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds must be distinct, got {args.seeds}")

    model, tokenizer = load_model()
    prompts, lens = workload(tokenizer, args.requests)
    by_seed: dict[int, dict[str, dict[float, float]]] = {seed: {s: {} for s in args.systems} for seed in args.seeds}
    bar = tqdm(total=len(args.seeds) * len(args.systems) * len(args.rates), desc="seed x system x rate", unit="run",
               file=sys.stdout, mininterval=1.0)
    started = time.perf_counter()
    # Seeds outermost: load that drifts during the sweep then spreads over every system alike.
    for seed in args.seeds:
        for rate in args.rates:
            for system in args.systems:
                timings = run_system(system, model, tokenizer, prompts, lens, rate, args.num_blocks, seed)
                by_seed[seed][system][rate] = normalized_latency(timings)
                bar.update(1)
    bar.close()
    elapsed = time.perf_counter() - started
    reference = "paged" if "paged" in args.systems else args.systems[0]
    curves = {s: {r: statistics.median(by_seed[seed][s][r] for seed in args.seeds) for r in args.rates}
              for s in args.systems}
    sustained, bound = sustained_rates(curves, args.bound, reference)
    sustained_by_seed = {seed: sustained_rates(by_seed[seed], args.bound, reference)[0] for seed in args.seeds}

    print(f"\n{args.requests} chat-trace requests, {args.num_blocks} blocks of {BLOCK_SIZE} tokens of KV memory, "
          f"seeds {args.seeds}; normalized latency in ms per output token, median over the seeds [lowest-highest] "
          f"({elapsed:.0f} s)")
    print(f"{'rate (req/s)':>12} " + " ".join(f"{s:>21}" for s in args.systems))
    for rate in args.rates:
        cells = []
        for s in args.systems:
            runs = [by_seed[seed][s][rate] * 1e3 for seed in args.seeds]
            cells.append(f"{curves[s][rate] * 1e3:8.2f} [{min(runs):5.2f}-{max(runs):5.2f}]")
        print(f"{rate:>12g} " + " ".join(f"{c:>21}" for c in cells))
    print(f"\nhighest rate with normalized latency <= {args.bound:g}x {reference}'s at {min(args.rates):g} req/s "
          f"(median curves: {bound * 1e3:.2f} ms/token; each seed against its own {reference} run):")
    for s in args.systems:
        print(f"  {s:<12} {sustained[s]:g} req/s   per seed: {[sustained_by_seed[seed][s] for seed in args.seeds]}")
    ratios = {}
    if "paged" in sustained:
        for s in args.systems:
            if s == "paged":
                continue
            per_seed = [sustained_by_seed[seed]["paged"] / sustained_by_seed[seed][s]
                        for seed in args.seeds if sustained_by_seed[seed][s] > 0]
            median_ratio = sustained["paged"] / sustained[s] if sustained[s] > 0 else None
            ratios[s] = {"median_curves": median_ratio, "per_seed": per_seed}
            if median_ratio is not None:
                print(f"  paged / {s}: {median_ratio:.2f}x on the median curves, per seed "
                      f"{', '.join(f'{r:.2f}x' for r in per_seed)}")
    report = {"curves_s_per_token": {s: {str(r): v for r, v in c.items()} for s, c in curves.items()},
              "curves_by_seed": {str(seed): {s: {str(r): v for r, v in c.items()} for s, c in by_seed[seed].items()}
                                 for seed in args.seeds},
              "bound_s_per_token": bound, "sustained_rate": sustained,
              "sustained_by_seed": {str(seed): v for seed, v in sustained_by_seed.items()},
              "ratios": ratios, "seeds": args.seeds, "requests": args.requests,
              "num_blocks": args.num_blocks, "block_size": BLOCK_SIZE, "seconds": round(elapsed, 1)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
