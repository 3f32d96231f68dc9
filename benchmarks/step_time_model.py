"""The GPU step-time model against measured operators: predicted / measured per operator, per layer and per all-reduce.

kvlab.simulation.step_time predicts each operator's time as a roofline over the GPU's datasheet bandwidth and
FLOP/s with one stated efficiency per operator class. This script sets it against every point of
assets/gpu_profiles (Vidur's measurements on A100-80GB and H100 SXM: Llama-2-7B, Llama-2-70B, Llama-3-8B at
1-32768 tokens and tensor parallelism 1-8, and NCCL all-reduces), then against published end-to-end decode
latencies (gpt-fast's README; PyTorch/IBM's Llama-2-70B blog) and TensorRT-LLM's published first-token latency
and static-batch throughput on A100. It prints per-model tables (ratios at a ladder
of token counts), the all-reduce table, a summary per operator class beside the error the module states
(STATED_ERROR), and the end-to-end comparison; it exits non-zero if a point falls outside the stated error.
Pure arithmetic, under a second. Run from the repository root::

    python benchmarks/step_time_model.py [--all-tokens]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

SHOWN_TOKENS = (1, 16, 64, 256, 1024, 4096, 32768)

# Published batch-1 decode figures. gpt-fast (pytorch-labs/gpt-fast README, "Benchmarks" and "Tensor Parallelism"
# tables): 8x A100-80GB power-limited to 330 W, batch size 1, a 5-token prompt, 200 new tokens by default (so
# about 105 tokens of context on average), torch.compile with CUDA graphs (no per-step host cost).
# PyTorch/IBM blog "PyTorch compile to speed up inference on Llama 2" (pytorch.org, 2023): 29 ms/token for one
# user on Llama-2-70B over 8 A100 GPUs (memory size not stated; taken as 80GB).
PUBLISHED = [
    ("gpt-fast", "Llama-2-7B", 1, 1 / 104.9),
    ("gpt-fast", "Llama-2-7B", 2, 1 / 168.84),
    ("gpt-fast", "Llama-2-7B", 4, 1 / 254.02),
    ("gpt-fast", "Llama-2-7B", 8, 1 / 328.43),
    ("gpt-fast", "Llama-2-70B", 2, 1 / 21.32),
    ("gpt-fast", "Llama-2-70B", 4, 1 / 38.01),
    ("gpt-fast", "Llama-2-70B", 8, 1 / 62.50),
    ("PyTorch/IBM blog", "Llama-2-70B", 8, 29e-3),
]


# NVIDIA/TensorRT-LLM docs/source/performance.md (the version whose throughput data is from v0.6.1): A100 GPUs
# (FP16), "Low Latency" table (batch 1, first-token latency, data from TensorRT-LLM v0.5) and "Peak Throughput"
# table (static batches, output tokens/s). The A100's memory size is not stated; taken as 80GB.
TRT_FIRST_TOKEN = [("Llama-2-7B", 1, 128, 16e-3), ("Llama-2-7B", 1, 2048, 133e-3),
                   ("Llama-2-70B", 4, 128, 47e-3), ("Llama-2-70B", 4, 2048, 377e-3)]
TRT_THROUGHPUT = [("Llama-2-7B", 384, 128, 128, 5586), ("Llama-2-7B", 60, 128, 2048, 1928),
                  ("Llama-2-7B", 52, 2048, 128, 591)]


def static_batch_throughput(model, gpu, batch: int, input_len: int, output_len: int) -> float:
    """Output tokens/s of one static batch: a prefill of every prompt in one pass (it samples the first token),
    then output_len - 1 decode steps of the whole batch, no per-step host cost."""
    from kvlab.simulation.step_time import step_time

    total = step_time(model, gpu, prefills=[(input_len, 0)] * batch, step_overhead_s=0.0).total_s
    for i in range(1, output_len):
        total += step_time(model, gpu, decodes=[input_len + i + 1] * batch, step_overhead_s=0.0).total_s
    return batch * output_len / total


def published_models():
    from kvlab.analysis.kv_size import load_model_config
    from kvlab.simulation.step_time import ModelSpec

    # Llama-2-70B is not among the shipped configs; these are meta-llama/Llama-2-70b-hf's config.json fields.
    llama70 = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
               "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000, "torch_dtype": "float16"}
    return {"Llama-2-7B": ModelSpec.from_config(load_model_config("llama-2-7b"), name="Llama-2-7B"),
            "Llama-2-70B": ModelSpec.from_config(llama70, name="Llama-2-70B")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--all-tokens", action="store_true", help="print every token count, not a ladder")
    args = parser.parse_args(argv)

    from kvlab.simulation.profiles import PROFILED_OPS, allreduce_points, operator_points, ratio_summary
    from kvlab.simulation.step_time import EFFICIENCY, KERNEL_TIME_S, STATED_ERROR, step_time

    points = operator_points()
    by_case = defaultdict(dict)
    for p in points:
        by_case[(p.gpu, p.model, p.tensor_parallel_size, p.num_tokens)][p.op] = p

    print("Efficiencies (share of datasheet bandwidth / FLOP/s): "
          + ", ".join(f"{k} {e.memory:.2f}/{e.flops:.2f}" for k, e in EFFICIENCY.items())
          + f"; {KERNEL_TIME_S * 1e6:.0f} us per kernel")
    print("\n## Per operator: predicted / measured (layer: the sum of the nine per-layer operators, "
          "measured microseconds beside it)")
    for gpu, model in sorted({(g, m) for g, m, _, _ in by_case}):
        tps = sorted({tp for g, m, tp, _ in by_case if (g, m) == (gpu, model)})
        print(f"\n### {model} on {gpu}")
        print("| TP | tokens | " + " | ".join(PROFILED_OPS) + " | layer (measured us) |")
        print("|---|---:|" + "---:|" * (len(PROFILED_OPS) + 1))
        for tp in tps:
            tokens = sorted(t for g, m, p, t in by_case if (g, m, p) == (gpu, model, tp))
            for t in tokens:
                if not args.all_tokens and t not in SHOWN_TOKENS:
                    continue
                ops = by_case[(gpu, model, tp, t)]
                cells = [f"{ops[o].ratio:.2f}" for o in PROFILED_OPS]
                layer = ops["layer"]
                cells.append(f"{layer.ratio:.2f} ({layer.measured_s * 1e6:,.0f})")
                print(f"| {tp} | {t} | " + " | ".join(cells) + " |")

    ar = allreduce_points()
    print("\n## All-reduce (NCCL, one node): predicted / measured, measured microseconds in brackets")
    sizes = sorted({p.num_tokens for p in ar})
    groups = sorted({(p.gpu, p.tensor_parallel_size) for p in ar})
    print("| message | " + " | ".join(f"{g} x{n}" for g, n in groups) + " |")
    print("|---:|" + "---:|" * len(groups))
    table = {(p.gpu, p.tensor_parallel_size, p.num_tokens): p for p in ar}
    for size in sizes:
        cells = [f"{table[(g, n, size)].ratio:.2f} ({table[(g, n, size)].measured_s * 1e6:.0f})"
                 if (g, n, size) in table else "" for g, n in groups]
        label = f"{size / 1024:,.0f} KiB" if size < 1024 ** 2 else f"{size / 1024 ** 2:,.1f} MiB"
        print(f"| {label} | " + " | ".join(cells) + " |")

    print("\n## Summary: predicted / measured over every point, against the stated error (STATED_ERROR)")
    print("| class | points | median | lowest | highest | stated bound | within |")
    print("|---|---:|---:|---:|---:|---|---|")
    outside = 0
    summary = ratio_summary(points + ar)
    for cls, (n, med, lo, hi) in summary.items():
        bound = STATED_ERROR[cls]
        ok = bound[0] <= lo and hi <= bound[1]
        outside += not ok
        print(f"| {cls} | {n} | {med:.2f} | {lo:.2f} | {hi:.2f} | {bound[0]:.2f}-{bound[1]:.2f} | "
              f"{'yes' if ok else 'NO'} |")
    print("\nper GPU (layer sums):")
    for (gpu, cls), (n, med, lo, hi) in ratio_summary(points, key=lambda p: (p.gpu, p.op_class)).items():
        if cls == "layer":
            print(f"  {gpu}: {n} points, median {med:.2f}, range {lo:.2f}-{hi:.2f}")

    held_out = [p for p in points if p.op == "layer"
                and (p.gpu, p.model, p.tensor_parallel_size) != ("A100-80GB", "Llama-2-7b-hf", 1)]
    (n, med, lo, hi), = ratio_summary(held_out).values()
    print(f"  held out (every file but A100 Llama-2-7B TP1, where the efficiencies were read): {n} points, "
          f"median {med:.2f}, range {lo:.2f}-{hi:.2f}")

    print("\n## Published batch-1 decode latency (step overhead 0: both run CUDA graphs, no scheduler), A100-80GB")
    print("| source | model | TP | published ms/token | predicted ms/token | of which all-reduce "
          "| predicted / published |")
    print("|---|---|---:|---:|---:|---:|---:|")
    models = published_models()
    for source, name, tp, seconds in PUBLISHED:
        step = step_time(models[name], "A100-80GB", decodes=[105], tensor_parallel_size=tp, step_overhead_s=0.0)
        comm = step.num_layers * sum(t for op, t in step.per_layer.items() if op.endswith("all_reduce"))
        print(f"| {source} | {name} | {tp} | {seconds * 1e3:.2f} | {step.total_s * 1e3:.2f} | {comm * 1e3:.2f} "
              f"| {step.total_s / seconds:.2f} |")

    print("\n## Published prefill latency and static-batch throughput (TensorRT-LLM performance.md, A100 FP16)")
    print("| model | TP | batch | input | output | published | predicted | predicted / published |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, tp, input_len, seconds in TRT_FIRST_TOKEN:
        pred = step_time(models[name], "A100-80GB", prefills=[(input_len, 0)], tensor_parallel_size=tp,
                         step_overhead_s=0.0).total_s
        print(f"| {name} | {tp} | 1 | {input_len} | 1 | {seconds * 1e3:.0f} ms first token | {pred * 1e3:.0f} ms "
              f"| {pred / seconds:.2f} |")
    for name, batch, input_len, output_len, tokens_per_s in TRT_THROUGHPUT:
        pred = static_batch_throughput(models[name], "A100-80GB", batch, input_len, output_len)
        # Throughput is the inverse of time: predicted time / published time = published / predicted rate.
        print(f"| {name} | 1 | {batch} | {input_len} | {output_len} | {tokens_per_s:,} out tok/s | {pred:,.0f} "
              f"out tok/s | {tokens_per_s / pred:.2f} (time) |")
    if outside:
        print(f"\n{outside} class(es) fall outside the stated error: update STATED_ERROR and the README together")
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
