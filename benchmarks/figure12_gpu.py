"""The paper's Figure 12 at the paper's scale, simulated: OPT-13B on one A100-40GB, kvlab's scheduler on a GPU clock.

Kwon et al. (SOSP 2023, Fig. 12) serve ShareGPT requests (means 161 input / 338 output tokens) and Alpaca requests
(19 / 58) arriving as a Poisson process to OPT-13B on one A100-40GB, max_model_len 2048, blocks of 16, and plot
the normalized latency (mean end-to-end latency / output length) against the request rate for vLLM, Orca (Max,
Pow2, Oracle) and FasterTransformer. Here every system is kvlab's own scheduler and KV cache manager in
kvlab.simulation.engine (paging, the three reservation rules, static batching as kvlab's baseline runs it), on a
clock of the step-time model for OPT-13B on an A100-40GB (4 ms per-step cost), with the pool kv_capacity gives
(989 blocks of 16): no constant is tuned to the paper's result. Requests: --requests per run, Poisson arrivals,
one run per seed, rate and system; lengths drawn (seeded) from the shipped ShareGPT-like chat trace (means 152 /
310 tokens, --workload sharegpt) or from kvlab.analysis.traces.instruct_trace's Alpaca-like lognormals (means 19 /
58, --workload alpaca).

The bound is --bound x paging's normalized latency at the lowest coarse rate (per seed, and on the median
curves). Each system's rates are searched around its own knee, the same rates for every seed: the coarse rates
upward until the median over the seeds is above the bound (a system already above it at the lowest rate goes
down by halves to --min-rate instead, static batching at Figure 12's scale), then --refine bisections of the
bracket around the crossing. A run past a knee costs as much as one before it, so the search spends its runs
where the curve crosses the bound rather than far beyond it. --grid runs every system at every coarse rate.
Reported: the curves per seed, the rate each curve crosses the bound (interpolated between the two measured
rates around it), on the median curves and seed by seed, and the paged / baseline ratios next to the paper's
1.7-2.7x (Oracle) and 2.7-8x (Max) on ShareGPT. --jobs runs that many simulations at once (one per core).

--arena says where an Orca reservation lives. "pool" (the default): blocks of the paged pool, anywhere, so Orca
loses memory only to what it reserves and never to external fragmentation. "buddy": one contiguous range placed
by the binary buddy allocator that the paper's Orca baselines assume (§6.1), which rounds each range up to a power
of two and merges a freed range only with its buddy; "first-fit": one range placed first-fit (Chapter 2's arena).
Under a buddy allocator kvlab's Pow2 (the power of two at or above the final length) occupies exactly Oracle's
range, so its runs would repeat Oracle's: the default systems for an arena leave it out::

    OMP_NUM_THREADS=1 python benchmarks/figure12_gpu.py [--workload sharegpt] [--requests 1000]
        [--coarse 0.5 1 2 3 4] [--refine 3] [--seeds 0 1 2] [--bound 2] [--jobs 2] [--arena pool]
        [--json benchmarks/saved/figure12_gpu.json]
    python benchmarks/figure12_gpu.py --from-json a.json   (summarise a saved sweep again, simulating nothing)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab
sys.path.insert(0, str(ROOT / "benchmarks"))

SYSTEMS = ("paged", "orca-oracle", "orca-pow2", "orca-max", "static")
MODEL, GPU, MAX_MODEL_LEN, NUM_BLOCKS, BLOCK_SIZE = "opt-13b", "A100-40GB", 2048, 989, 16
WORKLOADS = {  # the coarse rates that bracket every knee of the workload, and the paper's mean lengths
    "sharegpt": {"coarse": [0.5, 1, 2, 3, 4], "paper_means": [161, 338], "json": "figure12_gpu.json"},
    "alpaca": {"coarse": [4, 8, 16, 32, 64, 128], "paper_means": [19, 58], "json": "figure12_gpu_alpaca.json"},
}
ARENAS = ("pool", "first-fit", "buddy")
PAPER_RATIOS = {"orca-oracle": [1.7, 2.7], "orca-max": [2.7, 8.0]}  # ShareGPT, OPT-13B (§6.2)


def workload_requests(workload: str, count: int, rate: float, seed: int):
    """count requests of the workload's lengths (seeded), prompts of fresh token ids, Poisson arrivals at rate."""
    import random

    from kvlab.analysis.traces import instruct_trace
    from kvlab.simulation.planning import chat_requests, requests_with_fresh_prompts

    if workload == "sharegpt":
        return chat_requests(count, rate, seed)
    rng = random.Random(seed)
    return requests_with_fresh_prompts(instruct_trace(count, max_model_len=MAX_MODEL_LEN, seed=seed), rate, seed, rng)


def run_point(workload: str, system: str, rate: float, seed: int, count: int, arena: str = "pool") -> float:
    """One simulated run: the normalized latency (s/token) of system at rate with seed's requests; arena places
    an Orca system's reservations (pool: the paged pool's blocks)."""
    from kvlab.benchmarks.latency import normalized_latency
    from kvlab.simulation.engine import simulate

    knobs = {"reservation_arena": arena} if arena != "pool" and system.startswith("orca-") else {}
    result = simulate(workload_requests(workload, count, rate, seed), MODEL, GPU, system=system,
                      max_model_len=MAX_MODEL_LEN, **knobs)
    return normalized_latency(result.timings)


class Sweep:
    """Runs of (system, rate) for every seed, each simulated once, on this process or a pool of --jobs processes."""

    def __init__(self, workload: str, seeds: list[int], count: int, jobs: int, progress, arena: str = "pool"):
        self.workload, self.seeds, self.count, self.progress, self.arena = workload, seeds, count, progress, arena
        self.pool = ProcessPoolExecutor(jobs) if jobs > 1 else None
        self.by_seed: dict[int, dict[str, dict[float, float]]] = {seed: {} for seed in seeds}

    def run(self, system: str, rate: float) -> float:
        """The median over the seeds of system's normalized latency at rate (simulating the seeds not yet run)."""
        args = [(self.workload, system, rate, seed, self.count, self.arena) for seed in self.seeds]
        if self.pool is None:
            values = [run_point(*a) for a in args]
        else:
            values = [f.result() for f in [self.pool.submit(run_point, *a) for a in args]]
        for seed, value in zip(self.seeds, values):
            self.by_seed[seed].setdefault(system, {})[rate] = value
        self.progress(len(values))
        return statistics.median(values)

    def close(self):
        if self.pool is not None:
            self.pool.shutdown()


def search_knee(sweep: Sweep, system: str, coarse: list[float], bound: float, refine: int, min_rate: float,
                first: float | None = None) -> None:
    """Run system at the rates that locate where its median curve crosses bound: coarse rates upward until it is
    above (halving below the lowest while it is above there), then refine bisections of the bracket."""
    below = above = None
    value = sweep.run(system, coarse[0]) if first is None else first
    if value > bound:
        above, rate = coarse[0], coarse[0] / 2
        while rate >= min_rate:
            if sweep.run(system, rate) <= bound:
                below = rate
                break
            above, rate = rate, rate / 2
    else:
        below = coarse[0]
        for rate in coarse[1:]:
            if sweep.run(system, rate) > bound:
                above = rate
                break
            below = rate
    if below is None or above is None:
        return  # above the bound at min_rate, or within it at the highest coarse rate: no bracket to refine
    for _ in range(refine):
        mid = round((below + above) / 2, 6)
        if sweep.run(system, mid) > bound:
            above = mid
        else:
            below = mid


def summarise(by_seed: dict, bound_factor: float, low: float, requests: int, seconds: float | None,
              workload: str, arena: str = "pool") -> dict:
    """The report of a sweep whose systems ran at rates of their own (the same for every seed): median curves,
    crossing rates of the median curves and per seed, paged / baseline ratios; printed side by side."""
    from figure12 import crossing_rate, ratios_to_paged

    seeds = sorted(by_seed)
    systems = list(by_seed[seeds[0]])
    curves = {s: {r: statistics.median(by_seed[seed][s][r] for seed in seeds) for r in sorted(by_seed[seeds[0]][s])}
              for s in systems}
    bound = bound_factor * curves["paged"][low]
    crossing = {s: crossing_rate(c, bound) for s, c in curves.items()}
    crossing_by_seed = {seed: {s: crossing_rate(c, bound_factor * by_seed[seed]["paged"][low])
                               for s, c in by_seed[seed].items()} for seed in seeds}
    sustained = {s: max([r for r in c if r <= crossing[s]], default=0.0) for s, c in curves.items()}
    sustained_by_seed = {seed: {s: max([r for r in c if r <= crossing_by_seed[seed][s]], default=0.0)
                                for s, c in by_seed[seed].items()} for seed in seeds}

    took = f" ({seconds:.0f} s)" if seconds else ""
    where = "the pool's blocks" if arena == "pool" else f"one range placed by a {arena} allocator"
    print(f"\n{workload}: {requests} requests per run, {NUM_BLOCKS} blocks of {BLOCK_SIZE}, Orca's reservations in "
          f"{where}, seeds {seeds}; normalized "
          f"latency in ms per output token, median over the seeds [lowest-highest]{took}")
    rates = sorted({r for c in curves.values() for r in c})
    print(f"{'rate (req/s)':>12} " + " ".join(f"{s:>23}" for s in systems))
    for rate in rates:
        cells = []
        for s in systems:
            if rate not in curves[s]:
                cells.append("-")
                continue
            runs = [by_seed[seed][s][rate] * 1e3 for seed in seeds]
            cells.append(f"{curves[s][rate] * 1e3:8.1f} [{min(runs):.1f}-{max(runs):.1f}]")
        print(f"{rate:>12g} " + " ".join(f"{c:>23}" for c in cells))
    print(f"\nthe bound: {bound_factor:g}x paged's normalized latency at {low:g} req/s (median curves: "
          f"{bound * 1e3:.2f} ms/token; each seed against its own paged run)")
    print(f"{'system':<12} {'crossing (interp.)':>19} {'per seed':>24}")
    for s in systems:
        # A curve still within the bound at its highest rate crosses somewhere above it: a lower bound.
        at_least = ">=" if max(curves[s].values()) <= bound else "  "
        print(f"{s:<12} {at_least}{crossing[s]:>11.2f} req/s "
              f"{str([round(crossing_by_seed[seed][s], 2) for seed in seeds]):>24}")
    ratios = ratios_to_paged(systems, seeds, crossing, crossing_by_seed)
    for s, ratio in ratios.items():
        if ratio["crossing_median_curves"] is not None:
            paper = f" (the paper: {PAPER_RATIOS[s][0]}-{PAPER_RATIOS[s][1]}x)" \
                if s in PAPER_RATIOS and workload == "sharegpt" else ""
            print(f"  paged / {s}: {ratio['crossing_median_curves']:.2f}x at the crossing of the median curves, "
                  f"per seed {', '.join(f'{r:.2f}x' for r in ratio['crossing_per_seed'])}{paper}")
        else:
            print(f"  paged / {s}: {s} is above the bound at every rate run")
    return {"curves_s_per_token": {s: {str(r): v for r, v in c.items()} for s, c in curves.items()},
            "curves_by_seed": {str(seed): {s: {str(r): v for r, v in c.items()} for s, c in by_seed[seed].items()}
                               for seed in seeds},
            "bound_s_per_token": bound, "bound_rate": low, "sustained_rate": sustained,
            "sustained_by_seed": {str(seed): v for seed, v in sustained_by_seed.items()},
            "crossing_rate": crossing, "crossing_by_seed": {str(seed): v for seed, v in crossing_by_seed.items()},
            "ratios": ratios, "seeds": seeds, "requests": requests, "num_blocks": NUM_BLOCKS,
            "block_size": BLOCK_SIZE, "seconds": None if seconds is None else round(seconds, 1)}


def main(argv=None) -> dict:
    from tqdm.std import tqdm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=list(WORKLOADS), default="sharegpt")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--coarse", type=float, nargs="+", default=None,
                        help="ascending rates (req/s); the first is the bound's (default: the workload's)")
    parser.add_argument("--refine", type=int, default=3, help="bisections of each system's bracket")
    parser.add_argument("--min-rate", type=float, default=None, help="lowest rate a system above the bound at the "
                        "first coarse rate is tried at (default: the first coarse rate / 32)")
    parser.add_argument("--grid", action="store_true", help="every system at every coarse rate, no search")
    parser.add_argument("--systems", nargs="+", default=None, choices=SYSTEMS,
                        help="default: all five; with an --arena, paged, orca-oracle and orca-max")
    parser.add_argument("--arena", choices=ARENAS, default="pool",
                        help="where an Orca reservation lives: the pool's blocks, or one range placed first-fit or "
                             "by a buddy allocator (the paper's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--bound", type=float, default=2.0)
    parser.add_argument("--jobs", type=int, default=1, help="simulations run at once (processes)")
    parser.add_argument("--json", type=Path, default=None,
                        help="where to save (default: benchmarks/saved/figure12_gpu.json, _alpaca for alpaca, "
                             "_buddy or _first-fit for an arena)")
    parser.add_argument("--from-json", type=Path, default=None, help="simulate nothing: summarise a saved sweep")
    args = parser.parse_args(argv)
    spec = WORKLOADS[args.workload]
    coarse = args.coarse or spec["coarse"]
    if args.systems is None:
        args.systems = list(SYSTEMS) if args.arena == "pool" else ["paged", "orca-oracle", "orca-max"]
    default_name = spec["json"] if args.arena == "pool" else spec["json"].replace(".json", f"_{args.arena}.json")
    path = args.json or ROOT / "benchmarks" / "saved" / default_name
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds must be distinct, got {args.seeds}")
    if coarse != sorted(coarse) or len(set(coarse)) != len(coarse) or coarse[0] <= 0:
        parser.error(f"--coarse must be distinct positive rates in ascending order, got {coarse}")
    if "paged" not in args.systems:
        parser.error("the bound is paged's latency: --systems must include paged")
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        by_seed = {int(seed): {s: {float(r): v for r, v in c.items()} for s, c in curves.items()}
                   for seed, curves in saved["curves_by_seed"].items()}
        low = saved.get("bound_rate") or min(float(r) for r in saved["curves_s_per_token"]["paged"])
        return _save(summarise(by_seed, args.bound, low, saved["requests"], saved.get("seconds"),
                               saved.get("workload", "sharegpt"), saved.get("arena", "pool")), path,
                     saved.get("workload", "sharegpt"), arena=saved.get("arena", "pool"))

    bar = tqdm(desc=f"{args.workload} runs", unit="run", file=sys.stdout, mininterval=1.0)
    started = time.perf_counter()
    sweep = Sweep(args.workload, args.seeds, args.requests, args.jobs, bar.update, args.arena)
    try:
        if args.grid:
            for system in args.systems:
                for rate in coarse:
                    sweep.run(system, rate)
        else:
            # The bound first (paged at the lowest coarse rate), then every system's own search; with --jobs the
            # searches run side by side, so the pool always has runs waiting.
            first = sweep.run("paged", coarse[0])
            bound = args.bound * first
            min_rate = args.min_rate or coarse[0] / 32
            with ThreadPoolExecutor(len(args.systems) if args.jobs > 1 else 1) as searches:
                for f in [searches.submit(search_knee, sweep, s, coarse, bound, args.refine, min_rate,
                                          first if s == "paged" else None) for s in args.systems]:
                    f.result()
    finally:
        sweep.close()
        bar.close()
    by_seed = {seed: {s: sweep.by_seed[seed][s] for s in args.systems} for seed in args.seeds}
    report = summarise(by_seed, args.bound, coarse[0], args.requests, time.perf_counter() - started, args.workload,
                       args.arena)
    return _save(report, path, args.workload, jobs=args.jobs, arena=args.arena)


def _save(report: dict, path: Path, workload: str, jobs: int | None = None, arena: str = "pool") -> dict:
    report.update(workload=workload, arena=arena, model=MODEL, gpu=GPU, max_model_len=MAX_MODEL_LEN,
                  paper_means=WORKLOADS[workload]["paper_means"])
    if jobs is not None:
        report["jobs"] = jobs
    if workload == "sharegpt":
        report["paper_ratios"] = PAPER_RATIOS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
