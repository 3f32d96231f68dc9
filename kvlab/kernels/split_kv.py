"""Split-KV ("flash-decoding") decode for few long sequences: two kernels, one launcher.

A decode step with one program per (sequence, KV head) has few programs when the batch is small: a
batch of one with 8 KV heads keeps 8 of a GPU's 132 SMs busy. Split-KV cuts each sequence into ranges:

  paged_decode_split_kernel   one program per (sequence, KV head, range) for the whole query-head group,
                               folding its range into an online softmax (the unified kernel's attend_tiles
                               loop) and writing its partial max, sum and accumulator to fp32 scratch
  split_reduce_kernel         one program per (sequence, query head): rescales the partials to a common
                               max and adds them

choose_num_splits is kvlab's rule for when and how much to split (vLLM's own, in its Triton backend,
differs: see Chapter 7).

A sliding-window layer (window W) splits only the W positions its query sees: each sequence's ranges
start at max(0, seq_len - W), so blocks before the window (freed, a placeholder in the table) are never read.
"""

import torch

from kvlab.kernels.interpreter import (
    RUNS_IN_INTERPRETER,
    check_mode,
    register_device_functions,
    triton,
    triton_language_as,
)
from kvlab.kernels.triton_unified_attention import DEFAULT_TILE, MIN_ROWS, attend_tiles, num_warps_for, tile_for
from kvlab.kernels.validation import PagedAttentionShape, is_quantized, validate_paged_attention_inputs
from kvlab.validation import is_integer

tl = triton.language

MIN_TOKENS_PER_SPLIT = 256            # shorter splits cost more in scratch traffic than they add in parallelism
MAX_SPLITS = 64


@triton.jit
def paged_decode_split_kernel(
    part_max_ptr,         # [num_seqs, num_heads, num_splits] fp32 scratch: each split's running max (base 2)
    part_sum_ptr,         # [num_seqs, num_heads, num_splits] fp32 scratch: each split's sum of exp2(s - max)
    part_acc_ptr,         # [num_seqs, num_heads, num_splits, head_dim] fp32 scratch: unnormalised outputs
    # The inputs below mean what they mean for the unified kernel, with one new token per sequence:
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr, scale,
    tokens_per_split,     # positions each split covers, a multiple of TILE
    sliding_window,       # W: the query sees the last W positions; read only when SLIDING
    num_heads,
    stride_q_seq, stride_q_head, stride_cache_block, stride_cache_slot, stride_cache_head, stride_table_seq,
    QUERIES_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, QUANTIZED: tl.constexpr, DOT_FP32: tl.constexpr,
    SLIDING: tl.constexpr,  # True: a sliding-window layer, the splits cover its window only
):
    """Split-KV decode: one program per (sequence, KV head, range of the sequence), for the whole query-head group."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_lo = 0                                       # the first position the query sees
    if SLIDING:
        kv_lo = tl.maximum(seq_len - sliding_window, 0)
    split_start = kv_lo + split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)   # empty past a short sequence's end

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_seq + head[:, None] * stride_q_head + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    # The new token is the sequence's last position: it sees every key (of its window).
    query_pos = tl.zeros([BLOCK_M], tl.int32) + seq_len - 1
    m_i, l_i, acc = attend_tiles(
        q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr + seq * stride_table_seq, kv_head,
        num_kv_heads, split_start, split_end, query_pos, row_ok, scale, sliding_window, stride_cache_block,
        stride_cache_slot, stride_cache_head, dims, dim_ok, BLOCK_M, HEAD_DIM_PAD, BLOCK_SIZE, TILE, QUANTIZED,
        DOT_FP32, SLIDING)
    # Not normalised: the reduce kernel rescales the splits against each other. Empty splits write nothing.
    keep = row_ok & (split_start < seq_len)
    part = (seq * num_heads + head) * tl.num_programs(2) + split     # row-major [seqs, heads, splits]
    tl.store(part_max_ptr + part, m_i, mask=keep)
    tl.store(part_sum_ptr + part, l_i, mask=keep)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=keep[:, None] & dim_ok[None, :])


@triton.jit
def split_reduce_kernel(
    out_ptr,             # [num_seqs, num_heads, head_dim] written here, in q's dtype
    part_max_ptr,        # [num_seqs, num_heads, num_splits] fp32: each split's max (base 2)
    part_sum_ptr,        # [num_seqs, num_heads, num_splits] fp32: each split's sum
    part_acc_ptr,        # [num_seqs, num_heads, num_splits, head_dim] fp32: each split's accumulator
    seq_lens_ptr,        # [num_seqs] int32: tokens of each sequence
    tokens_per_split,    # positions each split covered
    sliding_window,      # W of a sliding-window layer: its splits start at seq_len - W; read only when SLIDING
    num_splits,          # splits per (sequence, head) in the scratch buffers
    stride_out_seq,      # elements between two sequences' outputs
    stride_out_head,     # elements between two heads of one output
    HEAD_DIM: tl.constexpr,        # real head_dim
    HEAD_DIM_PAD: tl.constexpr,    # next power of two of HEAD_DIM
    NUM_SPLITS_PAD: tl.constexpr,  # next power of two of num_splits
    SLIDING: tl.constexpr,         # True: a sliding-window layer
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    span = seq_len                         # positions the query sees, from the first split's start
    if SLIDING:
        span = tl.minimum(seq_len, sliding_window)
    splits = tl.arange(0, NUM_SPLITS_PAD)
    # Splits that saw at least one position; the others wrote nothing, so their scratch is never read.
    used = splits < tl.cdiv(span, tokens_per_split)
    part = (seq * tl.num_programs(1) + head) * num_splits + splits
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    m = tl.load(part_max_ptr + part, mask=used, other=float("-inf"))           # [NUM_SPLITS_PAD]
    s = tl.load(part_sum_ptr + part, mask=used, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                  mask=used[:, None] & dim_ok[None, :], other=0.0)             # [NUM_SPLITS_PAD, HEAD_DIM_PAD]
    m_all = tl.max(m, axis=0)             # split 0 always has work, so this is finite
    weight = tl.exp2(m - m_all)           # moves each split's sum and accumulator onto the common max; 0 if unused
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.sum(weight * s, axis=0)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


register_device_functions(__name__, ("attend_tiles",))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of device's GPU; 132 (an H100) where there is none, for the split rule."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """How many ranges to split each sequence into: enough programs for about 4 per SM, none under 256 tokens.

    A decode program serves one (sequence, KV head) and its query-head group, so a split adds num_seqs x
    num_kv_heads programs. This is kvlab's own rule. vLLM's Triton backend instead uses a fixed 16 segments,
    only for decode-only batches of at most 128 // num_kv_heads sequences (snapped to a CUDA-graph capture
    size): vllm/v1/attention/backends/triton_attn.py.
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = triton.cdiv(4 * num_sms, programs)                 # small batches want more splits
    useful = triton.cdiv(max(1, max_seq_len), MIN_TOKENS_PER_SPLIT)  # long contexts allow more splits
    return max(1, min(wanted, useful, MAX_SPLITS))


def attended_len(shape: PagedAttentionShape) -> int:
    """The most positions one decode query attends over: the longest sequence, or its window if shorter."""
    if shape.sliding_window is None:
        return shape.max_seq_len
    return min(shape.max_seq_len, shape.sliding_window)


def split_plan(max_seq_len: int, num_splits: int, tile: int = DEFAULT_TILE) -> tuple[int, int]:
    """(tokens_per_split, num_splits): whole tiles per split, and the splits that leaves (never more than asked)."""
    tokens_per_split = triton.cdiv(triton.cdiv(max(1, max_seq_len), num_splits), tile) * tile
    return tokens_per_split, triton.cdiv(max(1, max_seq_len), tokens_per_split)


def allocate_split_workspace(num_seqs, num_heads, num_splits, head_dim, device):
    """fp32 scratch for split-KV: max and sum [num_seqs, num_heads, num_splits], acc [..., head_dim]."""
    part_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=device)
    return part_max, torch.empty_like(part_max), torch.empty((num_seqs, num_heads, num_splits, head_dim),
                                                              dtype=torch.float32, device=device)


def launch_paged_decode_split_kv(shape: PagedAttentionShape, q, k_cache, v_cache, block_tables, seq_lens, out,
                                 num_splits, tile=None, workspace=None, k_scale=None, v_scale=None):
    """Launch split-KV then the reduce on validated inputs, writing out; workspace from allocate_split_workspace.

    k_scale, v_scale: [num_blocks, num_kv_heads] float32 for int8 / fp8 pools, None otherwise. The sliding
    window is the shape's (validated with the table): the splits then cover min(max_seq_len, W) positions.
    """
    quantized = is_quantized(k_cache, k_scale, v_scale)
    if shape.num_seqs == 0:
        return out
    check_mode(q.device)
    # The kernels step through head_dim, a table row and seq_lens one element at a time; other strides are
    # passed in. Copying a strided q, table or seq_lens is cheap (the pools are never copied).
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    head_dim_pad = triton.next_power_of_2(shape.head_dim)
    tile = tile or tile_for(q.device)
    tokens_per_split, num_splits = split_plan(attended_len(shape), num_splits, tile)
    if workspace is None:
        workspace = allocate_split_workspace(shape.num_seqs, shape.num_heads, num_splits, shape.head_dim, q.device)
    part_max, part_sum, part_acc = workspace
    if part_max.shape != (shape.num_seqs, shape.num_heads, num_splits):
        raise ValueError(f"workspace is for {tuple(part_max.shape)} but this call needs "
                         f"{(shape.num_seqs, shape.num_heads, num_splits)} (num_splits rounded to whole tiles)")
    queries_per_kv = shape.num_heads // shape.num_kv_heads
    block_m = max(MIN_ROWS, triton.next_power_of_2(queries_per_kv))   # one token: the group, padded to 16 rows
    with triton_language_as(interpreted=RUNS_IN_INTERPRETER):
        paged_decode_split_kernel[(shape.num_seqs, shape.num_kv_heads, num_splits)](
            part_max, part_sum, part_acc, q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, shape.scale,
            tokens_per_split, shape.sliding_window or 0, shape.num_heads, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            QUERIES_PER_KV=queries_per_kv, BLOCK_M=block_m, HEAD_DIM=shape.head_dim, HEAD_DIM_PAD=head_dim_pad,
            BLOCK_SIZE=shape.block_size, TILE=tile, QUANTIZED=quantized,
            DOT_FP32=RUNS_IN_INTERPRETER or q.dtype == torch.float32, SLIDING=shape.sliding_window is not None,
            num_warps=num_warps_for(block_m, head_dim_pad, tile),
        )
        split_reduce_kernel[(shape.num_seqs, shape.num_heads)](
            out, part_max, part_sum, part_acc, seq_lens, tokens_per_split, shape.sliding_window or 0, num_splits,
            out.stride(0), out.stride(1), HEAD_DIM=shape.head_dim, HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS_PAD=triton.next_power_of_2(num_splits), SLIDING=shape.sliding_window is not None, num_warps=4,
        )
    return out


def paged_attention_decode_split_kv(q, k_cache, v_cache, block_tables, seq_lens, scale=None, num_splits=None,
                                    k_scale=None, v_scale=None, sliding_window=None):
    """The same attention, each sequence split into num_splits ranges (chosen from batch and length when None).

    Shapes as paged_attention_decode: q [num_seqs, num_heads, head_dim] -> out of the same shape and dtype;
    k_scale, v_scale, sliding_window as there (8-bit pools only for the scales).
    """
    shape = validate_paged_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, None, scale, k_scale,
                                            v_scale, sliding_window)
    if num_splits is None:
        num_splits = choose_num_splits(shape.num_seqs, shape.num_kv_heads, attended_len(shape), num_sms(q.device))
    if not is_integer(num_splits) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int or None; got {num_splits!r}")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return launch_paged_decode_split_kv(shape, q, k_cache, v_cache, block_tables, seq_lens, out, num_splits,
                                        k_scale=k_scale, v_scale=v_scale)
