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
Reported: normalized latency per system and rate (median over the seeds, and its range); against a bound
of --bound x paging's unloaded normalized latency, the highest measured rate each system sustains and the
rate at which its curve crosses the bound (interpolated between the two rates around it, finer than the
grid), on the median curves and seed by seed; and the paged / baseline ratios of the crossing rates (the
paper: 1.7-2.7x over Orca Oracle, 2.7-8x over Orca Max on ShareGPT). 15-20 minutes for three seeds on
a 2-core CPU; --from-json summarises a saved sweep again without measuring::

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


def ratios_to_paged(systems, seeds, crossing: dict, crossing_by_seed: dict) -> dict:
    """Paging's crossing rate over each other system's: on the median curves (None if that system never crosses
    above 0) and seed by seed (seeds where it never does are left out)."""
    ratios = {}
    for s in systems:
        if s == "paged":
            continue
        per_seed = [crossing_by_seed[seed]["paged"] / crossing_by_seed[seed][s]
                    for seed in seeds if crossing_by_seed[seed][s] > 0]
        ratios[s] = {"crossing_median_curves": crossing["paged"] / crossing[s] if crossing[s] > 0 else None,
                     "crossing_per_seed": per_seed}
    return ratios


def crossing_rate(curve: dict, bound: float) -> float:
    """The rate at which a curve first rises above `bound`, interpolated linearly between the last measured rate
    within it and the first above it: a finer answer than the grid's own rates. 0 if even the lowest rate is above
    the bound; the highest rate if none is."""
    pairs = sorted(curve.items())
    if pairs[0][1] > bound:
        return 0.0
    for (r0, l0), (r1, l1) in zip(pairs, pairs[1:]):
        if l1 > bound:
            return r0 + (r1 - r0) * (bound - l0) / (l1 - l0)
    return pairs[-1][0]


def summarise(by_seed: dict, bound_factor: float, requests: int, num_blocks: int, seconds: float | None) -> dict:
    """The report of a sweep from each seed's curves {seed: {system: {rate: s/token}}}: median curves, sustained
    and crossing rates (median curves and per seed), paged / baseline ratios; printed side by side."""
    import statistics

    seeds = list(by_seed)
    systems = list(by_seed[seeds[0]])
    rates = sorted(by_seed[seeds[0]][systems[0]])
    reference = "paged" if "paged" in systems else systems[0]
    curves = {s: {r: statistics.median(by_seed[seed][s][r] for seed in seeds) for r in rates} for s in systems}
    sustained, bound = sustained_rates(curves, bound_factor, reference)
    sustained_by_seed = {seed: sustained_rates(by_seed[seed], bound_factor, reference)[0] for seed in seeds}
    crossing = {s: crossing_rate(c, bound) for s, c in curves.items()}
    crossing_by_seed = {}
    for seed in seeds:
        own_bound = bound_factor * by_seed[seed][reference][rates[0]]
        crossing_by_seed[seed] = {s: crossing_rate(c, own_bound) for s, c in by_seed[seed].items()}

    took = f" ({seconds:.0f} s)" if seconds else ""
    print(f"\n{requests} chat-trace requests, {num_blocks} blocks of {BLOCK_SIZE} tokens of KV memory, seeds {seeds}; "
          f"normalized latency in ms per output token, median over the seeds [lowest-highest]{took}")
    print(f"{'rate (req/s)':>12} " + " ".join(f"{s:>21}" for s in systems))
    for rate in rates:
        cells = []
        for s in systems:
            runs = [by_seed[seed][s][rate] * 1e3 for seed in seeds]
            cells.append(f"{curves[s][rate] * 1e3:8.2f} [{min(runs):5.2f}-{max(runs):5.2f}]")
        print(f"{rate:>12g} " + " ".join(f"{c:>21}" for c in cells))
    print(f"\nthe bound: {bound_factor:g}x {reference}'s normalized latency at {rates[0]:g} req/s (median curves: "
          f"{bound * 1e3:.2f} ms/token; each seed against its own {reference} run)")
    print(f"{'system':<12} {'highest rate within':>20} {'per seed':>18} {'crossing (interp.)':>19} {'per seed':>20}")
    for s in systems:
        print(f"{s:<12} {sustained[s]:>14g} req/s {str([sustained_by_seed[seed][s] for seed in seeds]):>18} "
              f"{crossing[s]:>13.1f} req/s {str([round(crossing_by_seed[seed][s], 1) for seed in seeds]):>20}")
    ratios = ratios_to_paged(systems, seeds, crossing, crossing_by_seed) if reference == "paged" else {}
    for s, ratio in ratios.items():
        if ratio["crossing_median_curves"] is not None:
            print(f"  paged / {s}: {ratio['crossing_median_curves']:.2f}x at the crossing of the median curves, "
                  f"per seed {', '.join(f'{r:.2f}x' for r in ratio['crossing_per_seed'])}")
    return {"curves_s_per_token": {s: {str(r): v for r, v in c.items()} for s, c in curves.items()},
            "curves_by_seed": {str(seed): {s: {str(r): v for r, v in c.items()} for s, c in by_seed[seed].items()}
                               for seed in seeds},
            "bound_s_per_token": bound, "sustained_rate": sustained,
            "sustained_by_seed": {str(seed): v for seed, v in sustained_by_seed.items()},
            "crossing_rate": crossing, "crossing_by_seed": {str(seed): v for seed, v in crossing_by_seed.items()},
            "ratios": ratios, "seeds": seeds, "requests": requests, "num_blocks": num_blocks,
            "block_size": BLOCK_SIZE, "seconds": None if seconds is None else round(seconds, 1)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--num-blocks", type=int, default=64, help="KV memory: blocks of 16 tokens (64 = 4 x 256)")
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--bound", type=float, default=2.0,
                        help="a rate is sustained while normalized latency <= bound x paging's at the lowest rate")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="one run of every system and rate per seed (the Poisson arrivals differ)")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="measure nothing: summarise the per-seed curves of a saved sweep again")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "saved" / "figure12.json")
    args = parser.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds must be distinct, got {args.seeds}")

    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        by_seed = {int(seed): {s: {float(r): v for r, v in c.items()} for s, c in curves.items()}
                   for seed, curves in saved["curves_by_seed"].items()}
        report = summarise(by_seed, args.bound, saved["requests"], saved["num_blocks"], saved.get("seconds"))
    else:
        by_seed, elapsed = measure(args)
        report = summarise(by_seed, args.bound, args.requests, args.num_blocks, elapsed)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return report


def measure(args) -> tuple[dict, float]:
    """Every system at every rate, once per seed: ({seed: {system: {rate: normalized latency}}}, seconds)."""
    from tqdm.std import tqdm

    from kvlab import load_model
    from kvlab.benchmarks.latency import normalized_latency

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
    return by_seed, time.perf_counter() - started


if __name__ == "__main__":
    main()
