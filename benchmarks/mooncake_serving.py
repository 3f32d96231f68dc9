"""The Mooncake conversation hour served by the simulated engine: latency percentiles, and the GPUs an SLO needs.

The conversation trace (kvlab.analysis.mooncake; 12,031 requests over 3,537 s) is replayed at its own arrival
times, prompts synthesized from its 512-token hash ids (equal ids, equal tokens, so the prefix cache finds what
the trace shares), through kvlab's own scheduler and KV cache manager on a simulated deployment
(kvlab.simulation.simulate: step times from the roofline step-time model, the KV pool from kv_capacity).

A deployment is `replicas` x `tensor_parallel_size` GPUs behind a plain round-robin balancer: request i goes to
replica i mod replicas (kvlab.simulation.planning.round_robin), and every replica is its own engine, its own
simulate call (--jobs runs them in that many processes). Round-robin looks at no prompt, so it scatters requests
that share a prefix over the replicas, each with its own prefix cache; cache-aware routing would keep them
together. The hit rate is measured per deployment, beside the most an unbounded cache per replica could serve
(kvlab.analysis.mooncake.infinite_cache_hits of each replica's share), so the loss is visible.

Reported per deployment, over the union of the replicas' requests: TTFT, TPOT, ITL and end-to-end latency at
p50 / p90 / p99 (RequestTiming.metrics(), the live server's definitions), the prefix-cache hit rate, preemptions,
steps and each replica's KV pool (blocks, tokens). For each --tp degree, the fewest replicas that meet the SLO
(default p90 TTFT <= 2 s and p90 TPOT <= 100 ms: the p90 prompt, 27,367 tokens, takes 1.0 s to prefill alone on
one H100 in the step-time model, and 100 ms per token is faster than anyone reads) are searched upward
(planning.fewest_replicas) from a lower bound (planning.replicas_lower_bound): the fewest replicas whose busiest
replica could do its share's work within the trace's span at the least each piece of work can cost on the
step-time model (planning.work_floor: every prompt token an unbounded prefix cache of that replica would not serve,
its causal attention pairs, and every decode's read of its context), whatever the batches. A replica busy longer
than the span falls behind for good on this steady trace (2.8-3.7 requests/s in every 5-minute window), so fewer
replicas fail any TTFT objective. A degree whose pool cannot hold the trace's
longest request (prompt + output) is reported infeasible, with the reason.

This is a simulation: its latencies are as good as the step-time model (benchmarks/README.md, the step-time
section). Everything is saved to --json, so the chapter and the README read it without simulating.

    OMP_NUM_THREADS=1 python benchmarks/mooncake_serving.py [--model llama-3-8b] [--gpu H100-SXM]
        [--tp 1 2 4 8] [--requests N] [--ttft-slo 2.0] [--tpot-slo 0.1] [--max-replicas 32] [--jobs 2]
        [--json benchmarks/saved/mooncake_serving.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

MAX_MODEL_LEN = 131072  # the trace's longest request is 126,195 prompt + its output tokens (Llama-3.1's context)
QUANTILES = (0.5, 0.9, 0.99)


def replica_requests(trace, replicas: int, index: int, vocab_size: int):
    """Replica `index`'s share of the trace under round-robin, as SimRequests streamed one at a time (prompts from
    kvlab.analysis.mooncake.PromptSynthesizer: equal hash-id prefixes give equal tokens)."""
    from kvlab.analysis.mooncake import PromptSynthesizer
    from kvlab.simulation.engine import SimRequest
    from kvlab.simulation.planning import round_robin

    synth = PromptSynthesizer(vocab_size)
    return (SimRequest(r.arrival_s, synth.prompt_token_ids(r).tolist(), r.output_length)
            for r in round_robin(trace, replicas)[index])


def run_replica(job: dict):
    """One replica's share through simulate (a process pool's task): the SimulationResult."""
    from kvlab.analysis.mooncake import load_mooncake_trace
    from kvlab.simulation.engine import model_config, simulate

    trace = load_mooncake_trace("conversation", limit=job["requests"])
    vocab = int(model_config(job["model"])["vocab_size"])
    return simulate(replica_requests(trace, job["replicas"], job["index"], vocab), job["model"], job["gpu"],
                    tensor_parallel_size=job["tp"], max_model_len=job["max_model_len"],
                    num_blocks=job["num_blocks"])


def serve(trace, args, tp: int, replicas: int, num_blocks: int, pool, bar) -> dict:
    """Serve the trace on replicas x tp GPUs; the deployment's figures (the union of its replicas' requests)."""
    from kvlab.analysis.mooncake import infinite_cache_hits
    from kvlab.simulation.planning import latency_percentiles, round_robin, slo_figures

    jobs = [dict(model=args.model, gpu=args.gpu, tp=tp, max_model_len=args.max_model_len, num_blocks=num_blocks,
                 requests=args.requests, replicas=replicas, index=i) for i in range(replicas)]
    started = time.perf_counter()
    results = []
    for result in (pool.imap(run_replica, jobs) if pool is not None else map(run_replica, jobs)):
        results.append(result)
        bar.update(1)
    wall = time.perf_counter() - started
    timings = [t for r in results for t in r.timings]
    ttft, tpot = slo_figures(timings, args.quantile)
    # Hits over every prompt token (SimulationResult counts each prompt once, whole, and leaves out the hits of a
    # request re-admitted after a preemption, which finds its own blocks again).
    prompt = sum(r.num_prompt_tokens for r in results)
    ceiling = sum(infinite_cache_hits(share).hit_tokens for share in round_robin(trace, replicas))
    return dict(
        tp=tp, replicas=replicas, num_gpus=tp * replicas, feasible=True,
        met=bool(ttft <= args.ttft_slo and tpot <= args.tpot_slo),
        slo_ttft_s=ttft, slo_tpot_s=tpot,
        latency_s=latency_percentiles(timings, QUANTILES),
        prefix_hit_rate=sum(r.num_cached_prompt_tokens for r in results) / prompt if prompt else 0.0,
        unbounded_hit_rate=ceiling / sum(r.input_length for r in trace),
        preemptions=sum(r.num_preemptions for r in results), steps=sum(r.num_steps for r in results),
        steps_per_replica_max=max(r.num_steps for r in results),
        peak_used_blocks_max=max(r.peak_used_blocks for r in results),
        simulated_s=max(r.simulated_s for r in results), wall_s=round(wall, 1))


def lower_bound(trace, args, spec, tp: int):
    """(the fewest replicas whose busiest replica's least busy time fits in the trace's span, or None up to
    --max-replicas; the WorkFloor it used)."""
    from kvlab.analysis.mooncake import infinite_cache_hit_tokens
    from kvlab.simulation.planning import replicas_lower_bound, round_robin, work_floor

    floor = work_floor(spec, args.gpu, tp, args.max_num_batched_tokens)
    span = trace[-1].arrival_s - trace[0].arrival_s

    def busy_seconds(k: int) -> float:
        return max(sum(floor.request_seconds(r.input_length, r.output_length, h)
                       for r, h in zip(share, infinite_cache_hit_tokens(share))) for share in round_robin(trace, k))

    return (replicas_lower_bound(busy_seconds, span, args.max_replicas) if span > 0 else 1), floor


def main(argv=None) -> dict:
    from multiprocessing import get_context

    from tqdm.std import tqdm

    from kvlab.analysis.mooncake import infinite_cache_hits, load_mooncake_trace
    from kvlab.simulation import kv_capacity
    from kvlab.simulation.engine import model_config, resolve_model
    from kvlab.simulation.planning import fewest_replicas

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--gpu", default="H100-SXM")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--requests", type=int, default=None, help="the trace's first N requests (default: all)")
    parser.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT objective at --quantile, seconds")
    parser.add_argument("--tpot-slo", type=float, default=0.1, help="TPOT objective at --quantile, seconds")
    parser.add_argument("--quantile", type=float, default=0.9)
    parser.add_argument("--max-replicas", type=int, default=32)
    parser.add_argument("--jobs", type=int, default=1, help="processes that run replicas side by side")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "saved" / "mooncake_serving.json")
    args = parser.parse_args(argv)
    if args.requests is not None and args.requests < 1:
        parser.error(f"--requests must be a positive number of requests, got {args.requests}")
    if args.jobs < 1 or args.max_replicas < 1:
        parser.error("--jobs and --max-replicas must be at least 1")

    started = time.perf_counter()
    trace = load_mooncake_trace("conversation", limit=args.requests)
    config = model_config(args.model)
    spec = resolve_model(config)
    longest = max(r.input_length + r.output_length for r in trace)
    span = trace[-1].arrival_s - trace[0].arrival_s
    one_cache = infinite_cache_hits(trace).hit_rate
    print(f"the Mooncake conversation trace, {len(trace)} requests over {span:.0f} s "
          f"({len(trace) / max(span, 1e-9):.2f} req/s), longest request {longest:,} tokens; {args.model} on "
          f"{args.gpu}, max_model_len {args.max_model_len:,}; SLO p{100 * args.quantile:g} TTFT <= {args.ttft_slo} s "
          f"and p{100 * args.quantile:g} TPOT <= {args.tpot_slo * 1e3:g} ms over all requests")
    print(f"round-robin balancing: shared prefixes are scattered over the replicas (cache-aware routing would keep "
          f"them together); one unbounded cache for the whole trace would serve {100 * one_cache:.1f}% of prompt "
          f"tokens")

    deployments: list[dict] = []
    per_tp: dict[str, dict] = {}
    pool = get_context("spawn").Pool(args.jobs) if args.jobs > 1 else None
    try:
        for tp in args.tp:
            try:
                budget = kv_capacity(config, args.gpu, tp, max_model_len=args.max_model_len,
                                     max_num_batched_tokens=args.max_num_batched_tokens)
            except ValueError as e:  # the heads do not split over tp
                per_tp[str(tp)] = dict(feasible=False, reason=str(e), replicas=None, num_gpus=None)
                print(f"TP {tp}: infeasible: {e}")
                continue
            pool_tokens = budget.num_blocks * budget.block_size
            entry = dict(num_blocks=budget.num_blocks, kv_tokens=pool_tokens)
            if pool_tokens < longest:
                reason = (f"the KV pool of {budget.num_blocks:,} blocks ({pool_tokens:,} tokens) cannot hold the "
                          f"longest request ({longest:,} tokens)")
                per_tp[str(tp)] = dict(entry, feasible=False, reason=reason, replicas=None, num_gpus=None)
                print(f"TP {tp}: infeasible: {reason}")
                continue
            low, floor = lower_bound(trace, args, spec, tp)
            entry.update(work_floor=dict(token_s=floor.token_s, prefill_pair_s=floor.prefill_pair_s,
                                         decode_context_s=floor.decode_context_s), lower_bound=low)
            if low is None:
                reason = f"even {args.max_replicas} replicas would be busy longer than the trace's span"
                per_tp[str(tp)] = dict(entry, feasible=False, reason=reason, replicas=None, num_gpus=None)
                print(f"TP {tp}: {reason}")
                continue
            print(f"TP {tp}: {budget.num_blocks:,} blocks ({pool_tokens:,} tokens) per replica; lower bound "
                  f"{low} replica(s) (a token position costs at least {floor.token_s * 1e6:.1f} us)")

            def meets(replicas: int, tp=tp, budget=budget) -> bool:
                bar = tqdm(total=replicas, desc=f"TP {tp} x {replicas} replicas", unit="replica", file=sys.stdout,
                           mininterval=1.0)
                d = serve(trace, args, tp, replicas, budget.num_blocks, pool, bar)
                bar.close()
                d.update(num_blocks=budget.num_blocks, kv_tokens=budget.num_blocks * budget.block_size)
                deployments.append(d)
                lat = d["latency_s"]
                print(f"  {replicas} x TP {tp}: p90 TTFT {lat['ttft']['p90']:.3f} s, p90 TPOT "
                      f"{lat['tpot']['p90'] * 1e3:.1f} ms, hit rate {100 * d['prefix_hit_rate']:.1f}% (unbounded "
                      f"{100 * d['unbounded_hit_rate']:.1f}%), {d['preemptions']} preemptions, "
                      f"{'meets' if d['met'] else 'fails'} ({d['wall_s']:.0f} s)")
                return d["met"]

            search = fewest_replicas(meets, low, max(low, args.max_replicas))
            per_tp[str(tp)] = dict(entry, feasible=True, replicas=search.replicas,
                                   num_gpus=None if search.replicas is None else search.replicas * tp,
                                   tried={str(k): v for k, v in search.tried.items()})
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    seconds = time.perf_counter() - started

    found = [(v["num_gpus"], int(tp)) for tp, v in per_tp.items() if v.get("num_gpus")]
    best = None
    if found:
        gpus, tp = min(found)
        best = dict(num_gpus=gpus, tensor_parallel_size=tp, replicas=gpus // tp)
    print(f"\n{'TP':>3} {'repl':>5} {'GPUs':>5} {'TTFT p50/p90/p99 s':>22} {'TPOT p50/p90/p99 ms':>22} "
          f"{'ITL p50/p90/p99 ms':>22} {'E2E p50/p90/p99 s':>22} {'hit':>6} {'ceil':>6} {'preempt':>8} {'met':>5}")
    for d in deployments:
        lat = d["latency_s"]

        def three(name, scale=1.0, fmt=".2f", lat=lat):
            return "/".join(f"{lat[name][q] * scale:{fmt}}" for q in ("p50", "p90", "p99"))

        print(f"{d['tp']:>3} {d['replicas']:>5} {d['num_gpus']:>5} {three('ttft'):>22} {three('tpot', 1e3, '.1f'):>22} "
              f"{three('itl', 1e3, '.1f'):>22} {three('e2e', 1.0, '.1f'):>22} {100 * d['prefix_hit_rate']:>5.1f}% "
              f"{100 * d['unbounded_hit_rate']:>5.1f}% {d['preemptions']:>8} {'yes' if d['met'] else 'no':>5}")
    for tp, v in per_tp.items():
        shown = v.get("reason") if not v["feasible"] else (
            f"{v['replicas']} replicas = {v['num_gpus']} GPUs" if v["replicas"] else
            f"none up to {args.max_replicas} replicas")
        print(f"TP {tp}: {shown}")
    print("fewest GPUs: " + ("none found" if best is None else
          f"{best['num_gpus']} = {best['replicas']} replicas x TP {best['tensor_parallel_size']}") +
          f"; {seconds:.0f} s in all")

    report = dict(model=args.model, gpu=args.gpu, trace="mooncake conversation", requests=len(trace),
                  span_s=span, longest_request_tokens=longest, max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.max_num_batched_tokens, quantile=args.quantile,
                  ttft_slo_s=args.ttft_slo, tpot_slo_s=args.tpot_slo, routing="round-robin",
                  unbounded_hit_rate_one_cache=one_cache, per_tp=per_tp, deployments=deployments, fewest=best,
                  jobs=args.jobs, seconds=round(seconds, 1))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
