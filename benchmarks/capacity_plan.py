"""How many GPUs a workload needs under an SLO, on the simulated engine: Chapter 10's saved capacity plan.

For each tensor-parallel degree, kvlab's own scheduler on a simulated deployment (kvlab.simulation.simulate:
the model's step times from the roofline step-time model, the pool from kv_capacity) serves --requests
requests with lengths from the ShareGPT-like chat trace arriving as a Poisson process; the highest rate whose
p90 TTFT and p90 TPOT meet the SLO is found by bisection (kvlab.simulation.planning.max_rate_under_slo), and
gpus_needed turns the rates per replica into the fewest GPUs for each --targets rate. Every simulated point is
saved too (rate, p90 TTFT, p90 TPOT, steps, preemptions), so the chapter plots the curves without simulating.

    OMP_NUM_THREADS=1 python benchmarks/capacity_plan.py [--model llama-3-8b] [--gpu L4] [--tp 1 2 4]
        [--requests 1000] [--ttft-slo 1.0] [--tpot-slo 0.05] [--low 0.25] [--high 32] [--tolerance 0.25]
        [--targets 5 20 50] [--json benchmarks/saved/capacity_plan.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab


def main(argv=None) -> dict:
    from tqdm.std import tqdm

    from kvlab.simulation import kv_capacity
    from kvlab.simulation.engine import model_config, simulate
    from kvlab.simulation.planning import chat_requests, gpus_needed, max_rate_under_slo, slo_figures

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--gpu", default="L4")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--ttft-slo", type=float, default=1.0, help="p90 TTFT objective, seconds")
    parser.add_argument("--tpot-slo", type=float, default=0.05, help="p90 TPOT objective, seconds")
    parser.add_argument("--low", type=float, default=0.25)
    parser.add_argument("--high", type=float, default=32.0)
    parser.add_argument("--tolerance", type=float, default=0.25)
    parser.add_argument("--targets", type=float, nargs="+", default=[5.0, 20.0, 50.0])
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "saved" / "capacity_plan.json")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    points: dict[int, list[dict]] = {}
    capacity: dict[int, float | None] = {}
    blocks: dict[int, int] = {}
    for tp in args.tp:
        blocks[tp] = kv_capacity(model_config(args.model), args.gpu, tp, max_model_len=args.max_model_len).num_blocks
        points[tp] = []
        bar = tqdm(desc=f"TP {tp}: bisection", unit="run", file=sys.stdout, mininterval=1.0)

        def figures(rate, tp=tp, bar=bar):
            result = simulate(chat_requests(args.requests, rate, args.seed), args.model, args.gpu,
                              tensor_parallel_size=tp, max_model_len=args.max_model_len)
            ttft, tpot = slo_figures(result.timings, 0.9)
            points[tp].append(dict(rate=rate, ttft_p90_s=ttft, tpot_p90_s=tpot, steps=result.num_steps,
                                   preemptions=result.num_preemptions))
            bar.update(1)
            return ttft, tpot

        capacity[tp] = max_rate_under_slo(figures, args.ttft_slo, args.tpot_slo, args.low, args.high, args.tolerance)
        bar.close()
    seconds = time.perf_counter() - started

    plans = {}
    for target in args.targets:
        plan = gpus_needed(target, capacity)
        plans[str(target)] = None if plan is None else dict(num_gpus=plan.num_gpus, tensor_parallel_size=
                                                            plan.tensor_parallel_size, replicas=plan.replicas)
    print(f"{args.model} on {args.gpu}, {args.requests} chat-trace requests (seed {args.seed}), SLO p90 TTFT <= "
          f"{args.ttft_slo} s and p90 TPOT <= {args.tpot_slo * 1e3:g} ms; bisection over [{args.low}, {args.high}] "
          f"to {args.tolerance} req/s; {seconds:.0f} s")
    print(f"{'TP':>3} {'KV blocks':>10} {'runs':>5} {'rate per replica':>17} {'per GPU':>8}")
    for tp in args.tp:
        rate = capacity[tp]
        shown = "none" if rate is None else f"{rate:.2f} req/s"
        per_gpu = "" if rate is None else f"{rate / tp:.2f}"
        print(f"{tp:>3} {blocks[tp]:>10,} {len(points[tp]):>5} {shown:>17} {per_gpu:>8}")
    for target, plan in plans.items():
        print(f"target {target} req/s: " + ("no degree holds the SLO" if plan is None else
              f"{plan['num_gpus']} GPUs = {plan['replicas']} replicas x TP {plan['tensor_parallel_size']}"))
    report = dict(model=args.model, gpu=args.gpu, requests=args.requests, seed=args.seed,
                  max_model_len=args.max_model_len, ttft_slo_s=args.ttft_slo, tpot_slo_s=args.tpot_slo,
                  quantile=0.9, low=args.low, high=args.high, tolerance=args.tolerance,
                  num_blocks={str(tp): n for tp, n in blocks.items()},
                  rate_per_replica={str(tp): r for tp, r in capacity.items()},
                  points={str(tp): p for tp, p in points.items()}, plans=plans, seconds=round(seconds, 1))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
