"""The checks every kernel call shares, and the one shape type they return.

A kernel reads raw pointers: a wrong dtype, shape, stride or table entry reads junk memory (or crashes
the GPU) instead of raising. So every public entry point validates its inputs first, on the host, and
raises a ValueError that names the input and what was expected; the launchers then trust the
PagedAttentionShape that validation returned and never sync with the device.

    shape = validate_paged_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    shape = validate_paged_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens)   # one token per sequence
"""

import math
from dataclasses import dataclass

import torch

from kvlab.validation import check_sliding_window

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # 256 x a tile of 64 fp32 values is as much as a program should hold


@dataclass(slots=True, frozen=True)
class PagedAttentionShape:
    """What validation learned about one call: sizes, the longest sequence and the softmax scale.

    A decode call (validate_paged_decode_inputs) has one new token per sequence: num_tokens == num_seqs.
    """

    num_tokens: int
    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    max_blocks_per_seq: int
    max_seq_len: int      # longest sequence in the batch (0 for an empty batch)
    scale: float
    quantized: bool       # int8 / fp8 pools, read with k_scale and v_scale
    sliding_window: int | None = None   # W: each query sees its last W positions; None: full attention


def quantized_cache_dtypes() -> tuple[torch.dtype, ...]:
    """Pool dtypes read with k_scale / v_scale: int8, and torch.float8_e4m3fn where this torch has it (2.1+)."""
    # Looked up at call time, like kvlab.quantization does, so a torch without float8 is told so clearly.
    fp8 = getattr(torch, "float8_e4m3fn", None)
    return (torch.int8,) if fp8 is None else (torch.int8, fp8)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cache_dtypes_hint() -> str:
    if len(quantized_cache_dtypes()) == 2:
        return "use float32, float16 or bfloat16, or int8 / float8_e4m3fn pools with k_scale and v_scale"
    return (f"use float32, float16 or bfloat16, or int8 pools with k_scale and v_scale (fp8 pools need "
            f"torch.float8_e4m3fn, which torch {torch.__version__} does not have: it arrived in torch 2.1)")


def _check_kv_scales(k_cache, k_scale, v_scale, num_blocks: int, num_kv_heads: int) -> None:
    """Scales come with 8-bit pools and only with them: float32 [num_blocks, num_kv_heads], contiguous, > 0 and
    finite."""
    quantized = k_cache.dtype in quantized_cache_dtypes()
    cache_dtype = dtype_name(k_cache.dtype)
    if not quantized:
        given = [name for name, t in (("k_scale", k_scale), ("v_scale", v_scale)) if t is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} given, but the caches are {cache_dtype}: scales are only for "
                             f"int8 or fp8 pools (leave k_scale and v_scale as None)")
        return
    missing = [name for name, t in (("k_scale", k_scale), ("v_scale", v_scale)) if t is None]
    if missing:
        raise ValueError(f"the caches are {cache_dtype}, so k_scale and v_scale are required ({' and '.join(missing)} "
                         f"missing): float32 [num_blocks, num_kv_heads] = [{num_blocks}, {num_kv_heads}], real value = "
                         f"stored * scale (an 8-bit PagedKVCache keeps them in k_scales[layer] and v_scales[layer])")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [num_blocks, num_kv_heads] of float32; "
                            f"got {type(s).__name__}")
        if s.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 (what the kernel reads); got {dtype_name(s.dtype)}")
        if tuple(s.shape) != (num_blocks, num_kv_heads):
            raise ValueError(f"{name} must have shape [num_blocks, num_kv_heads] = ({num_blocks}, {num_kv_heads}), "
                             f"one scale per (physical block, KV head); got {tuple(s.shape)}")
        if s.device != k_cache.device:
            raise ValueError(f"{name} is on {s.device} but the caches are on {k_cache.device}: "
                             f"all inputs must be on one device")
        if not s.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel reads scale[block, kv_head] at "
                             f"block * num_kv_heads + kv_head); got strides {s.stride()} (call .contiguous())")
        bad = ~(torch.isfinite(s) & (s > 0))
        if bad.any():
            i, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"{name}[{i}, {j}] is {float(s[i, j])}: every scale must be positive and finite "
                             f"(real value = stored * scale; an all-zero block still needs a scale > 0)")


def check_query_and_pools(named, q, k_cache, v_cache, k_scale=None, v_scale=None, q_dims="num_seqs") -> None:
    """The checks every kernel call shares: tensors, shapes, one device, dtypes, head counts, strides and scales.

    named: (name, tensor) of every input, for the type and device checks; q_dims names q's first dim.
    """
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if q.ndim != 3:
        raise ValueError(f"q must have 3 dims [{q_dims}, num_heads, head_dim]; got shape {tuple(q.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.ndim != 4:
            raise ValueError(f"{name} must have 4 dims [num_blocks, block_size, num_kv_heads, head_dim]; "
                             f"got shape {tuple(cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape; got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    devices = {name: t.device for name, t in named}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"all inputs must be on one device; got {listed}")

    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q has dtype {dtype_name(q.dtype)}, which is not supported: use float32, float16 or "
                         f"bfloat16 (only the pools may be 8-bit, with k_scale and v_scale)")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype not in SUPPORTED_DTYPES + quantized_cache_dtypes():
            raise ValueError(f"{name} has dtype {dtype_name(cache.dtype)}, which is not supported: "
                             f"{_cache_dtypes_hint()}")
    quantized = k_cache.dtype in quantized_cache_dtypes()
    if k_cache.dtype != v_cache.dtype or not (quantized or q.dtype == k_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share one dtype (or the pools share one 8-bit dtype); got "
                         f"{dtype_name(q.dtype)}, {dtype_name(k_cache.dtype)} and {dtype_name(v_cache.dtype)}")

    num_heads, head_dim = q.shape[1], q.shape[2]
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if head_dim != cache_head_dim:
        raise ValueError(f"q has head_dim {head_dim} but the caches have head_dim {cache_head_dim}")
    if num_kv_heads < 1 or num_heads < 1:
        raise ValueError(f"need at least one head; got num_heads {num_heads} and num_kv_heads {num_kv_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}): "
                         f"every KV head serves the same number of query heads (GQA; MQA is num_kv_heads = 1)")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} is not supported: it must be a power of two (1, 2, 4, ..., 16, ...)")
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not supported: it must be between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"k_cache and v_cache must have the same strides and a contiguous head_dim; got strides "
                         f"{k_cache.stride()} and {v_cache.stride()} (call .contiguous() on the pools once)")
    _check_kv_scales(k_cache, k_scale, v_scale, num_blocks, num_kv_heads)


def resolve_scale(scale, head_dim: int) -> float:
    """The softmax scale: head_dim ** -0.5 unless given; ValueError unless finite."""
    scale = head_dim ** -0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number; got {scale}")
    return scale


def check_tables(block_tables, lens, block_size: int, num_blocks: int, first_seen=None) -> None:
    """Each sequence fits its table row, and every entry it uses names a block of the pool (lens: int64 [num_seqs]).

    Only the entries a sequence uses must name real blocks; the rest of its row may hold anything. first_seen
    (int64 [num_seqs], sliding windows): the lowest position any of its queries sees; entries of blocks wholly
    before it are not used either (vLLM puts its null block there once it frees them).
    """
    max_blocks_per_seq = block_tables.shape[1]
    capacity = max_blocks_per_seq * block_size
    if (lens > capacity).any():
        i = int((lens > capacity).nonzero()[0, 0])
        raise ValueError(f"seq_lens[{i}] is {int(lens[i])} but a block table row holds only {max_blocks_per_seq} "
                         f"blocks of {block_size} = {capacity} tokens")
    blocks_used = (lens + block_size - 1) // block_size                         # [num_seqs]
    entry = torch.arange(max_blocks_per_seq, device=lens.device)[None, :]
    used = entry < blocks_used[:, None]                                         # [num_seqs, max_blocks]
    if first_seen is not None:
        used &= entry >= (first_seen // block_size)[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bad.any():
        i, j = (int(x) for x in bad.nonzero()[0])
        uses = f"its first {int(blocks_used[i])} entries" if first_seen is None else (
            f"entries {int(first_seen[i]) // block_size} to {int(blocks_used[i]) - 1}, the blocks its queries' "
            f"windows reach")
        raise ValueError(f"block_tables[{i}, {j}] is {int(block_tables[i, j])}, outside the pool of {num_blocks} "
                         f"blocks (sequence {i} has {int(lens[i])} tokens and uses {uses})")


def validate_paged_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc=None, scale=None,
                                    k_scale=None, v_scale=None, sliding_window=None) -> PagedAttentionShape:
    """Check a call's inputs without launching anything; raise ValueError naming what is wrong.

    q: [num_tokens, num_heads, head_dim], each sequence's new tokens end to end; k_cache, v_cache:
    [num_blocks, block_size, num_kv_heads, head_dim]; block_tables int32 [num_seqs, max_blocks_per_seq];
    seq_lens int32 [num_seqs], the new tokens included; query_start_loc int32 [num_seqs + 1], or None for a
    decode (q is then [num_seqs, num_heads, head_dim], one new token per sequence). Quantized pools (int8,
    or float8_e4m3fn where torch has it) also need k_scale and v_scale: float32 [num_blocks, num_kv_heads],
    contiguous, positive and finite; q stays float32, float16 or bfloat16. sliding_window: None (full
    attention) or a positive int W; table entries wholly before every query's window are then not checked.
    """
    sliding_window = check_sliding_window(sliding_window)
    decode = query_start_loc is None
    named = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
             ("seq_lens", seq_lens)) + (() if decode else (("query_start_loc", query_start_loc),))
    check_query_and_pools(named, q, k_cache, v_cache, k_scale, v_scale, q_dims="num_seqs" if decode else "num_tokens")
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    for name, t, dims in (("block_tables", block_tables, "[num_seqs, max_blocks_per_seq]"),
                          ("seq_lens", seq_lens, "[num_seqs]")) + \
            (() if decode else (("query_start_loc", query_start_loc, "[num_seqs + 1]"),)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 (what the kernel reads); got {dtype_name(t.dtype)}")
    if decode:
        for name, t, dims in (("block_tables", block_tables, "[num_seqs, max_blocks_per_seq]"),
                              ("seq_lens", seq_lens, "[num_seqs]")):
            if t.ndim != dims.count(",") + 1 or t.shape[0] != num_tokens:
                raise ValueError(f"{name} must have shape {dims} with num_seqs = {num_tokens} (q's first dim); "
                                 f"got {tuple(t.shape)}")
    else:
        if seq_lens.ndim != 1:
            raise ValueError(f"seq_lens must have shape [num_seqs]; got {tuple(seq_lens.shape)}")
        num_seqs = seq_lens.shape[0]
        if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
            raise ValueError(f"block_tables must have shape [num_seqs, max_blocks_per_seq] with num_seqs = "
                             f"{num_seqs}; got {tuple(block_tables.shape)}")
        if tuple(query_start_loc.shape) != (num_seqs + 1,):
            raise ValueError(f"query_start_loc must have shape [num_seqs + 1] = [{num_seqs + 1}]; "
                             f"got {tuple(query_start_loc.shape)}")
    num_seqs = seq_lens.shape[0]
    max_blocks_per_seq = block_tables.shape[1]
    scale = resolve_scale(scale, head_dim)
    quantized = k_cache.dtype in quantized_cache_dtypes()
    if num_seqs == 0:
        return PagedAttentionShape(num_tokens, 0, num_heads, num_kv_heads, head_dim, num_blocks, block_size,
                                   max_blocks_per_seq, 0, scale, quantized, sliding_window)
    lens = seq_lens.long()
    q_lens = torch.ones_like(lens)
    if decode:
        if (lens < 1).any():
            i = int((lens < 1).nonzero()[0, 0])
            raise ValueError(f"seq_lens[{i}] is {int(lens[i])}: every sequence needs at least 1 token "
                             f"(the decode query attends over its own key too)")
    else:
        starts = query_start_loc.long()
        if int(starts[0]) != 0 or int(starts[-1]) != num_tokens:
            raise ValueError(f"query_start_loc must run from 0 to num_tokens = {num_tokens} (q's first dim); "
                             f"got {int(starts[0])} ... {int(starts[-1])}")
        q_lens = starts[1:] - starts[:-1]
        if (q_lens < 0).any():
            i = int((q_lens < 0).nonzero()[0, 0])
            raise ValueError(f"query_start_loc must not decrease: entry {i + 1} ({int(starts[i + 1])}) is below "
                             f"entry {i} ({int(starts[i])})")
        short = (lens < q_lens) | (lens < 1)
        if short.any():
            i = int(short.nonzero()[0, 0])
            raise ValueError(f"seq_lens[{i}] is {int(lens[i])} but sequence {i} has {int(q_lens[i])} new tokens: "
                             f"seq_lens counts the tokens in the pool, the new ones included (at least 1)")
    # A sequence's first new token sits at lens - q_lens and has the lowest window.
    first_seen = None if sliding_window is None else (lens - q_lens - sliding_window + 1).clamp_min(0)
    check_tables(block_tables, lens, block_size, num_blocks, first_seen)
    return PagedAttentionShape(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, num_blocks, block_size,
                               max_blocks_per_seq, int(lens.max()), scale, quantized, sliding_window)


def validate_paged_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens, scale=None, k_scale=None,
                                 v_scale=None, sliding_window=None) -> PagedAttentionShape:
    """validate_paged_attention_inputs for a decode: q [num_seqs, num_heads, head_dim], one new token per sequence."""
    return validate_paged_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, None, scale, k_scale, v_scale,
                                           sliding_window)


def is_quantized(k_cache, k_scale, v_scale) -> bool:
    """The launchers' one check (no device sync): scales come with 8-bit pools and only with them."""
    quantized = k_cache.dtype in quantized_cache_dtypes()
    if quantized != (k_scale is not None) or quantized != (v_scale is not None):
        raise ValueError(f"{dtype_name(k_cache.dtype)} pools need k_scale and v_scale "
                         f"{'both given' if quantized else 'both None'} (validate_paged_decode_inputs checks them)")
    return quantized
