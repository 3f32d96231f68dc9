"""Chapter 14's bridge to vLLM: kvlab's knobs under vLLM's names, and how many KV blocks vLLM would allocate.

vLLM reserves its whole KV block pool once, at start-up. It loads the weights, runs one forward
pass of the largest batch it will schedule to measure the activation peak, and gives what is left
of its share of the GPU to blocks:

    available  = gpu_memory * gpu_memory_utilization - weights - peak activations
                 - memory outside torch's allocator (CUDA context, NCCL, ...) - CUDA-graph estimate
    block      = block_size * (K and V bytes of one token, all layers)
    num_blocks = floor(available / block)

(The CUDA-graph term is newer V1's estimate of the memory its captured graphs take. With
`kv_cache_memory_bytes` set, vLLM sizes the cache from that many bytes and ignores
gpu_memory_utilization for it, as kvlab's `kv_cache_memory` gives the pool a byte budget.)

Three start-up errors follow, and all three are about memory, not about a bug: the GPU has less
free memory than gpu_memory_utilization x its total (another process holds some), nothing is left
for blocks at all, or the blocks cannot hold one sequence of max_model_len tokens (unless
`--max-model-len auto`, i.e. -1, which lets vLLM shrink the length to what fits).
`vllm_num_kv_blocks` does the arithmetic and `check_vllm_startup` raises those three errors with the
reason spelled out. The weights default to an estimate from the config (parameters x dtype bytes);
vLLM measures them instead, and its activation peak comes from profiling, so both are inputs here.
"""

import html
from dataclasses import dataclass

from kvlab.analysis.kv_size import DTYPE_BYTES, config_dict, dtype_bytes, kv_cache_bytes_per_token
from kvlab.core.paging import num_blocks_needed
from kvlab.validation import check_block_size, check_int, check_number, check_positive_int, is_integer

GiB = 1024 ** 3


# ---------------------------------------------------------------------------------------------
# The knobs.

@dataclass(frozen=True, slots=True)
class Knob:
    """One setting of a paged KV cache, as kvlab and vLLM call it."""

    kvlab: str           # kvlab's name for it
    vllm: str            # vLLM's engine argument (the CLI flag is the same with dashes)
    vllm_default: str    # what vLLM uses when it is not given
    meaning: str         # what it controls, in one or two sentences


KNOBS = [
    Knob("block_size", "block_size", "16",
         "Tokens per KV block. Larger blocks mean fewer block-table entries and longer contiguous reads, "
         "but more unused slots in each sequence's last block. vLLM's CUDA kernels accepted 8, 16 and 32."),
    Knob("num_blocks or kv_cache_memory", "gpu_memory_utilization", "0.92 (0.9 in older releases such as 0.11)",
         "How big the block pool is. kvlab is told how many blocks to allocate, or a byte budget for them; "
         "vLLM is told what fraction of the GPU's total memory it may use in all, "
         "and the part not taken by weights, the profiled activation peak, memory outside torch and "
         "(newer V1) the CUDA-graph estimate becomes blocks (num_gpu_blocks_override sets the count directly). "
         "vLLM refuses to start if less than that fraction of the GPU is free."),
    Knob("kv_cache_memory", "kv_cache_memory_bytes", "None (sized from gpu_memory_utilization)",
         "A byte budget for the KV cache of each GPU, like kvlab's kv_cache_memory; when it is set, vLLM "
         "ignores gpu_memory_utilization for the cache size."),
    Knob("enable_prefix_caching", "enable_prefix_caching", "on in V1, off in V0",
         "Reuse full blocks whose token prefix was already computed, found by a chain of block hashes; "
         "freed blocks stay reusable until they are evicted in LRU order."),
    Knob("max_num_seqs", "max_num_seqs", "depends on version and hardware",
         "The most sequences running at once: the largest decode batch of one step."),
    Knob("max_num_batched_tokens", "max_num_batched_tokens", "depends on version and hardware",
         "The token budget of one forward pass (prefill chunks plus one token per decoding sequence); "
         "it bounds the activation peak that start-up profiles, so it also moves the number of blocks."),
    Knob("preemption_mode (and num_cpu_blocks for swap)", "preemption_mode and swap_space (V0 only)",
         "V1: recompute, with no knob",
         'What happens to a running request when the pool runs out of blocks: "recompute" frees its blocks '
         'and recomputes its tokens later (V1\'s only way); "swap" copies them to CPU memory (V0, swap_space GiB). '
         'V1 logs no warning when it preempts: it counts preemptions (the Prometheus counter vllm:num_preemptions, '
         'and a "Preemptions: N" figure in its periodic stats line); V0 warned on the first and every 50th.'),
    Knob("disable_hybrid_kv_cache_manager", "disable_hybrid_kv_cache_manager",
         "False (newer EngineArgs: None, and vLLM turns it on where a feature needs it)",
         "For a model with sliding-window (or chunked local, or Mamba) layers, whether every layer keeps the K/V of "
         "every token as if all were full attention. Off, the hybrid KV cache manager gives each group of layers "
         "of one attention type its own block tables over one pool and frees the blocks a window has left "
         "(vllm/config/scheduler.py; Chapter 11)."),
    Knob("max_model_len", "max_model_len", "the model config's context length",
         "The longest prompt plus output of one request. Longer prompts are rejected, and start-up fails "
         "if the pool cannot hold one sequence this long; \"auto\" (or -1) makes vLLM shrink it to what fits."),
    Knob("kv_cache_dtype", "kv_cache_dtype", "auto (the model's dtype)",
         "The storage dtype of K and V. vLLM offers fp8 (fp8_e4m3, fp8_e5m2) with per-layer scales, "
         "about twice the tokens of fp16, and (since 2026) KV caches with a scale per token and head: "
         "int8_per_token_head, fp8_per_token_head and int4_per_token_head, besides nvfp4. "
         "kvlab's engine and LLM take \"auto\", \"int8\" or \"fp8_e4m3\" (\"fp8\") with a scale per (block, KV "
         "head), and vLLM's \"int8_per_token_head\" and \"fp8_per_token_head\": the same kv_cache_memory holds "
         "about twice the blocks of fp16."),
]


def knobs_table(fmt: str = "markdown") -> str:
    """KNOBS as a markdown or an HTML table."""
    header = ("kvlab", "vLLM", "vLLM default", "meaning")
    rows = [(k.kvlab, k.vllm, k.vllm_default, k.meaning) for k in KNOBS]
    if fmt == "markdown":
        def cell(text):
            return text.replace("|", "\\|")
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        # The first two columns are names: code font.
        lines += ["| " + " | ".join([f"`{cell(r[0])}`", f"`{cell(r[1])}`", cell(r[2]), cell(r[3])]) + " |"
                  for r in rows]
        return "\n".join(lines)
    if fmt == "html":
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join(
            "<tr>" + f"<td><code>{html.escape(r[0])}</code></td><td><code>{html.escape(r[1])}</code></td>"
            + f"<td>{html.escape(r[2])}</td><td>{html.escape(r[3])}</td></tr>" for r in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    raise ValueError(f"unknown table format {fmt!r}; use 'markdown' or 'html'")


# ---------------------------------------------------------------------------------------------
# Weights: an estimate of the parameter count from the config.

def estimate_num_parameters(config) -> int:
    """Parameters of a Llama, Mistral, Qwen2 or OPT model computed from its config (an estimate for other variants).

    Llama family: embeddings, per layer q/k/v/o projections (Qwen2 adds q/k/v biases), a gated MLP
    of three matrices and two RMSNorms, a final norm, and an output head unless tied to the embeddings.
    OPT: learned positions (2 extra rows), biased projections and MLP, LayerNorms with bias, tied head.
    """
    cfg = config_dict(config)
    model_type = cfg.get("model_type")
    hidden, layers, vocab = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    heads = int(cfg["num_attention_heads"])
    if model_type == "opt":
        ffn = int(cfg["ffn_dim"])
        embed_dim = int(cfg.get("word_embed_proj_dim") or hidden)
        embeddings = vocab * embed_dim + (int(cfg["max_position_embeddings"]) + 2) * hidden
        if embed_dim != hidden:  # OPT-350m projects between the embedding and the model width
            embeddings += 2 * embed_dim * hidden
        attention = 4 * (hidden * hidden + hidden)
        mlp = hidden * ffn + ffn + ffn * hidden + hidden
        norms = 2 * 2 * hidden
        final_norm = 2 * hidden if cfg.get("do_layer_norm_before", True) else 0
        head = 0 if cfg.get("tie_word_embeddings", True) else vocab * embed_dim
        return embeddings + layers * (attention + mlp + norms) + final_norm + head
    if "intermediate_size" not in cfg:
        raise ValueError(
            f"cannot estimate the parameters of a {model_type!r} config: expected a Llama-style config "
            f"(intermediate_size) or OPT (ffn_dim); pass weights_bytes instead"
        )
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    attention = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
    if model_type == "qwen2" or cfg.get("attention_bias"):
        attention += q_out + 2 * kv_out  # q, k, v biases
        if cfg.get("attention_bias") and model_type != "qwen2":
            attention += hidden  # Llama's attention_bias also gives o_proj a bias
    inter = int(cfg["intermediate_size"])
    mlp = 3 * hidden * inter + (2 * inter + hidden if cfg.get("mlp_bias") else 0)
    per_layer = attention + mlp + 2 * hidden  # two RMSNorm weights
    head = 0 if cfg.get("tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + layers * per_layer + hidden + head


def estimate_weights_bytes(config, dtype: str | None = None) -> int:
    """Bytes of the weights: estimated parameters x bytes per element of `dtype` (default: the config's)."""
    return estimate_num_parameters(config) * dtype_bytes(config, dtype)


# ---------------------------------------------------------------------------------------------
# How many blocks.

VLLM_FP8_NAMES = ("fp8", "fp8_e4m3", "fp8_e5m2")
# vLLM's KV dtypes with a scale per token and KV head, and NVIDIA's fp4: real vLLM options whose
# scale bytes this estimate does not model, so the bridge refuses to size them.
VLLM_SCALED_KV_NAMES = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "nvfp4")


def _kv_dtype_name(config, kv_cache_dtype, dtype) -> str:
    """The kv_size dtype name of vLLM's kv_cache_dtype (None or 'auto' means the weights' dtype)."""
    if kv_cache_dtype in (None, "auto"):
        if dtype is not None:
            return str(dtype)
        return str(config.get("torch_dtype") or config.get("dtype") or "float16")
    if kv_cache_dtype in VLLM_FP8_NAMES:
        return "fp8"  # vLLM's fp8 scales are one per layer (k_scale, v_scale): negligible bytes
    name = str(kv_cache_dtype).removeprefix("torch.")
    if name in DTYPE_BYTES and name not in ("int8", "fp8", "float8_e4m3fn", "float8_e5m2"):
        return name
    if name in VLLM_SCALED_KV_NAMES:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is a vLLM option, but its scales (per token and KV head, or "
            f"per 16 values for nvfp4) are not modelled by this estimate; it sizes 'auto', "
            f"{', '.join(map(repr, VLLM_FP8_NAMES))} and float dtypes such as 'float16'"
        )
    hint = ""
    if name == "int8":
        hint = (" (vLLM spells its int8 KV cache 'int8_per_token_head'; kvlab's own engine takes "
                "kv_cache_dtype='int8', see kvlab.cache.kv_storage)")
    raise ValueError(
        f"unsupported kv_cache_dtype {kv_cache_dtype!r} for vLLM's block arithmetic; use 'auto', "
        f"{', '.join(map(repr, VLLM_FP8_NAMES))} or a float dtype such as 'float16'{hint}"
    )


@dataclass(slots=True)
class KVBlockBudget:
    """What vLLM's start-up arithmetic gives for one GPU: the pieces of memory and the blocks they leave."""

    gpu_memory_bytes: int
    gpu_memory_utilization: float
    usable_bytes: int            # gpu_memory_bytes x gpu_memory_utilization
    weights_bytes: int
    activation_peak_bytes: int
    other_bytes: int             # memory outside torch's allocator (CUDA context, NCCL, ...)
    cuda_graph_bytes: int        # newer V1's estimate of the memory its CUDA graphs take
    available_bytes: int         # left for KV blocks; <= 0 means vLLM cannot start
    block_size: int
    bytes_per_token: int         # K and V of one token across all layers
    block_bytes: int             # block_size x bytes_per_token
    num_blocks: int              # 0 when nothing is available
    max_tokens: int              # num_blocks x block_size
    max_model_len: int
    max_concurrency: float       # max_tokens / max_model_len (vLLM logs this at start-up)
    max_full_sequences: int      # sequences of max_model_len tokens that fit at once


def vllm_num_kv_blocks(config, gpu_memory_bytes, gpu_memory_utilization=0.92, weights_bytes=None,
                       activation_peak_bytes=0, block_size=16, kv_cache_dtype=None, other_bytes=0,
                       max_model_len=None, dtype=None, cuda_graph_bytes=0) -> KVBlockBudget:
    """How many KV blocks vLLM would allocate for `config` on one GPU of gpu_memory_bytes.

    weights_bytes defaults to an estimate (estimate_weights_bytes); dtype is the weights' dtype and
    kv_cache_dtype=None/'auto' stores K/V in it (default: the config's dtype). other_bytes is memory
    outside torch's allocator, cuda_graph_bytes the CUDA-graph estimate; both are subtracted.
    gpu_memory_utilization defaults to current vLLM's 0.92 (older releases such as 0.11: 0.9).
    """
    cfg = config_dict(config)
    check_number("gpu_memory_bytes", gpu_memory_bytes, allow_zero=False, what="number of bytes")
    if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)) \
            or not 0 < gpu_memory_utilization <= 1:
        raise ValueError(
            f"gpu_memory_utilization is the fraction of GPU memory vLLM may use, in (0, 1]; "
            f"got {gpu_memory_utilization!r}"
        )
    if not is_integer(block_size) or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a positive power of two (vLLM's default is 16), got {block_size!r}")
    if weights_bytes is None:
        weights_bytes = estimate_weights_bytes(cfg, dtype)
    check_number("weights_bytes", weights_bytes, what="number of bytes")
    check_number("activation_peak_bytes", activation_peak_bytes, what="number of bytes")
    check_number("other_bytes", other_bytes, what="number of bytes")
    check_number("cuda_graph_bytes", cuda_graph_bytes, what="number of bytes")
    if max_model_len is None:
        max_model_len = int(cfg["max_position_embeddings"])
    if not is_integer(max_model_len) or max_model_len < 1:
        raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")

    per_token = kv_cache_bytes_per_token(cfg, _kv_dtype_name(cfg, kv_cache_dtype, dtype))  # all layers, K and V
    block = block_size * per_token
    usable = int(gpu_memory_bytes * gpu_memory_utilization)
    available = int(usable - weights_bytes - activation_peak_bytes - other_bytes - cuda_graph_bytes)
    num_blocks = max(available, 0) // block
    max_tokens = num_blocks * block_size
    blocks_per_seq = num_blocks_needed(max_model_len, block_size)
    return KVBlockBudget(
        gpu_memory_bytes=int(gpu_memory_bytes), gpu_memory_utilization=float(gpu_memory_utilization),
        usable_bytes=usable, weights_bytes=int(weights_bytes), activation_peak_bytes=int(activation_peak_bytes),
        other_bytes=int(other_bytes), cuda_graph_bytes=int(cuda_graph_bytes), available_bytes=available,
        block_size=block_size, bytes_per_token=per_token,
        block_bytes=block, num_blocks=num_blocks, max_tokens=max_tokens, max_model_len=max_model_len,
        max_concurrency=max_tokens / max_model_len, max_full_sequences=num_blocks // blocks_per_seq,
    )


def check_vllm_startup(config, gpu_memory_bytes, gpu_memory_utilization=0.92, max_model_len=None,
                       free_memory_bytes=None, **kwargs) -> KVBlockBudget:
    """vllm_num_kv_blocks, raising ValueError where vLLM refuses to start, in the order vLLM checks:

    1. free_memory_bytes (what the GPU has free at start-up; None skips this check) is less than
       gpu_memory_utilization x gpu_memory_bytes, the share vLLM was told it may use;
    2. nothing is left for KV blocks;
    3. the blocks cannot hold one sequence of max_model_len tokens.
    """
    b = vllm_num_kv_blocks(config, gpu_memory_bytes, gpu_memory_utilization, max_model_len=max_model_len, **kwargs)
    if free_memory_bytes is not None:
        check_number("free_memory_bytes", free_memory_bytes, what="number of bytes")
        if free_memory_bytes > gpu_memory_bytes:
            raise ValueError(
                f"free_memory_bytes ({free_memory_bytes / GiB:.2f} GiB) cannot exceed gpu_memory_bytes "
                f"({gpu_memory_bytes / GiB:.2f} GiB)"
            )
        if free_memory_bytes < b.usable_bytes:
            raise ValueError(
                f"Free memory on device ({free_memory_bytes / GiB:.2f}/{b.gpu_memory_bytes / GiB:.2f} GiB) at "
                f"start-up is less than desired GPU memory utilization ({b.gpu_memory_utilization}, "
                f"{b.usable_bytes / GiB:.2f} GiB): gpu_memory_utilization is a share of the GPU's total memory, "
                f"and other processes hold {(b.gpu_memory_bytes - free_memory_bytes) / GiB:.2f} GiB of it. "
                f"Lower gpu_memory_utilization to at most {free_memory_bytes / b.gpu_memory_bytes:.3f}, or free "
                f"the memory the other processes use."
            )
    if b.available_bytes <= 0:
        raise ValueError(
            f"No available memory for the KV cache blocks: of the {b.usable_bytes / GiB:.2f} GiB vLLM may use "
            f"(gpu_memory_utilization {b.gpu_memory_utilization} x {b.gpu_memory_bytes / GiB:.2f} GiB), the weights "
            f"({b.weights_bytes / GiB:.2f} GiB), the profiled activation peak "
            f"({b.activation_peak_bytes / GiB:.2f} GiB), memory outside torch ({b.other_bytes / GiB:.2f} GiB) "
            f"and the CUDA-graph estimate ({b.cuda_graph_bytes / GiB:.2f} GiB) "
            f"leave {b.available_bytes / GiB:.2f} GiB. "
            f"Try increasing gpu_memory_utilization, or make room: a smaller or quantized model, tensor "
            f"parallelism over more GPUs, or a smaller max_num_batched_tokens (a lower activation peak)."
        )
    if b.max_model_len > b.max_tokens:
        raise ValueError(
            f"max_model_len is {b.max_model_len} tokens, but the KV cache can store at most {b.max_tokens} "
            f"({b.num_blocks} blocks of {b.block_size} in {b.available_bytes / GiB:.2f} GiB): one request of the "
            f"model's max seq len could never be scheduled, so vLLM refuses to start. Try increasing "
            f"gpu_memory_utilization or decreasing max_model_len to at most {b.max_tokens} "
            f"(max_model_len 'auto', or -1, lets vLLM pick the largest length that fits)."
        )
    return b


# ---------------------------------------------------------------------------------------------
# Sliding-window layers: the blocks vLLM V1 frees behind the window.

def vllm_sliding_window_blocks(num_computed_tokens, sliding_window, block_size=16) -> int:
    """Blocks a request still holds in a sliding-window KV-cache group once num_computed_tokens are computed.

    vLLM V1's SlidingWindowManager skips max(0, num_computed_tokens - sliding_window + 1) tokens and
    frees every whole block among them (remove_skipped_blocks puts the null block in its place).
    """
    num_computed_tokens = check_int("num_computed_tokens", num_computed_tokens, 0)
    sliding_window = check_positive_int("sliding_window", sliding_window)
    block_size = check_block_size(block_size)
    skipped_blocks = max(0, num_computed_tokens - sliding_window + 1) // block_size
    return num_blocks_needed(num_computed_tokens, block_size) - skipped_blocks
