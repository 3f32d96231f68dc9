"""Where an engine step's time goes: cProfile over kvlab's offline LLM.generate on Chapter 6's workload.

The workload and engine settings are benchmarks/serving.py's "kvlab continuous" (64 requests of the chat trace
or the mixed workload, 256 blocks of 16, up to 64 sequences, a 256-token budget, greedy). After a warm-up the
workload runs once under cProfile; every function's own time (cProfile's tottime) is added to the part of the
system its source file belongs to:

  model forward        transformers' modules and torch.nn (the Llama layers around kvlab's attention)
  torch ops            torch's built-in operators, whoever calls them (matmuls, index_select, copies)
  attention            kvlab's cache, storage and attention backends (Python around the ops)
  model runner         input preparation, sampling, verification (kvlab/engine/model_runner.py, sampler)
  scheduler and KV     the scheduler and the block bookkeeping below it (kvlab/engine/scheduler*.py, kvlab/core)
  engine bookkeeping   LLMEngine, LLM, input/output processors, requests, stats
  other                the rest (Python's built-ins, tokenizer, ...)

Then the functions with the most own time. --tree DIR profiles another checkout of kvlab (an earlier commit)
in a process of its own, on the same workload, so two versions can be compared side by side::

    OMP_NUM_THREADS=1 python benchmarks/profile_step.py [--model embedded|draft] [--workload chat|mixed]
        [--tree DIR ...] [--top 15]

cProfile adds its own cost to every Python call (the script prints both times), so the shares of
Python-heavy parts are overstated; the ranking, not the seconds, is the result.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
# serving.py's models, workloads and kvlab-continuous run, so the profile is of exactly that benchmark.
from serving import BATCH, BLOCK_SIZE, MAX_SEQS, MODELS, REQUESTS, run_kvlab, workload  # noqa: E402

PARTS = ("model forward", "torch ops", "attention", "model runner", "scheduler and KV", "engine bookkeeping", "other")


def part_of(filename: str, function: str) -> str:
    """The part of the system a profiled function belongs to, from its source file."""
    f = filename.replace(os.sep, "/")
    if "/kvlab/" in f:
        if "/kvlab/cache/" in f or "/kvlab/kernels/" in f or "/kvlab/model/attention_hook" in f:
            return "attention"
        if f.endswith(("engine/model_runner.py", "engine/sampler.py", "engine/rejection_sampler.py")) \
                or "/kvlab/spec_decode/" in f:
            return "model runner"
        if "/kvlab/core/" in f or "engine/scheduler" in f:
            return "scheduler and KV"
        return "engine bookkeeping"
    if "/transformers/" in f or "/torch/nn/" in f:
        return "model forward"
    if filename == "~" and ("torch" in function or "Tensor" in function or "_C." in function):
        return "torch ops"
    return "other"


def profile(model_name: str, work_file: str, top: int) -> dict:
    """Run the workload once under cProfile in this process (whichever kvlab it imports); own time by part."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from kvlab import load_model

    model, tokenizer = load_model(MODELS[model_name])
    work = json.loads(Path(work_file).read_text())
    prompts, lengths = work["prompts"], work["lengths"]

    def run():
        return run_kvlab(model, tokenizer, prompts, lengths, BATCH, BATCH * (256 // BLOCK_SIZE), True, MAX_SEQS)

    run()  # warm-up
    start = time.perf_counter()
    run()
    plain = time.perf_counter() - start
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.runcall(run)
    profiled = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    parts = dict.fromkeys(PARTS, 0.0)
    rows = []
    for (filename, line, function), (_, ncalls, tottime, _, _) in stats.stats.items():
        parts[part_of(filename, function)] += tottime
        where = function if filename == "~" else f"{Path(filename).parent.name}/{Path(filename).name}:{function}"
        rows.append((tottime, ncalls, where))
    rows.sort(reverse=True)
    import kvlab

    return {"kvlab": str(Path(kvlab.__file__).parent.parent), "seconds_unprofiled": plain,
            "seconds_profiled": profiled, "parts": parts, "top": rows[:top], "tokens": sum(lengths)}


def show(result: dict) -> None:
    total = sum(result["parts"].values())
    print(f"\nkvlab at {result['kvlab']}: {result['tokens']} tokens in {result['seconds_unprofiled']:.2f} s "
          f"unprofiled, {result['seconds_profiled']:.2f} s under cProfile")
    print(f"  {'part':<20} {'own s':>7} {'share':>6}")
    for part, seconds in result["parts"].items():
        print(f"  {part:<20} {seconds:>7.2f} {seconds / total:>6.0%}")
    print(f"  {'own s':>7} {'calls':>8}  function")
    for tottime, ncalls, where in result["top"]:
        print(f"  {tottime:>7.3f} {ncalls:>8}  {where}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="embedded")
    parser.add_argument("--workload", choices=("chat", "mixed"), default="chat")
    parser.add_argument("--tree", type=Path, nargs="*", default=[],
                        help="other kvlab checkouts to profile on the same workload, each in its own process")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("KVLAB-PROFILE " + json.dumps(profile(args.model, args.child, args.top)), flush=True)
        return None
    sys.path.insert(0, str(ROOT))
    from kvlab import load_model

    # The workload is made here, by this checkout, so that every tree profiles the same requests.
    _, tokenizer = load_model(MODELS[args.model])
    prompts, lengths = workload(args.workload, REQUESTS, tokenizer)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work_file = Path(tmp) / "work.json"
        work_file.write_text(json.dumps({"prompts": prompts, "lengths": lengths}))
        for tree in [ROOT, *args.tree]:
            env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()), TOKENIZERS_PARALLELISM="false",
                       OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            done = subprocess.run([sys.executable, __file__, "--child", str(work_file), "--model", args.model,
                                   "--top", str(args.top)], env=env, cwd=Path(tree).resolve(),
                                  capture_output=True, text=True, timeout=900)
            line = next((x for x in done.stdout.splitlines() if x.startswith("KVLAB-PROFILE ")), None)
            if line is None:
                raise RuntimeError(f"profiling {tree} failed:\n{done.stderr[-3000:]}")
            results.append(json.loads(line[len("KVLAB-PROFILE "):]))
            show(results[-1])
    return results


if __name__ == "__main__":
    main()
