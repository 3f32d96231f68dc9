"""How long one engine step of a real model takes on a real GPU: a roofline per operator, summed over the layers.

A step of vLLM's V1 scheduler is ragged: some requests bring a prefill chunk (new prompt tokens after some
already computed), the others one decode token each, all in one forward pass of T tokens. Each operator moves
some bytes through HBM and does some FLOPs; it takes at least bytes / bandwidth and at least FLOPs / peak, and
the larger of the two says whether it is memory-bound or compute-bound (the roofline):

    t(op) = max(bytes / (eta_mem * bandwidth), flops / (eta_flops * peak)) + KERNEL_TIME_S * kernels

The operators are one transformer layer's, under the names Vidur (Agrawal et al., MLSys 2024) profiles:
input_layernorm, attn_pre_proj (the fused QKV projection), attn_rope, attn_kv_cache_save (vLLM's
reshape_and_cache), attn_prefill and attn_decode (the attention kernel over the cached K/V),
attn_post_proj (o_proj), post_attention_layernorm, mlp_up_proj (gate and up fused), mlp_act, mlp_down_proj,
add (the residual adds); once per step: emb, the final norm and lm_head on the rows that sample.
Tensor parallelism over p GPUs (vLLM's Column/RowParallelLinear) divides each rank's weights, heads and FLOPs
by p and adds two all-reduces of the T x hidden activations per layer (after o_proj and after the MLP).
A fixed per-step cost stands for what is not a kernel: scheduling, input preparation, sampling.

The efficiencies (EFFICIENCY, one per operator class) and KERNEL_TIME_S are stated constants, chosen once as
round figures from one profile (Vidur's A100, Llama-2-7B, one GPU); the other profiles in assets/gpu_profiles
(H100, Llama-2-70B, Llama-3-8B, tensor parallelism 2-8) test them. STATED_ERROR holds the error the benchmark
(benchmarks/step_time_model.py) measures over every point, and tests/simulation check every point against it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvlab.analysis.kv_size import config_dict, dtype_bytes, kv_heads_per_gpu, kv_shape
from kvlab.simulation.gpus import GPU, get_gpu
from kvlab.validation import check_int, check_number, check_positive_int

# ---------------------------------------------------------------------------------------------
# The stated constants.


@dataclass(frozen=True, slots=True)
class Efficiency:
    """The share of the datasheet bandwidth and FLOP/s that one class of operator reaches."""

    memory: float
    flops: float
    why: str


# Chosen once from Vidur's A100 Llama-2-7B single-GPU profile (the median of measured / datasheet roofline
# where the class is bound), rounded; not fitted per point, not per GPU. Attention has no measured profile
# in the data: its figures come from the FlashAttention-2 paper instead (Dao, 2023: the forward pass reaches
# 50-73% of the A100's peak FLOP/s), and streaming the cache is taken to run as well as a GEMV streams weights.
EFFICIENCY = {
    "matmul": Efficiency(0.75, 0.70, "cuBLAS GEMMs: about 3/4 of the bandwidth streaming weights at small "
                                     "batches, about 70% of the tensor peak at large ones"),
    "attention": Efficiency(0.75, 0.60, "FlashAttention-2 forward: 50-73% of peak FLOP/s (paper); K/V streamed "
                                        "like weights (no attention profile in the data to check it)"),
    "norm": Efficiency(0.33, 1.0, "RMSNorm/LayerNorm kernels: a reduction per token, about a third of the bandwidth"),
    "activation": Efficiency(0.50, 1.0, "SiLU-and-mul / GELU: one elementwise pass"),
    "elementwise": Efficiency(0.95, 1.0, "residual add and the K/V cache write: plain streaming"),
    "rope": Efficiency(0.45, 1.0, "rotary embedding: cos/sin lookups per position, in place on Q and K"),
    "embedding": Efficiency(0.14, 1.0, "vocab-parallel embedding: a gather plus masking kernels"),
}

# The fixed GPU-side cost of a kernel: in Vidur's profiles an elementwise kernel of one token takes 1-8 us (a few
# up to 22 us); 3 us is taken for every kernel.
KERNEL_TIME_S = 3e-6

# cuBLAS/CUTLASS tiles the token dimension of a GEMM in blocks of 128 rows (64 for the smallest): a GEMM of
# 129 tokens costs the FLOPs of 256. Applied to the FLOP term only.
GEMM_TILE_ROWS = 128

# The all-reduce over the tensor-parallel group, NCCL's ring: each GPU sends and receives 2 (p - 1) / p of the
# message over its link. Latency and link efficiency come from Vidur's all-reduce measurements on DGX A100 and
# H100 nodes (assets/gpu_profiles/network_*.csv): messages under 64 KiB take 10-60 us (25 us median), and large
# ones reach 52-75% of NVLink's one-way datasheet bandwidth.
ALLREDUCE_LATENCY_S = 25e-6
LINK_EFFICIENCY = 0.6

# What a step costs beyond its kernels: vLLM V0 left the GPU idle about 4 ms per decode step while the CPU
# scheduled, prepared inputs and processed outputs (vLLM issue #6854, "[RFC]: Multi-Step Scheduling", July 2024).
# V1's asynchronous scheduling overlaps most of it with the GPU; a fully captured graph (gpt-fast) has none.
DEFAULT_STEP_OVERHEAD_S = 4e-3

# The error the benchmark measures (predicted / measured over every point of assets/gpu_profiles): the lowest
# and highest ratio per operator class, per layer (the sum of the profiled operators), and for the all-reduce.
# benchmarks/README.md quotes these; tests/simulation check every point against them.
STATED_ERROR = {
    "matmul": (0.45, 1.35),
    "norm": (0.35, 1.85),
    "activation": (0.12, 3.10),
    "elementwise": (0.85, 3.45),
    "rope": (0.45, 1.95),
    "embedding": (0.25, 1.60),
    "layer": (0.70, 1.20),
    "all_reduce": (0.35, 3.70),
}


# ---------------------------------------------------------------------------------------------
# The model.

_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a decoder-only transformer that the step time depends on."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    gated_mlp: bool           # SiLU-and-mul over a fused gate/up projection (Llama family) or one up projection (OPT)
    vocab_size: int
    dtype_bytes: int          # bytes per weight and activation element
    rope: bool = True         # rotary embeddings (OPT adds learned positions in the embedding instead)

    @classmethod
    def from_config(cls, config, dtype: str | None = None, name: str | None = None) -> ModelSpec:
        """A ModelSpec from a Hugging Face config (dict, path or transformers config); dtype overrides torch_dtype."""
        cfg = config_dict(config)
        missing = [f for f in _REQUIRED if cfg.get(f) is None]
        if cfg.get("model_type") == "opt":
            missing += [] if cfg.get("ffn_dim") else ["ffn_dim"]
        elif cfg.get("intermediate_size") is None:
            missing.append("intermediate_size")
        if missing:
            raise KeyError(
                f"the model config lacks {', '.join(map(repr, missing))}, which the step-time model needs "
                f"(a Llama/Mistral/Qwen2-style config with intermediate_size, or OPT with ffn_dim)"
            )
        shape = kv_shape(cfg)
        opt = cfg.get("model_type") == "opt"
        return cls(
            name=name or cfg.get("_source", cfg.get("model_type", "model")).split(" ")[0],
            num_layers=check_positive_int("num_hidden_layers", cfg["num_hidden_layers"]),
            hidden_size=check_positive_int("hidden_size", cfg["hidden_size"]),
            num_heads=check_positive_int("num_attention_heads", cfg["num_attention_heads"]),
            num_kv_heads=check_positive_int("num_key_value_heads", shape["num_kv_heads"]),
            head_dim=check_positive_int("head_dim", shape["head_dim"]),
            intermediate_size=check_positive_int("ffn_dim" if opt else "intermediate_size",
                                                 cfg["ffn_dim"] if opt else cfg["intermediate_size"]),
            gated_mlp=not opt,
            vocab_size=check_positive_int("vocab_size", cfg["vocab_size"]),
            dtype_bytes=dtype_bytes(cfg, dtype),
            rope=not opt,
        )

    def heads_per_gpu(self, tensor_parallel_size: int) -> tuple[int, int]:
        """(query heads, KV heads) each tensor-parallel rank holds; ValueError where the heads do not split."""
        tp = check_positive_int("tensor_parallel_size", tensor_parallel_size)
        if self.num_heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the {self.num_heads} attention heads of "
                             f"{self.name}; vLLM requires it to")
        kv = kv_heads_per_gpu({"num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                               "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim}, tp)
        return self.num_heads // tp, kv


# ---------------------------------------------------------------------------------------------
# Operators.


@dataclass(frozen=True, slots=True)
class Op:
    """One operator of a step on one GPU: the bytes it moves through HBM and the FLOPs it does."""

    name: str
    op_class: str          # a key of EFFICIENCY, or "all_reduce"
    bytes: float
    flops: float = 0.0
    kernels: int = 1
    message_bytes: float = 0.0   # all-reduce only: the activations each rank contributes


def _gemm(name: str, tokens: int, k: int, n: int, b: int) -> Op:
    """A [tokens, k] x [k, n] GEMM: the weight read once, input read and output written once."""
    rows = math.ceil(tokens / GEMM_TILE_ROWS) * GEMM_TILE_ROWS if tokens else 0
    return Op(name, "matmul", b * (k * n + tokens * k + tokens * n), 2.0 * rows * k * n)


def layer_ops(model: ModelSpec, num_tokens: int, tensor_parallel_size: int = 1,
              prefills: Sequence[tuple[int, int]] = (), decodes: Sequence[int] = (),
              kv_dtype_bytes: int | None = None) -> list[Op]:
    """The operators of one layer on one rank for a step of num_tokens tokens (attention from prefills and decodes)."""
    t = check_int("num_tokens", num_tokens, 0)
    tp = check_positive_int("tensor_parallel_size", tensor_parallel_size)
    heads, kv_heads = model.heads_per_gpu(tp)
    b, h, d = model.dtype_bytes, model.hidden_size, model.head_dim
    kvb = b if kv_dtype_bytes is None else kv_dtype_bytes
    q_width, kv_width = heads * d, kv_heads * d
    inter = math.ceil(model.intermediate_size / tp)
    ops = [
        Op("input_layernorm", "norm", b * (2 * t * h + h)),
        _gemm("attn_pre_proj", t, h, q_width + 2 * kv_width, b),
    ]
    if model.rope:
        ops.append(Op("attn_rope", "rope", b * (2 * t * (q_width + kv_width) + t * d)))
    ops.append(Op("attn_kv_cache_save", "elementwise", t * 2 * kv_width * (b + kvb)))
    if prefills:
        pairs = sum(q * c + q * (q + 1) // 2 for q, c in prefills)  # causal (query, key) pairs
        kv_read = sum((q + c) * 2 * kv_width * kvb for q, c in prefills)
        q_io = sum(2 * q * q_width * b for q, _ in prefills)
        ops.append(Op("attn_prefill", "attention", kv_read + q_io, 4.0 * pairs * q_width))
    if decodes:
        ctx = sum(decodes)
        ops.append(Op("attn_decode", "attention", ctx * 2 * kv_width * kvb + len(decodes) * 2 * q_width * b,
                      4.0 * ctx * q_width))
    ops.append(_gemm("attn_post_proj", t, q_width, h, b))
    if tp > 1:
        ops.append(Op("attn_all_reduce", "all_reduce", 0.0, message_bytes=t * h * b))
    ops += [
        Op("post_attention_layernorm", "norm", b * (2 * t * h + h)),
        _gemm("mlp_up_proj", t, h, (2 if model.gated_mlp else 1) * inter, b),
        Op("mlp_act", "activation", b * t * (3 if model.gated_mlp else 2) * inter),
        _gemm("mlp_down_proj", t, inter, h, b),
    ]
    if tp > 1:
        ops.append(Op("mlp_all_reduce", "all_reduce", 0.0, message_bytes=t * h * b))
    # Two residual adds per layer (vLLM fuses them into its norms; the bytes are the same).
    ops.append(Op("add", "elementwise", 2 * b * 3 * t * h, kernels=2))
    return ops


def embedding_op(model: ModelSpec, num_tokens: int) -> Op:
    """The embedding lookup of a step: each token's row read and written (OPT adds a learned position row too)."""
    t = check_int("num_tokens", num_tokens, 0)
    return Op("emb", "embedding", model.dtype_bytes * 2 * t * model.hidden_size * (1 if model.rope else 2))


def op_seconds(op: Op, gpu: GPU | str, tensor_parallel_size: int = 1) -> float:
    """The roofline time of one operator on one GPU (an all-reduce's over the tensor-parallel group)."""
    gpu = get_gpu(gpu)
    if op.op_class == "all_reduce":
        return allreduce_seconds(op.message_bytes, tensor_parallel_size, gpu)
    eff = EFFICIENCY[op.op_class]
    memory = op.bytes / (eff.memory * gpu.memory_bytes_per_s)
    compute = op.flops / (eff.flops * gpu.flops_per_s)
    return max(memory, compute) + KERNEL_TIME_S * op.kernels


def op_bound(op: Op, gpu: GPU | str) -> str:
    """'memory', 'compute' or 'communication': which term of the roofline decides the operator's time."""
    gpu = get_gpu(gpu)
    if op.op_class == "all_reduce":
        return "communication"
    eff = EFFICIENCY[op.op_class]
    return "compute" if op.flops / (eff.flops * gpu.flops_per_s) > op.bytes / (eff.memory * gpu.memory_bytes_per_s) \
        else "memory"


def allreduce_seconds(message_bytes: float, tensor_parallel_size: int, gpu: GPU | str) -> float:
    """NCCL ring all-reduce of message_bytes over tensor_parallel_size GPUs: latency + 2 (p-1)/p x bytes / link."""
    p = check_positive_int("tensor_parallel_size", tensor_parallel_size)
    check_number("message_bytes", message_bytes, what="number of bytes")
    if p == 1:
        return 0.0
    gpu = get_gpu(gpu)
    return ALLREDUCE_LATENCY_S + 2 * (p - 1) / p * message_bytes / (LINK_EFFICIENCY * gpu.link_bytes_per_s)


# ---------------------------------------------------------------------------------------------
# A step.


@dataclass(slots=True)
class StepTime:
    """The predicted time of one step: each operator of one layer, the once-per-step operators and the fixed cost."""

    per_layer: dict[str, float]          # seconds of each operator in one layer
    once: dict[str, float]               # emb, norm, lm_head: seconds, once per step
    num_layers: int
    overhead_s: float
    bounds: dict[str, str] = field(default_factory=dict)   # operator -> memory / compute / communication

    @property
    def layer_s(self) -> float:
        return sum(self.per_layer.values())

    @property
    def total_s(self) -> float:
        return self.num_layers * self.layer_s + sum(self.once.values()) + self.overhead_s


def _check_step(prefills: Iterable, decodes: Iterable) -> tuple[list[tuple[int, int]], list[int]]:
    chunks = []
    for i, chunk in enumerate(prefills):
        if not isinstance(chunk, (tuple, list)) or len(chunk) != 2:
            raise ValueError(f"prefills[{i}] must be (num_new_tokens, num_computed_tokens), got {chunk!r}")
        chunks.append((check_positive_int(f"prefills[{i}] num_new_tokens", chunk[0]),
                       check_int(f"prefills[{i}] num_computed_tokens", chunk[1], 0)))
    contexts = [check_positive_int(f"decodes[{i}] (context length, the new token included)", c)
                for i, c in enumerate(decodes)]
    if not chunks and not contexts:
        raise ValueError("a step carries at least one token: give prefills=[(new, computed), ...] or decodes=[...]")
    return chunks, contexts


def step_time(model: ModelSpec, gpu: GPU | str, prefills: Iterable[tuple[int, int]] = (),
              decodes: Iterable[int] = (), tensor_parallel_size: int = 1, num_sampled: int | None = None,
              kv_dtype_bytes: int | None = None, step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S) -> StepTime:
    """The time of one ragged step: prefill chunks (num_new_tokens, num_computed_tokens) and decodes (context lengths).

    num_sampled is the number of rows the LM head computes (default: one per decode and per prefill chunk;
    vLLM computes logits only for requests that sample this step). kv_dtype_bytes is the KV cache's element
    size (default: the model's; 1 for an fp8 cache).
    """
    gpu = get_gpu(gpu)
    chunks, contexts = _check_step(prefills, decodes)
    tp = check_positive_int("tensor_parallel_size", tensor_parallel_size)
    check_number("step_overhead_s", step_overhead_s, what="number of seconds")
    tokens = sum(q for q, _ in chunks) + len(contexts)
    rows = len(chunks) + len(contexts) if num_sampled is None else check_int("num_sampled", num_sampled, 0)
    ops = layer_ops(model, tokens, tp, chunks, contexts, kv_dtype_bytes)
    per_layer = {op.name: op_seconds(op, gpu, tp) for op in ops}
    bounds = {op.name: op_bound(op, gpu) for op in ops}
    b, h = model.dtype_bytes, model.hidden_size
    once_ops = [embedding_op(model, tokens), Op("norm", "norm", b * (2 * tokens * h + h))]
    if rows:
        once_ops.append(_gemm("lm_head", rows, h, math.ceil(model.vocab_size / tp), b))
    once = {op.name: op_seconds(op, gpu, tp) for op in once_ops}
    bounds.update({op.name: op_bound(op, gpu) for op in once_ops})
    return StepTime(per_layer, once, model.num_layers, float(step_overhead_s), bounds)


def weight_bytes_per_gpu(model: ModelSpec, tensor_parallel_size: int = 1) -> int:
    """Bytes of the weights each rank reads in a step: every layer's matrices and the LM head (its vocabulary share)."""
    tp = check_positive_int("tensor_parallel_size", tensor_parallel_size)
    heads, kv_heads = model.heads_per_gpu(tp)
    h, d = model.hidden_size, model.head_dim
    inter = math.ceil(model.intermediate_size / tp)
    per_layer = h * (heads + 2 * kv_heads) * d + heads * d * h + (3 if model.gated_mlp else 2) * h * inter
    return model.dtype_bytes * (model.num_layers * per_layer + math.ceil(model.vocab_size / tp) * h)
