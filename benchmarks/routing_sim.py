"""Cache-aware routing at scale, simulated: five router policies over 4, 8 and 16 replicas on the Mooncake trace.

Every replica is the simulated engine (kvlab.simulation.engine: kvlab's Scheduler and KVCacheManager, step times
from the roofline step-time model) of Llama-3-8B on 2 x H100 SXM (tensor parallel 2, its pool from kv_capacity:
1,075,904 tokens; benchmarks/mooncake_serving.py's fewest-GPU deployment is 3 such replicas, and at TP 2 the
trace's p90 prompt prefills in about 0.5 s, leaving the 2 s objective room to queue, where at TP 1 it takes 1.0 s
and long prompts' prefills put p90 TTFT near 2 s at any rate), max_model_len 131,072, blocks of 16, "builtin"
block hashing as the other Mooncake simulations.
The replicas share one virtual clock behind a router (kvlab.simulation.routing.simulate_routing) that places each
request at its arrival with a policy of kvlab.router.policies, the live router's: round-robin, least-loaded,
approx-prefix (the router's own history of prompts), precise-prefix (an index fed by the replicas' KV-cache
events) and kv-cost (Dynamo's cost, overlap_score_weight 1, over the same index).

Three tables:

1. Per policy and replica count N: the Mooncake conversation trace's first --requests requests (600 by default:
   201 s of the trace, 2.98 requests/s, mean prompt 13,822 tokens; an unbounded cache would serve 17.2% of their
   prompt tokens) with arrivals compressed by --per-replica-scale x N (0.3 x N: the load per replica stays the
   same as N grows, near round-robin's knee). Prefix hit rate, TTFT p50 / p90 / p99, TPOT p90, prefill imbalance
   (max / mean over replicas of the prompt tokens each computed), request imbalance, SLO attainment (the share of
   requests with TTFT <= 2 s and TPOT <= 100 ms).
2. Per policy and N, the highest rate scale of the same slice at which the deployment meets p90 TTFT <= 2 s and
   p90 TPOT <= 100 ms (benchmarks/mooncake_serving.py's objective), by planning.max_rate_under_slo's bisection
   over rate scales per replica in [--search-low, --search-high] to --search-tolerance.
3. The hot prefix (kvlab.simulation.routing.hot_prefix_requests): --hot-requests requests at --hot-rate per second
   on --hot-replicas replicas of --hot-tp GPUs (1: one H100 each, max_model_len 8,192), 80% of them a 6,144-token
   shared prefix plus 128 fresh tokens, the rest 1,024 fresh tokens, 512 output tokens each, the prefix cached on
   one replica before the stream starts. Each policy once, and kv-cost at each of --weights, to show where
   affinity starts to pile the hot requests on one replica.

The figures are a simulation's: as good as the step-time model (benchmarks/README.md, the step-time section).
Saved to --json so the README and the chapter read them without simulating.

    OMP_NUM_THREADS=1 python benchmarks/routing_sim.py [--tp 2] [--replicas 4 8 16] [--requests 600] [--jobs 2]
        [--per-replica-scale 0.3] [--search-low 0.1] [--search-high 1.2] [--search-tolerance 0.075]
        [--hot-replicas 4] [--hot-tp 1] [--hot-requests 600] [--hot-rate 40] [--weights 0 1 4 16 64 256 1024]
        [--json benchmarks/saved/routing_sim.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

POLICIES = ("round-robin", "least-loaded", "approx-prefix", "precise-prefix", "kv-cost")
MAX_MODEL_LEN = 131072
TTFT_SLO, TPOT_SLO = 2.0, 0.1
_TRACE: dict = {}


def _slice(requests: int):
    """The trace's first `requests` requests as SimRequests at their own rate (built once per process)."""
    from kvlab.simulation.routing import mooncake_requests

    if requests not in _TRACE:
        _TRACE[requests] = mooncake_requests(requests, max_model_len=MAX_MODEL_LEN)
    return _TRACE[requests]


def run_job(job: dict) -> dict:
    """One task of a process pool: a grid cell, a rate search or a hot-prefix run; its figures."""
    from kvlab.simulation.routing import (
        hot_prefix_requests,
        max_rate_scale_under_slo,
        rescale_arrivals,
        simulate_routing,
    )

    started = time.perf_counter()
    knobs = dict(gpu=job["gpu"], tensor_parallel_size=job["tp"])
    if job["kind"] == "grid":
        requests = rescale_arrivals(_slice(job["requests"]), job["scale"])
        result = simulate_routing(requests, job["policy"], job["replicas"], max_model_len=MAX_MODEL_LEN, **knobs)
        out = result.summary(TTFT_SLO, TPOT_SLO)
        out.update(scale=job["scale"], preemptions=result.num_preemptions)
    elif job["kind"] == "search":
        n = job["replicas"]
        search = max_rate_scale_under_slo(_slice(job["requests"]), job["policy"], n, job["low"] * n,
                                          job["high"] * n, job["tolerance"] * n, TTFT_SLO, TPOT_SLO,
                                          max_model_len=MAX_MODEL_LEN, **knobs)
        out = dict(policy=job["policy"], replicas=n, rate_scale=search.rate_scale,
                   runs={f"{k:.4g}": v for k, v in sorted(search.runs.items())})
    else:
        requests = hot_prefix_requests(job["requests"], job["rate"])
        result = simulate_routing(requests, job["policy"], job["replicas"], overlap_score_weight=job["weight"],
                                  **knobs)
        out = result.summary(TTFT_SLO, TPOT_SLO)
        out.update(weight=job["weight"], busiest_share=max(result.requests_per_replica) / len(requests))
    out.update(kind=job["kind"], job_wall_s=round(time.perf_counter() - started, 1))
    return out


def main(argv=None) -> dict:
    from multiprocessing import get_context

    from kvlab.analysis.mooncake import infinite_cache_hits, load_mooncake_trace

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="H100-SXM")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--replicas", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--requests", type=int, default=600, help="the trace's first N requests")
    parser.add_argument("--per-replica-scale", type=float, default=0.3,
                        help="table 1's arrival-rate scale per replica (x N replicas)")
    parser.add_argument("--search-low", type=float, default=0.1, help="rate scale per replica the search starts at")
    parser.add_argument("--search-high", type=float, default=1.2)
    parser.add_argument("--search-tolerance", type=float, default=0.075)
    parser.add_argument("--hot-replicas", type=int, default=4)
    parser.add_argument("--hot-tp", type=int, default=1)
    parser.add_argument("--hot-requests", type=int, default=600)
    parser.add_argument("--hot-rate", type=float, default=40.0, help="requests per second of the hot-prefix workload")
    parser.add_argument("--weights", type=float, nargs="+", default=[0, 1, 4, 16, 64, 256, 1024])
    parser.add_argument("--no-search", action="store_true", help="skip table 2 (the slowest)")
    parser.add_argument("--jobs", type=int, default=2, help="processes running tasks side by side")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "saved" / "routing_sim.json")
    args = parser.parse_args(argv)
    for name in ("requests", "hot_requests", "hot_replicas", "jobs", "tp", "hot_tp"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.replicas):
        parser.error(f"--replicas must be positive counts, got {args.replicas}")
    if not 0 < args.search_low < args.search_high or args.search_tolerance <= 0:
        parser.error("need 0 < --search-low < --search-high and --search-tolerance > 0")

    started = time.perf_counter()
    trace = load_mooncake_trace("conversation", limit=args.requests)
    span = trace[-1].arrival_s - trace[0].arrival_s
    native = len(trace) / span
    ceiling = infinite_cache_hits(trace).hit_rate
    print(f"Mooncake conversation trace, first {len(trace)} requests over {span:.0f} s ({native:.2f} req/s), mean "
          f"prompt {sum(r.input_length for r in trace) / len(trace):,.0f} tokens; one unbounded cache would serve "
          f"{100 * ceiling:.1f}% of prompt tokens. Llama-3-8B on {args.tp} x {args.gpu} per replica; SLO TTFT <= "
          f"{TTFT_SLO} s and TPOT <= {TPOT_SLO * 1e3:g} ms")
    common = dict(gpu=args.gpu, tp=args.tp)
    jobs = [dict(common, kind="grid", policy=p, replicas=n, requests=args.requests, scale=args.per_replica_scale * n)
            for n in args.replicas for p in POLICIES]
    if not args.no_search:
        jobs += [dict(common, kind="search", policy=p, replicas=n, requests=args.requests, low=args.search_low,
                      high=args.search_high, tolerance=args.search_tolerance)
                 for n in args.replicas for p in POLICIES]
    hot_common = dict(common, tp=args.hot_tp, kind="hot", replicas=args.hot_replicas, requests=args.hot_requests,
                      rate=args.hot_rate)
    jobs += [dict(hot_common, policy=p, weight=1.0) for p in POLICIES if p != "kv-cost"]
    jobs += [dict(hot_common, policy="kv-cost", weight=w) for w in args.weights]
    # The searches are the longest tasks: start them first so that the pool's two processes end together.
    jobs.sort(key=lambda j: j["kind"] != "search")
    pool = get_context("spawn").Pool(args.jobs) if args.jobs > 1 else None
    try:
        results = list(pool.imap(run_job, jobs) if pool is not None else map(run_job, jobs))
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    seconds = time.perf_counter() - started
    grid = [r for r in results if r["kind"] == "grid"]
    searches = [r for r in results if r["kind"] == "search"]
    hot = [r for r in results if r["kind"] == "hot"]
    grid.sort(key=lambda r: (r["replicas"], POLICIES.index(r["policy"])))
    searches.sort(key=lambda r: (r["replicas"], POLICIES.index(r["policy"])))

    print(f"\n1. per policy and N, arrivals x {args.per_replica_scale:g} N "
          f"({args.per_replica_scale * native:.2f} req/s per replica)")
    print(f"{'N':>3} {'policy':>15} {'hit':>6} {'TTFT p50/p90/p99 s':>20} {'TPOT p90':>9} {'imbal':>6} "
          f"{'req imb':>7} {'SLO':>6} {'busiest':>8}")
    for r in grid:
        print(f"{r['replicas']:>3} {r['policy']:>15} {100 * r['hit_rate']:>5.1f}% "
              f"{r['ttft_p50']:>6.2f}/{r['ttft_p90']:>5.2f}/{r['ttft_p99']:>5.2f} {r['tpot_p90'] * 1e3:>7.1f}ms "
              f"{r['imbalance']:>6.2f} {r['request_imbalance']:>7.2f} {100 * r['slo_attainment']:>5.1f}% "
              f"{max(r['requests_per_replica']):>8}")
    if searches:
        print("\n2. the highest rate scale meeting p90 TTFT <= 2 s and p90 TPOT <= 100 ms (req/s in brackets)")
        print(f"{'N':>3} " + " ".join(f"{p:>18}" for p in POLICIES))
        for n in args.replicas:
            cells = []
            for p in POLICIES:
                s = next(r for r in searches if r["replicas"] == n and r["policy"] == p)["rate_scale"]
                cells.append(f"{'none' if s is None else f'{s:.3f} ({s * native:.2f})':>18}")
            print(f"{n:>3} " + " ".join(cells))
    print(f"\n3. hot prefix: {args.hot_requests} requests at {args.hot_rate:g}/s on {args.hot_replicas} replicas of "
          f"{args.hot_tp} x {args.gpu}")
    print(f"{'policy':>15} {'weight':>7} {'busiest':>8} {'hit':>6} {'TTFT p50/p90/p99 s':>20} {'TPOT p90':>9} "
          f"{'SLO':>6}")
    for r in hot:
        w = f"{r['weight']:g}" if r["policy"] == "kv-cost" else "-"
        print(f"{r['policy']:>15} {w:>7} {100 * r['busiest_share']:>7.1f}% {100 * r['hit_rate']:>5.1f}% "
              f"{r['ttft_p50']:>6.2f}/{r['ttft_p90']:>5.2f}/{r['ttft_p99']:>5.2f} {r['tpot_p90'] * 1e3:>7.1f}ms "
              f"{100 * r['slo_attainment']:>5.1f}%")
    print(f"\n{seconds:.0f} s in all with {args.jobs} process(es)")
    report = dict(model="llama-3-8b", gpu=args.gpu, tp=args.tp, requests=len(trace), span_s=span,
                  native_rate=native, unbounded_hit_rate=ceiling, ttft_slo_s=TTFT_SLO, tpot_slo_s=TPOT_SLO,
                  per_replica_scale=args.per_replica_scale, grid=grid, searches=searches, hot=hot,
                  hot_workload=dict(replicas=args.hot_replicas, tp=args.hot_tp, requests=args.hot_requests,
                                    rate=args.hot_rate),
                  jobs=args.jobs, seconds=round(seconds, 1))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
