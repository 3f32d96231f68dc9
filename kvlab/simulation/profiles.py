"""The step-time model against real GPUs: Vidur's measured operator and all-reduce times, predicted / measured.

assets/gpu_profiles/ holds a subset of the profiles Vidur (Agrawal et al., MLSys 2024, MIT) measured on A100
and H100 GPUs for Llama-2-7B, Llama-2-70B and Llama-3-8B at token counts 1-32768 and tensor parallelism 1-8,
and NCCL all-reduce times on one DGX node. Vidur times each operator's CUDA kernels alone (no launch gaps),
in fp16, with the model's real shapes (its vocabulary padded to 32768 for Llama-2). Attention was not
profiled, so the attention operators of the model are not checked here.

Vidur's "a100" is its A100 80GB SKU (its device config: 80 GB, the DGX A100 640GB node); "h100" the H100 SXM.
"""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from dataclasses import dataclass

from kvlab.paths import ASSETS_DIR
from kvlab.simulation.gpus import GPUS
from kvlab.simulation.step_time import (
    ModelSpec,
    Op,
    allreduce_seconds,
    embedding_op,
    layer_ops,
    op_seconds,
)

PROFILES_DIR = ASSETS_DIR / "gpu_profiles"
VIDUR_GPUS = {"a100": "A100-80GB", "h100": "H100-SXM"}

# The operators Vidur times in one layer (emb is once per step and kept apart from the layer's sum).
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
PROFILED_OPS = ("emb",) + LAYER_OPS


@dataclass(frozen=True, slots=True)
class Point:
    """One measured operator (or a layer's sum, or an all-reduce) beside the model's prediction, in seconds."""

    gpu: str
    model: str
    tensor_parallel_size: int
    num_tokens: int          # for an all-reduce: its message in bytes
    op: str                  # an operator name, "layer" or "all_reduce"
    op_class: str
    predicted_s: float
    measured_s: float

    @property
    def ratio(self) -> float:
        """predicted / measured."""
        return self.predicted_s / self.measured_s


def _spec(row: dict) -> ModelSpec:
    heads, hidden = int(row["n_head"]), int(row["n_embd"])
    return ModelSpec(name=row["model"], num_layers=1, hidden_size=hidden, num_heads=heads,
                     num_kv_heads=int(row["n_kv_head"]), head_dim=hidden // heads,
                     intermediate_size=int(row["n_expanded_embd"]), gated_mlp=row["use_gated_mlp"] == "True",
                     vocab_size=int(row["vocab_size"]), dtype_bytes=2)


def profiled_ops(model: ModelSpec, num_tokens: int, tensor_parallel_size: int) -> dict[str, Op]:
    """The model's operators as Vidur profiled them: no attention, no all-reduce, one residual add."""
    ops = {op.name: op for op in layer_ops(model, num_tokens, tensor_parallel_size)}
    add = ops["add"]
    ops["add"] = Op("add", add.op_class, add.bytes / 2, kernels=1)
    ops["emb"] = embedding_op(model, num_tokens)
    return {name: ops[name] for name in PROFILED_OPS}


def operator_points(path=None) -> list[Point]:
    """Every operator and layer sum of operators.csv, predicted beside measured."""
    points = []
    with open(path or PROFILES_DIR / "operators.csv", newline="") as f:
        for row in csv.DictReader(f):
            gpu = GPUS[VIDUR_GPUS[row["gpu"]]]
            tp, tokens = int(row["tensor_parallel_size"]), int(row["num_tokens"])
            ops = profiled_ops(_spec(row), tokens, tp)
            layer_pred = layer_meas = 0.0
            for name, op in ops.items():
                pred, meas = op_seconds(op, gpu, tp), float(row[f"{name}_ms"]) / 1e3
                points.append(Point(gpu.name, row["model"], tp, tokens, name, op.op_class, pred, meas))
                if name in LAYER_OPS:
                    layer_pred, layer_meas = layer_pred + pred, layer_meas + meas
            points.append(Point(gpu.name, row["model"], tp, tokens, "layer", "layer", layer_pred, layer_meas))
    return points


def allreduce_points(path=None) -> list[Point]:
    """Every all-reduce of all_reduce.csv, predicted beside measured (num_tokens holds the message bytes)."""
    points = []
    with open(path or PROFILES_DIR / "all_reduce.csv", newline="") as f:
        for row in csv.DictReader(f):
            gpu = GPUS[VIDUR_GPUS[row["gpu"]]]
            p, size = int(row["num_workers"]), int(row["size_bytes"])
            points.append(Point(gpu.name, "-", p, size, "all_reduce", "all_reduce",
                                allreduce_seconds(size, p, gpu), float(row["all_reduce_ms"]) / 1e3))
    return points


def ratio_summary(points: list[Point], key=lambda p: p.op_class) -> dict:
    """{key: (count, median, lowest, highest predicted / measured)} over the points."""
    groups = defaultdict(list)
    for p in points:
        groups[key(p)].append(p.ratio)
    return {k: (len(v), statistics.median(v), min(v), max(v)) for k, v in sorted(groups.items())}
