"""The paper's Figure 12 at the paper's scale, simulated: OPT-13B on one A100-40GB, kvlab's scheduler on a GPU clock.

Kwon et al. (SOSP 2023, Fig. 12a) serve ShareGPT requests (means 161 input / 338 output tokens) arriving as a
Poisson process to OPT-13B on one A100-40GB, max_model_len 2048, blocks of 16, and plot the normalized latency
(mean end-to-end latency / output length) against the request rate for vLLM, Orca (Max, Pow2, Oracle) and
FasterTransformer. Here every system is kvlab's own scheduler and KV cache manager in kvlab.simulation.engine
(paging, the three reservation rules, static batching as kvlab's baseline runs it), on a clock of the step-time
model for OPT-13B on an A100-40GB (4 ms per-step cost), with the pool kv_capacity gives (989 blocks of 16):
no constant is tuned to the paper's result. Requests: --requests per run, lengths drawn (seeded, with
replacement) from the shipped ShareGPT-like chat trace (means 152 / 310 tokens), Poisson arrivals, one run per
seed, rate and system. Reported as benchmarks/figure12.py reports the CPU's figure (its `summarise`): the
curves per seed, the highest rate within --bound x paging's normalized latency at the lowest rate, the
interpolated crossing rate, and the paged / baseline ratios next to the paper's 1.7-2.7x (Oracle) and 2.7-8x
(Max)::

    OMP_NUM_THREADS=1 python benchmarks/figure12_gpu.py [--requests 1000] [--rates 0.5 1 1.5 2 2.5 3]
        [--seeds 0 1 2] [--bound 2] [--json benchmarks/saved/figure12_gpu.json]
    python benchmarks/figure12_gpu.py --from-json a.json b.json   (the seeds of separate sweeps, summarised together)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab
sys.path.insert(0, str(ROOT / "benchmarks"))

SYSTEMS = ("paged", "orca-oracle", "orca-pow2", "orca-max", "static")
MODEL, GPU, MAX_MODEL_LEN = "opt-13b", "A100-40GB", 2048


def main(argv=None) -> dict:
    from figure12 import summarise
    from sim_engine import figure12_requests
    from tqdm.std import tqdm

    from kvlab.benchmarks.latency import normalized_latency
    from kvlab.simulation.engine import simulate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 1.5, 2, 2.5, 3])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--bound", type=float, default=2.0)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "saved" / "figure12_gpu.json")
    parser.add_argument("--from-json", type=Path, nargs="+", default=None,
                        help="simulate nothing: summarise the seeds of saved sweeps (of distinct seeds) together")
    args = parser.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds must be distinct, got {args.seeds}")
    if args.from_json:
        by_seed, seconds, requests = {}, 0.0, None
        for path in args.from_json:
            saved = json.loads(path.read_text())
            requests = saved["requests"]
            seconds += saved.get("seconds") or 0.0
            for seed, curves in saved["curves_by_seed"].items():
                if int(seed) in by_seed:
                    parser.error(f"seed {seed} appears in more than one of {args.from_json}")
                by_seed[int(seed)] = {s: {float(r): v for r, v in c.items()} for s, c in curves.items()}
        return _save(summarise(by_seed, args.bound, requests, 989, seconds), args.json)

    by_seed = {seed: {s: {} for s in args.systems} for seed in args.seeds}
    bar = tqdm(total=len(args.seeds) * len(args.rates) * len(args.systems), desc="seed x rate x system", unit="run",
               file=sys.stdout, mininterval=1.0)
    started = time.perf_counter()
    for seed in args.seeds:
        for rate in args.rates:
            requests = figure12_requests(args.requests, rate, seed)
            for system in args.systems:
                result = simulate(requests, MODEL, GPU, system=system, max_model_len=MAX_MODEL_LEN)
                by_seed[seed][system][rate] = normalized_latency(result.timings)
                bar.update(1)
    bar.close()
    return _save(summarise(by_seed, args.bound, args.requests, 989, time.perf_counter() - started), args.json)


def _save(report: dict, path: Path) -> dict:
    report.update(model=MODEL, gpu=GPU, max_model_len=MAX_MODEL_LEN,
                  paper_ratios={"orca-oracle": [1.7, 2.7], "orca-max": [2.7, 8.0]})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
