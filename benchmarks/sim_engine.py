"""How fast the simulated engine replays a trace on this CPU, and where its time goes.

kvlab.simulation.engine drives kvlab's own Scheduler and KVCacheManager without a model, on a clock of roofline
step times; every scheduled request still goes through the real scheduling, block allocation and prefix
hashing each step, so a run costs about the work of its scheduled tokens. Two workloads:

  figure12   the paper's Figure 12 point: OPT-13B on one A100-40GB (pool from kv_capacity), max_model_len 2048,
             block 16, --requests requests whose lengths are drawn (seeded, with replacement) from the shipped
             ShareGPT-like chat trace (assets/traces/chat.csv: means 152 in / 310 out), Poisson arrivals at each
             --rates, every --systems (paged, orca-oracle, orca-pow2, orca-max, static)
  mooncake   the Mooncake conversation trace (assets/traces, kvlab.analysis.mooncake), its first
             --mooncake-requests requests at their real arrival times, prompts synthesized from their 512-token
             hash ids and streamed one at a time: Llama-3-8B's shape on --mooncake-gpu with tensor parallelism
             --tp, max_model_len 131,072

Reported per run: simulated steps, steps/s and requests/s of this machine's wall time (median of --repeats runs),
and for figure12 the time a whole sweep would take (--sweep-rates x 5 systems x 3 seeds, from the measured
per-run time of each system, interpolated over the rates measured). --profile runs each workload once under
cProfile and prints the cumulative time of the engine's parts: the scheduler's schedule() and
update_from_output(), the KV cache manager's allocate_blocks / num_blocks_to_allocate / get_computed_blocks, the
block hashing (kvlab.core.prefix_cache; the simulator hashes with "builtin"), the simulated runner and the
step-time model.

    OMP_NUM_THREADS=1 python benchmarks/sim_engine.py [--workload figure12 mooncake] [--requests 1000]
        [--rates 4 12] [--systems paged orca-oracle orca-pow2 orca-max static] [--mooncake-requests 600]
        [--repeats 3] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

SYSTEMS = ("paged", "orca-oracle", "orca-pow2", "orca-max", "static")
MOONCAKE_MAX_MODEL_LEN = 131072  # the trace's longest request is 121,912 tokens (Llama-3.1's context)


def mooncake_requests(count: int, vocab_size: int = 128256):
    """The conversation trace's first count requests, prompts synthesized from their 512-token hash ids
    (kvlab.analysis.mooncake.PromptSynthesizer: equal id prefixes give equal tokens), streamed one at a time."""
    from kvlab.analysis.mooncake import PromptSynthesizer, load_mooncake_trace
    from kvlab.simulation.engine import SimRequest

    trace = load_mooncake_trace("conversation", limit=count)
    synth = PromptSynthesizer(vocab_size)
    return trace, (SimRequest(r.arrival_s, synth.prompt_token_ids(r).tolist(), r.output_length) for r in trace)


PARTS = {
    "Scheduler.schedule (all of it)": ("scheduler.py", "schedule"),
    "  KVCacheManager.allocate_blocks": ("kv_cache_manager.py", "allocate_blocks"),
    "  KVCacheManager.num_blocks_to_allocate": ("kv_cache_manager.py", "num_blocks_to_allocate"),
    "  KVCacheManager.get_computed_blocks": ("kv_cache_manager.py", "get_computed_blocks"),
    "  Scheduler._blocks_freed_by_preemption": ("scheduler.py", "_blocks_freed_by_preemption"),
    "    of which Scheduler._count_shared_blocks": ("scheduler.py", "_count_shared_blocks"),
    "  Scheduler._tell_runner": ("scheduler.py", "_tell_runner"),
    "Scheduler.update_from_output": ("scheduler.py", "update_from_output"),
    "block hashing (hash_block_tokens_builtin)": ("prefix_cache.py", "hash_block_tokens_builtin"),
    "Request.append_output": ("request.py", "append_output"),
    "SimulatedModelRunner.execute_model": ("simulation/engine.py", "execute_model"),
    "GPUStepTime (the step-time model)": ("simulation/engine.py", "__call__"),
}


def profile(run) -> None:
    """Run once under cProfile; print the cumulative seconds of the engine's parts and their share."""
    prof = cProfile.Profile()
    prof.enable()
    result = run()
    prof.disable()
    stats = pstats.Stats(prof).stats
    total = sum(tt for (_, _, _), (_, _, tt, _, _) in stats.items())
    print(f"  profiled: {result.num_steps} steps, {len(result.timings)} requests, {total:.1f} s under cProfile")
    for label, (file, func) in PARTS.items():
        cum = sum(ct for (f, _, name), (_, _, _, ct, _) in stats.items() if f.endswith(file) and name == func)
        calls = sum(nc for (f, _, name), (_, nc, _, _, _) in stats.items() if f.endswith(file) and name == func)
        print(f"  {label:<44} {cum:7.2f} s {100 * cum / total:5.1f}%  {calls:>9} calls")


def timed(run, repeats: int):
    """(median wall seconds, the last result) of repeats runs."""
    seconds, result = [], None
    for _ in range(repeats):
        result = run()
        seconds.append(result.wall_s)
    return statistics.median(seconds), result


def bench_figure12(args) -> dict:
    from kvlab.simulation.engine import simulate
    from kvlab.simulation.planning import chat_requests

    print(f"\nfigure12: OPT-13B on one A100-40GB, {args.requests} ShareGPT-like requests per run, median of "
          f"{args.repeats} runs")
    print(f"{'rate':>6} {'system':<12} {'steps':>7} {'preempt':>8} {'wall s':>7} {'steps/s':>8} {'req/s':>7}")
    per_run: dict[str, dict[float, float]] = {s: {} for s in args.systems}
    for rate in args.rates:
        requests = chat_requests(args.requests, rate, seed=0)
        for system in args.systems:
            wall, r = timed(lambda requests=requests, system=system: simulate(
                requests, "opt-13b", "A100-40GB", system=system, max_model_len=2048), args.repeats)
            per_run[system][rate] = wall
            print(f"{rate:>6g} {system:<12} {r.num_steps:>7} {r.num_preemptions:>8} {wall:>7.2f} "
                  f"{r.num_steps / wall:>8.0f} {len(r.timings) / wall:>7.0f}")
    sweep = 0.0
    for system, by_rate in per_run.items():
        rates = sorted(by_rate)
        for rate in args.sweep_rates:  # the nearest measured rate's time stands for it
            sweep += 3 * by_rate[min(rates, key=lambda r: abs(r - rate))]
    print(f"a sweep of {len(args.sweep_rates)} rates x {len(args.systems)} systems x 3 seeds, from these runs: "
          f"about {sweep:.0f} s on one core")
    if args.profile:
        rate = max(args.rates)
        requests = chat_requests(args.requests, rate, seed=0)
        print(f"profile: paged at {rate:g} req/s")
        profile(lambda: simulate(requests, "opt-13b", "A100-40GB", max_model_len=2048))
    return per_run


def bench_mooncake(args) -> None:
    from kvlab.simulation.engine import simulate

    trace, _ = mooncake_requests(args.mooncake_requests)
    print(f"\nmooncake: the conversation trace's first {len(trace)} requests (mean prompt "
          f"{statistics.fmean(r.input_length for r in trace):.0f} tokens, mean output "
          f"{statistics.fmean(r.output_length for r in trace):.0f}, arriving over {trace[-1].arrival_s:.0f} s), "
          f"Llama-3-8B on {args.tp} x {args.mooncake_gpu}, max_model_len {MOONCAKE_MAX_MODEL_LEN}, median of "
          f"{args.repeats} runs")

    def run():
        return simulate(mooncake_requests(args.mooncake_requests)[1], "llama-3-8b", args.mooncake_gpu,
                        tensor_parallel_size=args.tp, max_model_len=MOONCAKE_MAX_MODEL_LEN)

    wall, r = timed(run, args.repeats)
    print(f"  {r.num_steps} steps, {r.num_preemptions} preemptions, prefix hit rate {r.prefix_hit_rate:.2f}, "
          f"{r.num_blocks} blocks; {wall:.2f} s: {r.num_steps / wall:.0f} steps/s, {len(trace) / wall:.1f} req/s; "
          f"the 12,031-request trace at this rate: about {12031 / (len(trace) / wall):.0f} s")
    if args.profile:
        profile(run)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", nargs="+", default=["figure12", "mooncake"], choices=["figure12", "mooncake"])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rates", type=float, nargs="+", default=[4.0, 12.0])
    parser.add_argument("--sweep-rates", type=float, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 10, 12, 14],
                        help="the rate grid whose sweep time is estimated")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--mooncake-requests", type=int, default=600)
    parser.add_argument("--mooncake-gpu", default="H100-SXM")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    if "figure12" in args.workload:
        bench_figure12(args)
    if "mooncake" in args.workload:
        bench_mooncake(args)


if __name__ == "__main__":
    main()
