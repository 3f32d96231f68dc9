"""The step-time model against kvlab's own forward passes on the GPU this runs on: the simulator's calibration.

kvlab.simulation predicts a step's time from a roofline of its operators (kvlab.simulation.step_time) and was
validated against operator times that others measured (benchmarks/step_time_model.py). This script measures the
step itself on real hardware: a transformers model built from a real config (assets/configs, random weights,
bf16 by default) runs kvlab's forward pass (kvlab.cache.ragged_batch.forward_batch, the pass the model runner
makes) on kvlab's paged cache with the unified Triton kernel, over decode batches at several context lengths
and prefill chunks, timed by kvlab.benchmarks.step_cost (the median of --rounds, after a warm-up, waiting for the
GPU before and after each pass). For each case it prints the measured time, the model's prediction for the same
step on this GPU without the per-step fixed cost (that one is the engine's CPU work around the pass, not
measured here), and measured / predicted; then the median ratio per kind of pass and the part of a batch-1
decode that the roofline does not explain (kvlab launches every kernel from Python, without CUDA graphs).
Everything goes to --out/step_time_gpu.json as well.

    python benchmarks/step_time_gpu.py [--config llama-3-8b] [--rounds 5] [--gpu H200] [--out benchmarks/results]

The GPU's datasheet figures come from kvlab.simulation.gpus, found from the device's name (or --gpu). Without CUDA
it says so and exits 0. --device cpu runs the same code on the CPU with the torch attention backend (a tiny
--config file, --decode-batches/--contexts/--prefills small), which only checks that the script works: a CPU has
no entry in the GPU table, so pass --gpu to get a (meaningless) ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

DECODE_BATCHES = (1, 8, 32, 128)
CONTEXTS = (512, 2048)
PREFILLS = (128, 512, 2048)
BLOCK_SIZE = 16
# What torch.cuda.get_device_name() says, and the entry of kvlab.simulation.gpus it means (the first match wins).
DEVICE_NAMES = (("H200", "H200"), ("H100", "H100-SXM"), ("A100-SXM4-80GB", "A100-80GB"), ("A100 80GB", "A100-80GB"),
                ("A100", "A100-40GB"), ("L4", "L4"), ("T4", "T4"))


def gpu_for_device(device_name: str) -> str | None:
    """The kvlab.simulation.gpus entry for a CUDA device name, or None when the table has no such GPU."""
    if ("PCIe" in device_name and "H100" in device_name) or "L40" in device_name:
        return None   # H100 PCIe differs from the SXM part the table holds; an L40(S) is not an L4
    for fragment, name in DEVICE_NAMES:
        if fragment in device_name:
            return name
    return None


def build_model(config: dict, dtype, device):
    """A transformers causal LM of `config` with random weights, created directly on `device` in `dtype`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("architectures", "model_type")}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return model.eval()


def cases_that_fit(cases, kv_bytes_per_token: int, free_bytes: int | None):
    """The cases whose block pool (the largest case's, shared by all) fits in 80% of free memory, and the dropped."""

    def pool_bytes(case):
        blocks = case.num_seqs * math.ceil((case.context + case.new_tokens) / BLOCK_SIZE)
        return blocks * BLOCK_SIZE * kv_bytes_per_token

    if free_bytes is None:
        return list(cases), []
    kept = [c for c in cases if pool_bytes(c) <= 0.8 * free_bytes]
    return kept, [c for c in cases if c not in kept]


def predicted_seconds(spec, gpu, case) -> float:
    """The step-time model's time of the case's pass on gpu, without the fixed per-step cost."""
    from kvlab.simulation.step_time import step_time

    if case.kind == "decode":
        timing = step_time(spec, gpu, decodes=[case.context + 1] * case.num_seqs, step_overhead_s=0.0)
    else:
        timing = step_time(spec, gpu, prefills=[(case.new_tokens, case.context)], step_overhead_s=0.0)
    return timing.total_s


def run(args) -> dict:
    import torch

    from kvlab.analysis.kv_size import config_dict, kv_cache_bytes_per_token, load_model_config
    from kvlab.benchmarks.step_cost import PassCase, measure_passes
    from kvlab.simulation.gpus import get_gpu
    from kvlab.simulation.step_time import ModelSpec

    config = config_dict(args.config) if Path(args.config).suffix == ".json" else load_model_config(args.config)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    dtype_name = str(dtype).removeprefix("torch.")
    spec = ModelSpec.from_config(config, dtype=dtype_name)
    cuda = args.device == "cuda"
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    gpu_name = args.gpu or (gpu_for_device(device_name) if cuda else None)
    gpu = get_gpu(gpu_name) if gpu_name else None
    cases = [PassCase("decode", b, 1, c) for c in args.contexts for b in args.decode_batches]
    cases += [PassCase("prefill", 1, n, 0) for n in args.prefills]
    kv_per_token = kv_cache_bytes_per_token(config, dtype_name)
    free = torch.cuda.mem_get_info()[0] - spec.dtype_bytes * 1.1 * _num_params(spec) if cuda else None
    cases, dropped = cases_that_fit(cases, kv_per_token, free)
    torch.manual_seed(0)
    model = build_model(config, dtype, args.device)
    times = measure_passes(model, cases, rounds=args.rounds, attention_backend="triton" if cuda else "torch")
    rows = []
    for case in cases:
        measured = statistics.median(times[case])
        predicted = predicted_seconds(spec, gpu, case) if gpu else None
        rows.append({"kind": case.kind, "num_seqs": case.num_seqs, "new_tokens": case.new_tokens,
                     "context": case.context, "tokens": case.tokens, "measured_ms": 1e3 * measured,
                     "predicted_ms": None if predicted is None else 1e3 * predicted,
                     "measured_over_predicted": None if predicted is None else measured / predicted})
    summary = {}
    for kind in ("decode", "prefill"):
        ratios = [r["measured_over_predicted"] for r in rows if r["kind"] == kind and r["measured_over_predicted"]]
        if ratios:
            summary[kind] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    batch1 = [r for r in rows if r["kind"] == "decode" and r["num_seqs"] == 1 and r["predicted_ms"] is not None]
    if batch1:
        gaps = [r["measured_ms"] - r["predicted_ms"] for r in batch1]
        summary["batch1_decode_unexplained_ms"] = statistics.median(gaps)
    return {"config": spec.name, "dtype": args.dtype, "device": device_name, "gpu": gpu.name if gpu else None,
            "rounds": args.rounds, "block_size": BLOCK_SIZE, "rows": rows, "summary": summary,
            "dropped": [c.label for c in dropped]}


def _num_params(spec) -> int:
    """Weights of the model, about (the step-time model's count of what a step reads, plus the embedding)."""
    from kvlab.simulation.step_time import weight_bytes_per_gpu

    return weight_bytes_per_gpu(spec) // spec.dtype_bytes + spec.vocab_size * spec.hidden_size


def print_report(result: dict) -> None:
    print(f"{result['config']} ({result['dtype']}, random weights) on {result['device']}"
          f" -> step-time model of {result['gpu'] or 'no GPU in kvlab.simulation.gpus'}; median of "
          f"{result['rounds']} passes, block size {result['block_size']}")
    print(f"{'pass':>8} {'seqs':>5} {'context':>8} {'tokens':>7} {'measured':>11} {'predicted':>11} {'ratio':>6}")
    for r in result["rows"]:
        predicted = "" if r["predicted_ms"] is None else f"{r['predicted_ms']:8.3f} ms"
        ratio = "" if r["measured_over_predicted"] is None else f"{r['measured_over_predicted']:6.2f}"
        print(f"{r['kind']:>8} {r['num_seqs']:>5} {r['context']:>8} {r['tokens']:>7} {r['measured_ms']:8.3f} ms "
              f"{predicted:>11} {ratio:>6}")
    for kind in ("decode", "prefill"):
        if kind in result["summary"]:
            s = result["summary"][kind]
            print(f"{kind}: measured / predicted median {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})")
    if "batch1_decode_unexplained_ms" in result["summary"]:
        print(f"a batch-1 decode pass takes {result['summary']['batch1_decode_unexplained_ms']:.2f} ms more than the "
              "roofline: kernel launches from Python (no CUDA graphs) and kvlab's per-pass work")
    if result["dropped"]:
        print("left out (their block pool does not fit in free memory):", ", ".join(result["dropped"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="llama-3-8b",
                        help="a config in assets/configs (by name) or a path to a config .json")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gpu", default=None,
                        help="the kvlab.simulation.gpus entry to predict for (default: the device's)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--decode-batches", type=int, nargs="+", default=list(DECODE_BATCHES))
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--prefills", type=int, nargs="+", default=list(PREFILLS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("step_time_gpu: no CUDA GPU here; nothing to calibrate (--device cpu checks the script)")
            return 0
    result = run(args)
    print_report(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_time_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / 'step_time_gpu.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
