"""Chapter 6's serving benchmark: kvlab's continuous batching against static batching and transformers.

One workload, several systems, one run, figures side by side. Two workloads:

  chat    the first REQUESTS requests of the shipped chat trace (assets/traces/chat.csv, ShareGPT-like lengths),
          every length multiplied by one factor so that 95 % of the requests fit the model's 256-token context
          (the mix of short and long requests is kept; the longest few are clipped), prompts cut from the text
  mixed   short prompts (4-24 tokens) with output lengths spread log-uniformly from 1 to the rest of the
          context: the case where a static batch waits longest for its longest member

Greedy decoding to exactly each request's output length (EOS ignored), all requests submitted at once
(offline throughput, as vLLM's throughput benchmark does), on the embedded model (2.9 M parameters) or
its draft model (0.2 M: its forward pass is so cheap that the engine's own per-step work shows). Systems:

  kvlab continuous   kvlab.LLM: continuous batching, chunked prefill, paged cache (this chapter)
  kvlab static       kvlab.baselines.static_batching.StaticBatchingEngine: batches of BATCH that wait for
                     their longest member, on the same ragged forward pass
  hf padded          transformers `generate` on left-padded batches of BATCH (sdpa attention,
                     DynamicCache), each batch running to its longest member's output length
  hf continuous      transformers' own continuous batching (`init_continuous_batching`, the
                     manager behind `generate_batch`, with per-request max_new_tokens) and an
                     explicit small ContinuousBatchingConfig (its CPU default sizes itself to
                     8,192 tokens and several GiB)

--baseline-tree DIR adds "kvlab continuous @ DIR": the same system on another checkout of kvlab (an
earlier commit, say), measured in the same run, alternated with the others.

Every system gets the same KV memory: what a padded batch of BATCH full-context sequences reserves
(BATCH x 256 tokens, i.e. BATCH x 16 blocks of 16). The static systems take up to BATCH requests in
order per batch, but never more than that memory holds once every row is padded to the batch's longest
prompt plus its longest output; the continuous ones run as many as the pool holds, up to MAX_SEQS,
and preempt when it runs out. Each system runs in a process of its own (so peak memory is its own),
started once and warmed up; then the runs alternate between the systems, --repeats rounds (default 5),
so that a slow moment of the machine falls on all of them alike. Reported: the median run's generated
tokens per second (requested output tokens / wall time) with the spread (slowest / fastest), the ratios,
the median run's CPU time (wall time inflates more than CPU time when other work shares the machine),
peak memory, and how many requests' tokens equal kvlab continuous's.

Run from the repository root (minutes on a 2-core CPU)::

    OMP_NUM_THREADS=1 python benchmarks/serving.py [--model embedded|draft] [--workload chat|mixed]
        [--requests 64] [--batch 16] [--max-seqs 64] [--repeats 5] [--systems ...] [--baseline-tree DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

REQUESTS, BATCH, MAX_SEQS, BLOCK_SIZE, MAX_TOKENS = 64, 16, 64, 16, 240
SYSTEMS = ("kvlab continuous", "kvlab static", "hf padded", "hf continuous")
MODELS = {"embedded": ROOT / "assets" / "model", "draft": ROOT / "assets" / "draft_model"}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def workload(name: str, count: int, tokenizer):
    """(prompt token ids, output lengths) of the chat or the mixed workload."""
    from kvlab.benchmarks.datasets import chat_workload, mixed_workload

    if name == "chat":
        return chat_workload(count, tokenizer, MAX_TOKENS)
    return mixed_workload(count, tokenizer, MAX_TOKENS)


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


def run_kvlab(model, tokenizer, prompts, lengths, batch, pool_blocks, continuous: bool, max_seqs: int):
    from kvlab import LLM, SamplingParams
    from kvlab.baselines.static_batching import StaticBatchingEngine

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    if continuous:
        llm = LLM(model, tokenizer, block_size=BLOCK_SIZE, num_blocks=pool_blocks, max_num_seqs=max_seqs,
                  max_num_batched_tokens=256)
        outs = llm.generate(prompts, params)
        stats = llm.llm_engine.stats()
    else:
        engine = StaticBatchingEngine(model, tokenizer, batch_size=batch, block_size=BLOCK_SIZE)
        outs = []
        groups = memory_bounded_batches(prompts, lengths, batch, pool_blocks * BLOCK_SIZE)
        for g in groups:
            outs += engine.generate([prompts[i] for i in g], [params[i] for i in g])
        stats = engine.stats()
    # The same counters for both engines (kvlab.engine.stats.EngineStats).
    extra = {"preemptions": stats.num_preemptions, "forward passes": stats.num_forward_passes,
             "wasted tokens": stats.num_tokens_wasted}
    if not continuous:
        extra["peak KV slots"] = padded_slots(prompts, lengths, groups)
    return [o.outputs[0].token_ids for o in outs], extra


def run_hf_padded(model, prompts, lengths, batch, kv_tokens: int):
    import torch

    pad = model.config.pad_token_id or 0
    outputs = []
    groups = memory_bounded_batches(prompts, lengths, batch, kv_tokens)
    for g in groups:
        group, ns = [prompts[i] for i in g], [lengths[i] for i in g]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max(ns), min_new_tokens=max(ns),
                                 do_sample=False, pad_token_id=pad)
        outputs += [row[width:width + n].tolist() for row, n in zip(out, ns)]
    return outputs, {"batches": len(groups), "peak KV slots": padded_slots(prompts, lengths, groups)}


def run_hf_continuous(model, prompts, lengths, max_seqs, pool_blocks):
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
        while len(results) < len(ids):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r
            elif r is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before finishing")
    finally:
        manager.stop(block=True)
    return [list(results[i].generated_tokens) for i in ids], {}


def child(system: str, model_dir: str, work_file: str, batch: int, pool_blocks: int, max_seqs: int) -> None:
    """One system in this process: load, warm up, then one run per 'run' line on stdin, its figures on stdout."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from kvlab import load_model

    model, tokenizer = load_model(model_dir)
    work = json.loads(Path(work_file).read_text())
    prompts, lengths = work["prompts"], work["lengths"]

    def run(ps, ns):
        if system.startswith("kvlab continuous"):
            return run_kvlab(model, tokenizer, ps, ns, batch, pool_blocks, True, max_seqs)
        if system == "kvlab static":
            return run_kvlab(model, tokenizer, ps, ns, batch, pool_blocks, False, max_seqs)
        if system == "hf padded":
            return run_hf_padded(model, ps, ns, batch, pool_blocks * BLOCK_SIZE)
        return run_hf_continuous(model, ps, ns, max_seqs, pool_blocks)

    run(prompts[:2], [4, 4])  # warm-up: first-call costs stay out of the timing
    print("KVLAB-READY", flush=True)
    first = True
    for line in sys.stdin:
        if line.strip() != "run":
            break
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs, extra = run(prompts, lengths)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        assert [len(o) for o in outputs] == lengths, f"{system} returned the wrong number of tokens"
        result = {"seconds": seconds, "cpu_seconds": cpu, "extra": extra, "peak_rss_mib": peak_rss_mib()}
        if first:
            result["outputs"] = outputs
            first = False
        print("KVLAB-RESULT " + json.dumps(result), flush=True)


class Child:
    """A system's process, driven one run at a time."""

    def __init__(self, system: str, args, work_file: str, pool_blocks: int, kvlab_root: Path):
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=str(kvlab_root))
        self.system = system
        command = [sys.executable, __file__, "--child", system, "--model-dir", str(MODELS[args.model]),
                   "--work-file", work_file, "--batch", str(args.batch), "--max-seqs", str(args.max_seqs),
                   "--pool-blocks", str(pool_blocks)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=kvlab_root)
        self._expect("KVLAB-READY")
        self.runs: list[dict] = []

    def _expect(self, tag: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag):].strip()
        raise RuntimeError(f"{self.system} stopped (exit {self.proc.wait()}) before saying {tag}")

    def run(self) -> None:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        self.runs.append(json.loads(self._expect("KVLAB-RESULT")))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="embedded")
    parser.add_argument("--workload", choices=("chat", "mixed"), default="chat")
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument("--batch", type=int, default=BATCH,
                        help="sequences per static batch; the KV memory of every system is batch x 256 tokens")
    parser.add_argument("--max-seqs", type=int, default=MAX_SEQS,
                        help="most sequences a continuous system runs at once")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=5, help="alternated runs per system; the median is reported")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="another kvlab checkout: adds 'kvlab continuous @ DIR' to the systems")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--work-file", help=argparse.SUPPRESS)
    parser.add_argument("--pool-blocks", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        sys.path.insert(0, os.getcwd())  # the checkout this child measures (cwd = its tree)
        child(args.child, args.model_dir, args.work_file, args.batch, args.pool_blocks, args.max_seqs)
        return None

    sys.path.insert(0, str(ROOT))
    from kvlab import load_model

    _, tokenizer = load_model(MODELS[args.model])
    prompts, lengths = workload(args.workload, args.requests, tokenizer)
    pool_blocks = args.batch * (256 // BLOCK_SIZE)
    systems = [(s, ROOT) for s in args.systems]
    if args.baseline_tree is not None:
        systems.insert(1, (f"kvlab continuous @ {args.baseline_tree}", args.baseline_tree.resolve()))
    with tempfile.TemporaryDirectory() as tmp:
        work_file = str(Path(tmp) / "work.json")
        Path(work_file).write_text(json.dumps({"prompts": prompts, "lengths": lengths}))
        children = []
        for system, tree in systems:
            print(f"--- starting {system}", flush=True)
            children.append(Child(system, args, work_file, pool_blocks, tree))
        for r in range(args.repeats):
            for c in children:
                c.run()
            print(f"round {r + 1}/{args.repeats}: " + ", ".join(f"{c.system} {c.runs[-1]['seconds']:.2f} s"
                                                             for c in children), flush=True)
        for c in children:
            c.close()

    results = {}
    for c in children:
        seconds = statistics.median(r["seconds"] for r in c.runs)
        results[c.system] = {"seconds": seconds, "cpu_seconds": statistics.median(r["cpu_seconds"] for r in c.runs),
                             "run_seconds": [r["seconds"] for r in c.runs], "tokens": sum(lengths),
                             "peak_rss_mib": max(r["peak_rss_mib"] for r in c.runs),
                             "outputs": c.runs[0]["outputs"], "extra": c.runs[0]["extra"]}
    print(f"\n{args.workload} workload, {args.model} model: {args.requests} requests, {sum(map(len, prompts))} prompt "
          f"tokens, {sum(lengths)} output tokens ({min(lengths)}-{max(lengths)} per request); KV memory "
          f"{pool_blocks} blocks of {BLOCK_SIZE} tokens for every system: static batches of {args.batch}, continuous "
          f"up to {args.max_seqs} sequences; median of {args.repeats} alternated runs; "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}\n")
    ref = results.get("kvlab continuous")
    header = f"{'system':<28} {'seconds':>8} {'CPU s':>6} {'tokens/s':>9} {'spread':>7} {'vs hf padded':>13} " \
             f"{'vs hf continuous':>17} {'peak MiB':>9} {'same tokens':>12}  notes"
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
        print(f"{system:<28} {r['seconds']:>8.2f} {r['cpu_seconds']:>6.2f} {rate:>9.0f} {spread:>7} {ratios[0]:>13} "
              f"{ratios[1]:>17} {r['peak_rss_mib']:>9.0f} {same:>12}  {notes}")
    if args.json is not None:
        args.json.write_text(json.dumps({s: {k: v for k, v in r.items() if k != "outputs"} for s, r in results.items()},
                                        indent=1))
    return results


if __name__ == "__main__":
    main()
