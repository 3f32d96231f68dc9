"""Routing policies on live replicas: the same multi-turn chat workload through `kvlab router` in front of three
`kvlab serve` replicas, once per policy, each with caches that start empty.

    OMP_NUM_THREADS=1 python benchmarks/routing_live.py                  # every policy, 1 run each, plus 1 replica
    python benchmarks/routing_live.py --runs 3 --policies round-robin kv-cost --json routing_live.json
    python benchmarks/routing_live.py --baseline-only                    # one replica, no router

The workload (kvlab.benchmarks.routing_workload): --conversations conversations of --turns turns on
--system-prompts system prompts, --hot-share of the conversations on the hot one; each turn resends the whole
conversation through the chat template, so a replica that served the previous turn holds its prefix. They start
as a Poisson process at --rate conversations per second; each waits --think-time-s after an answer before its next
turn, so other conversations' blocks go through the pool meanwhile.

Each replica gets --num-blocks KV blocks: too few to hold every conversation's history, so a policy that sends a
conversation back where it was served keeps its prefix cached, and one that scatters it recomputes it. The row
"1 replica" serves the same workload from one replica with the same pool, without the router. A fresh ReplicaSet
per policy and run makes every cache start empty (kvlab serve has no endpoint to reset one).

Printed per policy (the median over --runs): the prefix-cache hit rate (hits / lookups over all replicas), prefill
tokens computed (prompt tokens - hits), TTFT p50/p90/p99 and end-to-end p50/p90 on the client's clock, and each
run's requests per replica (from the replicas' /metrics, checked against the router's own count and the replica
each answer names). Greedy answers must not depend on where a request ran: every policy's answers are compared
with the first row's and the command says whether they are equal (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

BASELINE = "1 replica"


@contextlib.contextmanager
def single_replica(serve_args: list[str], hash_seed: str):
    """One `kvlab serve` on a free loopback port; yields its URL and stops it on exit."""
    from kvlab.entrypoints.launch import CLI, ProcessGroup, free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with ProcessGroup(env={"PYTHONHASHSEED": hash_seed}, prefix="kvlab-routing-live-") as group:
        group.start("replica", [*CLI, "serve", "default", "--port", str(port), "--served-model-name", "default",
                                *serve_args])
        group.wait_healthy({"replica": url}, 180)
        yield url


def routed_counts(stats_before: dict, stats_after: dict) -> dict[str, int]:
    """Requests the router sent to each replica (by URL) over the run, from its /router/stats before and after."""
    before = {r["url"].rstrip("/"): r["routed"] for r in stats_before["replicas"]}
    return {r["url"].rstrip("/"): r["routed"] - before.get(r["url"].rstrip("/"), 0) for r in stats_after["replicas"]}


def run_one(policy: str, workload, args):
    """One run of the workload on fresh replicas (or one replica for BASELINE): its RoutingRunResult."""
    from kvlab.benchmarks.routing_workload import REPLICA_HEADER, run_workload

    serve_args = ["--num-blocks", str(args.num_blocks), "--max-num-seqs", str(args.max_num_seqs)]
    kwargs = dict(conversation_rate=args.rate, arrival=args.arrival, think_time_s=args.think_time_s, model="default")
    if policy == BASELINE:
        with single_replica(serve_args, args.hash_seed) as url:
            return asyncio.run(run_workload(workload, url, **kwargs))
    from kvlab.entrypoints.replicas import ReplicaSet

    with ReplicaSet(model="default", num_replicas=args.replicas, policy=policy, serve_args=serve_args,
                    hash_seed=args.hash_seed) as replicas:
        result = asyncio.run(run_workload(workload, replicas.router_url, replica_urls=replicas.replica_urls,
                                          router_url=replicas.router_url, **kwargs))
    routed = routed_counts(result.router_stats_before, result.router_stats)
    served = {r.url: r.requests for r in result.replicas}
    named = {url: sum(r.replica.rstrip("/") == url for r in result.requests if r.replica) for url in served}
    if not routed == served == named:
        raise RuntimeError(f"{policy}: requests per replica differ: the router's stats {routed}, the replicas' "
                           f"/metrics {served}, the answers' {REPLICA_HEADER} headers {named}")
    return result


def table(rows: dict[str, list]) -> str:
    """A markdown table: per policy, the median of each figure over its runs, and each run's requests per replica."""
    head = ("| policy | hit rate | prefill tokens computed | TTFT p50 / p90 / p99 (ms) | e2e p50 / p90 (ms) "
            "| requests per replica | wall (s) |")
    lines = [head, "|---|---:|---:|---:|---:|---|---:|"]
    for policy, results in rows.items():
        summaries = [r.summary() for r in results]

        def med(key, summaries=summaries):
            return statistics.median(s[key] for s in summaries)

        spread = " ; ".join("/".join(str(n) for n in s["replica_requests"]) for s in summaries)
        lines.append(f"| {policy} | {100 * med('hit_rate'):.1f}% | {med('prefill_tokens_computed'):,.0f} "
                     f"| {med('ttft_p50_ms'):.0f} / {med('ttft_p90_ms'):.0f} / {med('ttft_p99_ms'):.0f} "
                     f"| {med('e2e_p50_ms'):.0f} / {med('e2e_p90_ms'):.0f} | {spread} | {med('wall_s'):.1f} |")
    return "\n".join(lines)


def compare_answers(rows: dict[str, list]) -> tuple[bool, str]:
    """(all equal, a sentence): every run's answers against the first run's of the first row."""
    runs = [(policy, i, r.answers) for policy, results in rows.items() for i, r in enumerate(results)]
    reference_policy, _, reference = runs[0]
    for policy, i, answers in runs[1:]:
        differ = sorted(k for k in reference if answers.get(k) != reference[k])
        if differ:
            c, t = differ[0]
            return False, (f"answers differ: {policy} run {i + 1} against {reference_policy} in {len(differ)} turns, "
                           f"first conversation {c} turn {t}: {answers.get((c, t))!r} vs {reference[(c, t)]!r}")
    return True, (f"answers equal: {len(runs)} runs of {len(rows)} set-ups gave the same text for all "
                  f"{len(reference)} turns ({len(set(reference.values()))} distinct answers)")


def main(argv=None) -> int:
    from kvlab.router.policies import POLICIES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--baseline-only", action="store_true", help="only the one-replica row (no router)")
    parser.add_argument("--no-baseline", action="store_true", help="leave out the one-replica row")
    parser.add_argument("--runs", type=int, default=1, help="repetitions per policy (the table shows medians)")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=40, help="KV blocks per replica (16 tokens each)")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=36)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--hot-share", type=float, default=0.6)
    parser.add_argument("--max-tokens", type=int, default=8, help="answer tokens per turn")
    parser.add_argument("--rate", type=float, default=6.0, help="conversations started per second")
    parser.add_argument("--arrival", choices=("poisson", "fixed"), default="poisson")
    parser.add_argument("--think-time-s", type=float, default=0.5, help="pause after an answer before the next turn")
    parser.add_argument("--hash-seed", default="0", help="PYTHONHASHSEED of every replica")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    parser.add_argument("--json", help="write every run's figures here")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")

    from kvlab import load_model
    from kvlab.benchmarks.routing_workload import build_routing_workload, longest_prompt_len

    model, tokenizer = load_model("default")
    try:  # every turn must fit the context the replicas serve: the model's own (256 tokens for the embedded one)
        workload = build_routing_workload(tokenizer, num_conversations=args.conversations, num_turns=args.turns,
                                          num_system_prompts=args.system_prompts, hot_share=args.hot_share,
                                          max_tokens=args.max_tokens, seed=args.seed,
                                          max_model_len=model.config.max_position_embeddings)
    except ValueError as err:
        parser.error(str(err))
    setups = [] if args.no_baseline else [BASELINE]
    setups += [] if args.baseline_only else list(args.policies)
    print(f"{len(workload.conversations)} conversations x {args.turns} turns ({workload.num_requests} requests, "
          f"longest prompt {longest_prompt_len(workload, tokenizer)} tokens), {args.system_prompts} system prompts, "
          f"{args.hot_share:.0%} on the hot one; {args.rate:g} conversations/s ({args.arrival}), think time "
          f"{args.think_time_s:g} s; {args.num_blocks} blocks of 16 tokens per replica, {args.replicas} replicas",
          flush=True)
    rows: dict[str, list] = {s: [] for s in setups}
    start = time.perf_counter()
    for run in range(args.runs):
        for setup in setups:
            t0 = time.perf_counter()
            result = run_one(setup, workload, args)
            rows[setup].append(result)
            s = result.summary()
            print(f"run {run + 1} {setup}: hit rate {100 * s['hit_rate']:.1f}%, TTFT p50 {s['ttft_p50_ms']:.0f} ms, "
                  f"requests {s['replica_requests']}, {time.perf_counter() - t0:.1f} s with start-up", flush=True)
    print()
    print(table(rows))
    equal, sentence = compare_answers(rows)
    print()
    print(sentence)
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "answers_equal": equal, "rows": {
            setup: [r.summary() for r in results] for setup, results in rows.items()}}, indent=1))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
