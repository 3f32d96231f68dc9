"""Tiered KV at GPU scale: the Mooncake conversation hour on one deployment, GPU pool only and with a CPU tier.

The conversation trace (kvlab.analysis.mooncake; 12,031 requests over 3,537 s, real arrival times, prompts
synthesized from its 512-token hash ids so that equal ids give equal tokens) is served by the simulated engine
(kvlab.simulation.simulate: kvlab's Scheduler and KVCacheManager, step times from the roofline step-time model)
on one replica of Llama-3-8B over --tp H100 SXM GPUs, the same GPU pool (kv_capacity) in every row. Each further
row adds a CPU tier of --cpu-gb gigabytes of host memory: the real OffloadingConnector's scheduler half (LRU)
decides every lookup, load and store; the simulated worker times the copies over each GPU's PCIe link
(kvlab.simulation.offload: H100 SXM PCIe Gen5 x16, 64 GB/s one way x 0.78). Loads are asynchronous, as vLLM's.
The last rows put a disk tier of --disk-gb gigabytes behind a CPU tier of --disk-cpu-gb (the connector's disk_path
and disk_size, write-through): one NVMe drive per GPU, read at 13.0 GB/s and written at 6.6 GB/s (Samsung PM1743).

Reported per row: the share of prompt tokens the GPU prefix cache served and the share the tier served (each
prompt counted once, at its first admission; a preempted request's own blocks found again are counted apart),
the prompt tokens computed and those saved against the GPU-only row (the tier's share split into CPU and
disk), TTFT and TPOT at p50 / p90 / p99, the copies' totals, preemptions. Then what one hit costs: a single
request of n tokens whose prefix is in the tier, its TTFT loaded (from the CPU tier, then from the disk tier)
against computed on one GPU of the same model, and the link speed below which loading a token costs more than
computing it in a prefill (bytes per token / the step-time model's marginal prefill time per token).

    OMP_NUM_THREADS=1 python benchmarks/mooncake_tiers.py [--tp 4] [--cpu-gb 100 500 1000] [--disk-cpu-gb 500]
        [--disk-gb 2000 8000] [--requests N] [--jobs 1] [--json benchmarks/saved/mooncake_tiers.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

MAX_MODEL_LEN = 131072  # the trace's longest request is 126,195 prompt tokens + its output (Llama-3.1's context)
QUANTILES = (0.5, 0.9, 0.99)
HIT_LENGTHS = (512, 2048, 8192, 32768, 100000)


def run_row(job: dict) -> dict:
    """One row: the trace through simulate with a CPU tier of job["cpu_gb"] GB (0: none) and a disk tier of
    job["disk_gb"] GB behind it (0: none); its figures."""
    from kvlab.analysis.mooncake import PromptSynthesizer, load_mooncake_trace
    from kvlab.simulation.engine import SimRequest, model_config, simulate
    from kvlab.simulation.planning import latency_percentiles

    trace = load_mooncake_trace("conversation", limit=job["requests"])
    synth = PromptSynthesizer(int(model_config(job["model"])["vocab_size"]))
    requests = (SimRequest(r.arrival_s, synth.prompt_token_ids(r).tolist(), r.output_length) for r in trace)
    started = time.perf_counter()
    r = simulate(requests, job["model"], job["gpu"], tensor_parallel_size=job["tp"], max_model_len=MAX_MODEL_LEN,
                 num_blocks=job["num_blocks"], kv_offloading_size=int(job["cpu_gb"] * 10**9),
                 kv_disk_size=int(job["disk_gb"] * 10**9))
    prompt = r.num_prompt_tokens
    return dict(cpu_gb=job["cpu_gb"], disk_gb=job["disk_gb"], num_blocks=r.num_blocks, prompt_tokens=prompt,
                gpu_hit_rate=r.num_cached_prompt_tokens / prompt, tier_hit_rate=r.num_tier_hit_tokens / prompt,
                cpu_hit_rate=(r.num_tier_hit_tokens - r.num_disk_hit_tokens) / prompt,
                disk_hit_rate=r.num_disk_hit_tokens / prompt, disk_loaded_blocks=r.num_disk_loaded_blocks,
                disk_written_blocks=r.num_disk_written_blocks, disk_load_s=r.disk_load_s,
                disk_write_s=r.disk_write_s,
                tier_reloaded_tokens=r.num_tier_reloaded_tokens, tokens_computed=r.num_tokens_computed,
                preemptions=r.num_preemptions, steps=r.num_steps, loaded_blocks=r.num_loaded_blocks,
                saved_blocks=r.num_saved_blocks, load_s=r.load_s, save_s=r.save_s, save_bound_s=r.save_bound_s,
                latency_s=latency_percentiles(r.timings, QUANTILES), simulated_s=r.simulated_s,
                wall_s=round(time.perf_counter() - started, 1))


def hit_costs(model: str, gpu: str, tp: int) -> list[dict]:
    """Per prompt length: one request's TTFT with its prefix loaded from the CPU tier, from the disk tier and
    computed, on an idle engine."""
    from kvlab.simulation.engine import GPUStepTime, SimRequest, SimulatedEngine, offloading_tier, resolve_model

    spec = resolve_model(model)
    step = GPUStepTime(spec, gpu, tp)
    rows = []
    for n in HIT_LENGTHS:
        blocks = -(-(n + 1) // 16)
        # A pool that holds one of the requests: the filler evicts the first, whose revisit finds it in the tier.
        engine = SimulatedEngine(step, blocks + 1, MAX_MODEL_LEN, 16, max_num_batched_tokens=8192,
                                 **offloading_tier(spec, gpu, tp, 16, 10**12))
        first, filler = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1))
        result = engine.run([SimRequest(0.0, first, 1), SimRequest(1000.0, filler, 1), SimRequest(2000.0, first, 1)])
        computed, loaded = result.timings[0].ttft, result.timings[2].ttft
        # The same with a one-block CPU tier (the filler's first block evicts the prompt's) and a disk tier.
        engine = SimulatedEngine(step, blocks + 1, MAX_MODEL_LEN, 16, max_num_batched_tokens=8192,
                                 **offloading_tier(spec, gpu, tp, 16, 2 << 20, kv_disk_size=10**13))
        on_disk = engine.run([SimRequest(0.0, first, 1), SimRequest(1000.0, filler, 1), SimRequest(2000.0, first, 1)])
        disk = on_disk.timings[2].ttft
        rows.append(dict(prompt_tokens=n, ttft_computed_s=computed, ttft_loaded_s=loaded, speedup=computed / loaded,
                         tier_tokens=result.num_tier_hit_tokens, ttft_disk_s=disk, disk_speedup=computed / disk,
                         disk_tokens=on_disk.num_disk_hit_tokens))
    return rows


def break_even(model: str, gpu: str, tp: int) -> dict:
    """Bytes per token per GPU, the marginal prefill seconds per token at 8,192 tokens, and the link speed at which
    loading a token costs as long as computing it."""
    from kvlab.kv_offload import kv_bytes_per_block
    from kvlab.simulation.engine import GPUStepTime, resolve_model
    from kvlab.simulation.offload import host_link_bytes_per_s

    spec = resolve_model(model)
    step = GPUStepTime(spec, gpu, tp)
    per_token = kv_bytes_per_block(spec.num_layers, 16, spec.num_kv_heads, spec.head_dim, spec.dtype_bytes) / 16 / tp
    # Marginal: 8,192 more prompt tokens in a step that already runs 8,192 (their attention reads the first ones).
    marginal = (step.seconds([(8192, 8192)], [], 1) - step.seconds([], [1], 1)) / 8192
    link = host_link_bytes_per_s(gpu)
    return dict(bytes_per_token_per_gpu=per_token, prefill_s_per_token=marginal, pcie_bytes_per_s=link,
                pcie_load_s_per_token=per_token / link, break_even_bytes_per_s=per_token / marginal)


def main(argv=None) -> dict:
    from multiprocessing import get_context

    from kvlab.analysis.mooncake import load_mooncake_trace
    from kvlab.simulation import kv_capacity
    from kvlab.simulation.engine import model_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--gpu", default="H100-SXM")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--cpu-gb", type=float, nargs="+", default=[100.0, 500.0, 1000.0])
    parser.add_argument("--disk-cpu-gb", type=float, default=500.0, help="the CPU tier in front of each disk tier")
    parser.add_argument("--disk-gb", type=float, nargs="*", default=[2000.0, 8000.0])
    parser.add_argument("--requests", type=int, default=None, help="the trace's first N requests (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="processes that run rows side by side")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "saved" / "mooncake_tiers.json")
    args = parser.parse_args(argv)
    if args.requests is not None and args.requests < 1:
        parser.error(f"--requests must be a positive number of requests, got {args.requests}")
    if any(gb <= 0 for gb in args.cpu_gb):
        parser.error(f"--cpu-gb must be positive numbers of gigabytes, got {args.cpu_gb}")
    if args.disk_cpu_gb <= 0 or any(gb <= 0 for gb in args.disk_gb):
        parser.error(f"--disk-cpu-gb and --disk-gb must be positive numbers of gigabytes, got {args.disk_cpu_gb} "
                     f"and {args.disk_gb}")

    started = time.perf_counter()
    trace = load_mooncake_trace("conversation", limit=args.requests)
    budget = kv_capacity(model_config(args.model), args.gpu, args.tp, max_model_len=MAX_MODEL_LEN)
    print(f"the Mooncake conversation trace, {len(trace)} requests; {args.model} on 1 x TP {args.tp} {args.gpu}, "
          f"{budget.num_blocks:,} GPU blocks ({budget.num_blocks * 16:,} tokens) in every row")
    jobs = [dict(model=args.model, gpu=args.gpu, tp=args.tp, requests=args.requests, num_blocks=budget.num_blocks,
                 cpu_gb=cpu, disk_gb=disk)
            for cpu, disk in [(0.0, 0.0), *((gb, 0.0) for gb in args.cpu_gb),
                              *((args.disk_cpu_gb, gb) for gb in args.disk_gb)]]
    pool = get_context("spawn").Pool(args.jobs) if args.jobs > 1 else None
    try:
        rows = list(pool.imap(run_row, jobs) if pool is not None else map(run_row, jobs))
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    base = rows[0]["tokens_computed"]
    print(f"\n{'CPU tier':>9} {'disk':>7} {'GPU hits':>9} {'CPU hits':>9} {'disk hits':>10} {'computed':>14} "
          f"{'saved':>12} "
          f"{'TTFT p50/p90/p99 s':>20} {'TPOT p50/p90/p99 ms':>21} {'preempt':>8} {'wall s':>7}")
    for row in rows:
        row["prefill_tokens_saved"] = base - row["tokens_computed"]
        lat = row["latency_s"]
        ttft = "/".join(f"{lat['ttft'][q]:.2f}" for q in ("p50", "p90", "p99"))
        tpot = "/".join(f"{lat['tpot'][q] * 1e3:.1f}" for q in ("p50", "p90", "p99"))
        print(f"{row['cpu_gb']:>7g}GB {row['disk_gb']:>5g}GB {100 * row['gpu_hit_rate']:>8.1f}% "
              f"{100 * row['cpu_hit_rate']:>8.1f}% {100 * row['disk_hit_rate']:>9.1f}% "
              f"{row['tokens_computed']:>14,} {row['prefill_tokens_saved']:>12,} {ttft:>20} {tpot:>21} "
              f"{row['preemptions']:>8} {row['wall_s']:>7.0f}")
    # One GPU, as vLLM's blog measured a single request (Llama-3.1-8B on one H100).
    costs = hit_costs(args.model, args.gpu, 1)
    even = break_even(args.model, args.gpu, args.tp)
    print("\none hit from the CPU tier or the disk tier against computing it (a single request on one idle GPU):")
    for c in costs:
        print(f"  {c['prompt_tokens']:>7,} tokens: TTFT computed {c['ttft_computed_s'] * 1e3:8.1f} ms, from CPU "
              f"{c['ttft_loaded_s'] * 1e3:7.1f} ms ({c['speedup']:.1f}x), from disk {c['ttft_disk_s'] * 1e3:7.1f} ms "
              f"({c['disk_speedup']:.1f}x)")
    print(f"TP {args.tp}: a token is {even['bytes_per_token_per_gpu'] / 1024:.0f} KiB per GPU: "
          f"{even['pcie_load_s_per_token'] * 1e6:.2f} us over PCIe against {even['prefill_s_per_token'] * 1e6:.2f} "
          f"us of prefill; loading wins above {even['break_even_bytes_per_s'] / 1e9:.1f} GB/s per GPU")
    seconds = time.perf_counter() - started
    report = dict(model=args.model, gpu=args.gpu, tp=args.tp, trace="mooncake conversation", requests=len(trace),
                  num_blocks=budget.num_blocks, rows=rows, hit_costs=costs, break_even=even, jobs=args.jobs,
                  seconds=round(seconds, 1))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json} ({seconds:.0f} s in all)")
    return report


if __name__ == "__main__":
    main()
