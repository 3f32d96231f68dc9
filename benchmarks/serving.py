"""Chapter 6's serving benchmark: kvlab's continuous batching against static batching and transformers.

One workload, four systems, one run, figures side by side. The workload is the first REQUESTS
requests of the shipped chat trace (assets/traces/chat.csv, ShareGPT-like lengths), every length
multiplied by one factor so that 95 % of the requests fit the embedded model's 256-token context (the
mix of short and long requests is kept; the longest few are clipped), prompts cut from the shipped text,
greedy decoding to exactly each request's output length (EOS ignored), all requests submitted at once
(offline throughput, as vLLM's throughput benchmark does). Systems:

  kvlab continuous   kvlab.LLM: continuous batching, chunked prefill, paged cache (this chapter)
  kvlab static       kvlab.baselines.static_batching.StaticBatchingEngine: batches of BATCH that wait for
                     their longest member, on the same ragged forward pass
  hf padded          transformers `generate` on left-padded batches of BATCH (sdpa attention,
                     DynamicCache), each batch running to its longest member's output length
  hf continuous      transformers' own continuous batching (`init_continuous_batching`, the
                     manager behind `generate_batch`, with per-request max_new_tokens) and an
                     explicit small ContinuousBatchingConfig (its CPU default sizes itself to
                     8,192 tokens and several GiB)

Every system gets the same KV memory: what a padded batch of BATCH full-context sequences reserves
(BATCH x 256 tokens, i.e. BATCH x 16 blocks of 16). The static systems take up to BATCH requests in
order per batch, but never more than that memory holds once every row is padded to the batch's longest
prompt plus its longest output (a batch that would outgrow it is cut short, so no padded batch holds
more KV slots than the others' pool); the continuous ones run as many as the pool holds, up to
MAX_SEQS, and preempt when it runs out. That is the paper's argument: paging lets the same memory serve
a larger batch. Each runs in its own process, so peak memory (the process's peak resident set) is its
own; a warm-up of two requests runs first, then the workload --repeats times (default 3): the median run
is reported with the spread (slowest / fastest) of tokens per second, so one noisy run cannot swing a
ratio. Reported: generated tokens per second (requested output tokens / wall time), the ratios, the
process's CPU time (a check when other work shares the machine: wall time then inflates, CPU
time much less), peak memory, and how many requests' tokens equal kvlab continuous's.

Run from the repository root (about 6-12 minutes on a 2-core CPU, three runs per system)::

    OMP_NUM_THREADS=1 python benchmarks/serving.py [--requests 64] [--batch 16] [--max-seqs 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

REQUESTS, BATCH, MAX_SEQS, BLOCK_SIZE, MAX_TOKENS = 64, 16, 64, 16, 240
SYSTEMS = ("kvlab continuous", "kvlab static", "hf padded", "hf continuous")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def workload(count: int, tokenizer):
    from kvlab.benchmarks.datasets import chat_workload

    return chat_workload(count, tokenizer, MAX_TOKENS)


def memory_bounded_batches(prompts, lengths, batch: int, kv_tokens: int) -> list[range]:
    """Consecutive groups of at most `batch` requests whose padded rows (longest prompt + longest output, each row)
    fit kv_tokens KV slots in all; a request too long for the memory alone runs by itself."""
    groups, start = [], 0
    while start < len(prompts):
        end = start + 1
        while end < len(prompts) and end - start < batch:
            width = max(len(p) for p in prompts[start:end + 1]) + max(lengths[start:end + 1])
            if (end + 1 - start) * width > kv_tokens:
                break
            end += 1
        groups.append(range(start, end))
        start = end
    return groups


def padded_slots(prompts, lengths, groups) -> int:
    """The most KV slots any padded batch reserves (rows x (longest prompt + longest output))."""
    return max(len(g) * (max(len(prompts[i]) for i in g) + max(lengths[i] for i in g)) for g in groups)


def run_kvlab(model, tokenizer, prompts, lengths, batch, pool_blocks, continuous: bool, progress: bool, max_seqs: int):
    from kvlab import LLM, SamplingParams
    from kvlab.baselines.static_batching import StaticBatchingEngine

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    if continuous:
        llm = LLM(model, tokenizer, block_size=BLOCK_SIZE, num_blocks=pool_blocks, max_num_seqs=max_seqs,
                  max_num_batched_tokens=256)
        outs = llm.generate(prompts, params, use_tqdm=progress)
        stats = llm.llm_engine.stats()
    else:
        engine = StaticBatchingEngine(model, tokenizer, batch_size=batch, block_size=BLOCK_SIZE)
        outs = []
        from tqdm.auto import tqdm

        groups = memory_bounded_batches(prompts, lengths, batch, pool_blocks * BLOCK_SIZE)
        for g in tqdm(groups, desc="static batches", disable=not progress):
            outs += engine.generate([prompts[i] for i in g], [params[i] for i in g])
        stats = engine.stats()
    # The same counters for both engines (kvlab.engine.stats.EngineStats).
    extra = {"preemptions": stats.num_preemptions, "forward passes": stats.num_forward_passes,
             "wasted tokens": stats.num_tokens_wasted}
    if not continuous:
        extra["peak KV slots"] = padded_slots(prompts, lengths, groups)
    return [o.outputs[0].token_ids for o in outs], extra


def run_hf_padded(model, tokenizer, prompts, lengths, batch, progress: bool, kv_tokens: int):
    import torch
    from tqdm.auto import tqdm

    pad = model.config.pad_token_id or 0
    outputs = []
    groups = memory_bounded_batches(prompts, lengths, batch, kv_tokens)
    for g in tqdm(groups, desc="padded batches", disable=not progress):
        group, ns = [prompts[i] for i in g], [lengths[i] for i in g]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max(ns), min_new_tokens=max(ns),
                                 do_sample=False, pad_token_id=pad)
        outputs += [row[width:width + n].tolist() for row, n in zip(out, ns)]
    return outputs, {"batches": len(groups), "peak KV slots": padded_slots(prompts, lengths, groups)}


def run_hf_continuous(model, prompts, lengths, max_seqs, pool_blocks, progress: bool):
    from tqdm.auto import tqdm
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=model.config.pad_token_id or 0,
                              max_new_tokens=max(lengths))
    cb = ContinuousBatchingConfig(page_size=BLOCK_SIZE, num_blocks=pool_blocks, max_batch_tokens=256,
                                  max_requests_per_batch=max_seqs, use_cuda_graph=False)
    manager = model.init_continuous_batching(config, cb)
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
        results = {}
        bar = tqdm(total=len(ids), desc="hf continuous", disable=not progress)
        while len(results) < len(ids):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r
                bar.update(1)
            elif r is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before finishing")
        bar.close()
    finally:
        manager.stop(block=True)
    return [list(results[i].generated_tokens) for i in ids], {}


def child(system: str, count: int, batch: int, pool_blocks: int, max_seqs: int, repeats: int = 3) -> dict:
    """Run one system in this process and return its figures (printed as JSON by main)."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from kvlab import load_model

    model, tokenizer = load_model()
    prompts, lengths = workload(count, tokenizer)

    def run(ps, ns, progress):
        if system == "kvlab continuous":
            return run_kvlab(model, tokenizer, ps, ns, batch, pool_blocks, True, progress, max_seqs)
        if system == "kvlab static":
            return run_kvlab(model, tokenizer, ps, ns, batch, pool_blocks, False, progress, max_seqs)
        if system == "hf padded":
            return run_hf_padded(model, tokenizer, ps, ns, batch, progress, pool_blocks * BLOCK_SIZE)
        return run_hf_continuous(model, ps, ns, max_seqs, pool_blocks, progress)

    run(prompts[:2], [4, 4], False)  # warm-up: first-call costs stay out of the timing
    base = peak_rss_mib()
    runs = []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs, extra = run(prompts, lengths, True)
        runs.append((time.perf_counter() - start, time.process_time() - cpu_start))
        assert [len(o) for o in outputs] == lengths, f"{system} returned the wrong number of tokens"
    seconds, cpu_seconds = sorted(runs)[len(runs) // 2]  # the median run
    return {"system": system, "seconds": seconds, "cpu_seconds": cpu_seconds, "tokens": sum(lengths),
            "run_seconds": [r[0] for r in runs],
            "peak_rss_mib": peak_rss_mib(), "rss_after_load_mib": base, "outputs": outputs, "extra": extra,
            "prompt_tokens": sum(len(p) for p in prompts)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument("--batch", type=int, default=BATCH,
                        help="sequences per static batch; the KV memory of every system is batch x 256 tokens")
    parser.add_argument("--max-seqs", type=int, default=MAX_SEQS,
                        help="most sequences a continuous system runs at once")
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=3, help="runs per system; the median is reported")
    args = parser.parse_args()
    pool_blocks = args.batch * (256 // BLOCK_SIZE)
    if args.child:
        print("KVLAB-RESULT " + json.dumps(child(args.child, args.requests, args.batch, pool_blocks, args.max_seqs,
                                                 args.repeats)))
        return

    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TOKENIZERS_PARALLELISM="false")
    results = {}
    for system in args.systems:
        print(f"--- {system}", flush=True)
        proc = subprocess.run([sys.executable, __file__, "--child", system, "--requests", str(args.requests),
                               "--batch", str(args.batch), "--max-seqs", str(args.max_seqs),
                               "--repeats", str(args.repeats)],
                              stdout=subprocess.PIPE, text=True, env=env)
        line = next((out for out in proc.stdout.splitlines() if out.startswith("KVLAB-RESULT ")), None)
        if proc.returncode != 0 or line is None:
            print(f"{system} failed (exit {proc.returncode})")
            continue
        results[system] = json.loads(line[len("KVLAB-RESULT "):])

    first = next(iter(results.values()), None)
    if first is None:
        sys.exit("no system finished")
    print(f"\n{args.requests} requests of the shipped chat trace scaled to the model's context "
          f"(<= {MAX_TOKENS} tokens): {first['prompt_tokens']} prompt tokens, {first['tokens']} output tokens; "
          f"KV memory {pool_blocks} blocks of {BLOCK_SIZE} tokens for every system: static batches of {args.batch}, "
          f"continuous up to {args.max_seqs} sequences; OMP_NUM_THREADS={env['OMP_NUM_THREADS']}\n")
    ref = results.get("kvlab continuous")
    header = f"{'system':<18} {'seconds':>8} {'CPU s':>6} {'tokens/s':>9} {'spread':>7} {'vs hf padded':>13} " \
             f"{'vs hf continuous':>17} {'peak MiB':>9} {'same tokens as kvlab':>21}  notes"
    print(header)
    print("-" * len(header))
    for system, r in results.items():
        rate = r["tokens"] / r["seconds"]
        ratios = []
        for other in ("hf padded", "hf continuous"):
            o = results.get(other)
            ratios.append(f"{rate / (o['tokens'] / o['seconds']):.2f}x" if o else "-")
        same = "-" if ref is None else \
            f"{sum(a == b for a, b in zip(r['outputs'], ref['outputs']))}/{len(ref['outputs'])}"
        notes = ", ".join(f"{k} {v}" for k, v in r["extra"].items())
        spread = f"{max(r['run_seconds']) / min(r['run_seconds']):.2f}x"  # slowest run / fastest run
        print(f"{system:<18} {r['seconds']:>8.1f} {r['cpu_seconds']:>6.1f} {rate:>9.0f} {spread:>7} {ratios[0]:>13} "
              f"{ratios[1]:>17} {r['peak_rss_mib']:>9.0f} {same:>21}  {notes}")


if __name__ == "__main__":
    main()
