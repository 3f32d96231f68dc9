"""One paged-attention kernel for a whole ragged step: chunked prefills, prefix hits and decodes together.

vLLM V1's Triton backend runs every step's attention through one kernel (`unified_attention`, in
vllm/v1/attention/ops/triton_unified_attention.py); this is kvlab's version of that design. The step's
new tokens are laid end to end in q, sequence after sequence, and `query_start_loc` [num_seqs + 1]
marks where each sequence's tokens start. Sequence i holds `seq_lens[i]` tokens in the pool, its
`q_len_i` new ones included (already written), so its new tokens sit at positions
`seq_lens[i] - q_len_i ... seq_lens[i] - 1` and each attends causally to every earlier position of the
sequence, a prefix-cache hit included. A decode is the case q_len_i == 1.

One program serves one block of BLOCK_Q new tokens of one sequence and one KV head, for all
`num_heads // num_kv_heads` query heads that share that KV head: its BLOCK_M = BLOCK_Q x queries-per-KV
rows are (token, head) pairs. Each K/V tile it loads is used by every row, so a decode step requests
each cached K/V byte once (a program per query head would load it once per head of the group), and
the rows' scores are one `tl.dot` [BLOCK_M, HEAD_DIM] x [HEAD_DIM, TILE]. tl.dot wants at least 16 rows,
so a small group is padded to 16 rows (vLLM pads the query group the same way): with 8 query heads per
KV head a program takes 2 tokens, with 1 (MHA) 16 tokens. TILE positions are loaded at a time, across
block boundaries: a tile may cover several blocks or part of one.

Sliding-window layers (sliding_window = W, transformers' convention: the query at position p sees keys
p - W + 1 .. p; see kvlab.kernels.reference) add a lower bound to the mask, and each program's loop starts
at the first key its lowest row can see, so blocks wholly before every row's window are never loaded:
vLLM frees them and leaves a placeholder (its null block) in the table. Full attention (None) compiles
without either: SLIDING is a compile-time flag.
"""

import torch

from kvlab.kernels.interpreter import (
    RUNS_IN_INTERPRETER,
    check_mode,
    register_device_functions,
    triton,
    triton_language_as,
)
from kvlab.kernels.validation import PagedAttentionShape, is_quantized, validate_paged_attention_inputs

tl = triton.language

MIN_ROWS = 16       # tl.dot's smallest M on NVIDIA GPUs
DEFAULT_TILE = 64   # positions per loop iteration: 64 x 128 x 2 B = 16 KiB of K per load


@triton.jit
def attend_tiles(
    q,                    # [BLOCK_M, HEAD_DIM_PAD] the program's query rows, in the dots' dtype
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,  # the pools and their scales (see the kernel)
    table_row,            # pointer to the sequence's row of block_tables
    kv_head, num_kv_heads,
    kv_start, kv_end,     # the key positions [kv_start, kv_end) to attend over
    query_pos,            # [BLOCK_M] each row's position: it sees keys at or before it (causal)
    row_ok,               # [BLOCK_M] rows that are real (token, head) pairs
    scale,
    sliding_window,       # W: a row also needs position > query_pos - W (read only when SLIDING)
    stride_cache_block, stride_cache_slot, stride_cache_head,
    dims, dim_ok,         # [HEAD_DIM_PAD] head-dim offsets and which of them are real
    BLOCK_M: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    QUANTIZED: tl.constexpr, DOT_FP32: tl.constexpr, SLIDING: tl.constexpr,
):
    """Each row's running max m_i and sum l_i [BLOCK_M] and unnormalised output acc [BLOCK_M, HEAD_DIM_PAD]."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)   # running max of each row's scores (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)                 # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)   # running sum of exp2(score - m_i) * v
    for start in range(kv_start, kv_end, TILE):
        pos = start + tl.arange(0, TILE)
        in_seq = pos < kv_end
        # Masked table load: entries past the sequence's last block may hold anything.
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=in_seq, other=0)
        slot = block.to(tl.int64) * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot
        kv_offsets = (slot + kv_head * stride_cache_head)[:, None] + dims[None, :]   # [TILE, HEAD_DIM_PAD]
        kv_mask = in_seq[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if QUANTIZED:
            # Dequantise right after the load (real value = stored * the block's scale), then into the
            # dots' dtype: q's 16-bit dtype keeps the tensor cores; fp32 dots would spill registers.
            scale_offsets = block * num_kv_heads + kv_head
            k = (k.to(tl.float32) * tl.load(k_scale_ptr + scale_offsets, mask=in_seq, other=0.0)[:, None]
                 ).to(q.dtype)
            v = (v.to(tl.float32) * tl.load(v_scale_ptr + scale_offsets, mask=in_seq, other=0.0)[:, None]
                 ).to(q.dtype)
        elif DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")                  # [BLOCK_M, TILE]
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * (scale * 1.4426950408889634)   # base 2: exp(x) == exp2(x * log2(e)), exp2 is the native op
        visible = row_ok[:, None] & in_seq[None, :] & (pos[None, :] <= query_pos[:, None])
        if SLIDING:
            visible = visible & (pos[None, :] > query_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen nothing yet (all -inf) keeps m = -inf; subtract 0 there, not -inf, so no NaN.
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - safe)
        p = tl.exp2(s - safe[:, None])
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def unified_attention_kernel(
    out_ptr,              # [num_tokens, num_heads, head_dim] written here, in q's dtype
    q_ptr,                # [num_tokens, num_heads, head_dim] the step's new tokens, sequence after sequence
    k_cache_ptr,          # [num_blocks, block_size, num_kv_heads, head_dim] the key pool
    v_cache_ptr,          # the value pool: same shape and strides
    k_scale_ptr,          # [num_blocks, num_kv_heads] fp32 scales of an 8-bit K pool; None unless QUANTIZED
    v_scale_ptr,          # the same for V
    block_tables_ptr,     # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,         # [num_seqs] int32: tokens of each sequence in the pool, the new ones included
    query_start_loc_ptr,  # [num_seqs + 1] int32: where each sequence's new tokens start in q
    scale,                # softmax scale
    sliding_window,       # W, the keys each query sees counting itself; read only when SLIDING
    num_seqs,
    num_kv_heads,
    stride_q_tok, stride_q_head, stride_out_tok, stride_out_head,
    stride_cache_block, stride_cache_slot, stride_cache_head, stride_table_seq,
    QUERIES_PER_KV: tl.constexpr,  # num_heads // num_kv_heads
    BLOCK_Q: tl.constexpr,         # new tokens per program
    BLOCK_M: tl.constexpr,         # rows per program: BLOCK_Q * QUERIES_PER_KV, padded to a power of two >= 16
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,    # next power of two; lanes past HEAD_DIM are masked
    BLOCK_SIZE: tl.constexpr,      # tokens per block, a power of two
    TILE: tl.constexpr,            # key positions per loop iteration, independent of BLOCK_SIZE
    QUANTIZED: tl.constexpr,
    DOT_FP32: tl.constexpr,        # True: the dots in fp32 ("ieee"); False: in q's 16-bit dtype
    SLIDING: tl.constexpr,         # True: a sliding-window layer; False: full attention, no window code at all
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Sequence s owns q blocks query_start_loc[s] // BLOCK_Q + s onwards (enough for ceil(q_len / BLOCK_Q),
    # with room to spare, so the grid is known without reading query_start_loc on the host): find the last
    # sequence whose first block is at or before this one.
    lo = tl.zeros([], tl.int32)
    hi = tl.zeros([], tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first <= q_block, mid, lo)
        hi = tl.where(first <= q_block, hi, mid - 1)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)   # this program's block among the sequence's
    if local * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - q_len                  # tokens before the new ones (a prefix hit, earlier chunks)

        rows = tl.arange(0, BLOCK_M)
        tok = local * BLOCK_Q + rows // QUERIES_PER_KV         # which new token of the sequence
        head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
        row_ok = (rows < BLOCK_Q * QUERIES_PER_KV) & (tok < q_len)
        query_pos = context + tok                              # each row's position in the sequence
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_ok = dims < HEAD_DIM
        q_offsets = (q_start + tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        table_row = block_tables_ptr + seq * stride_table_seq

        # Causal: this block's last token sees positions up to its own, so later keys are never loaded.
        kv_end = tl.minimum(seq_len, context + (local + 1) * BLOCK_Q)
        kv_start = 0
        if SLIDING:
            # The block's first token has the lowest window: keys before it are seen by no row, and their
            # table entries may be a freed block's placeholder, so the loop starts here and never loads them.
            kv_start = tl.maximum(context + local * BLOCK_Q - sliding_window + 1, 0)
        m_i, l_i, acc = attend_tiles(
            q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_row, kv_head, num_kv_heads, kv_start,
            kv_end, query_pos, row_ok, scale, sliding_window, stride_cache_block, stride_cache_slot,
            stride_cache_head, dims, dim_ok, BLOCK_M, HEAD_DIM_PAD, BLOCK_SIZE, TILE, QUANTIZED, DOT_FP32, SLIDING)
        # A real row saw its own position, so l_i >= 1; padding rows are never stored.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_offsets = (q_start + tok)[:, None] * stride_out_tok + head[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


register_device_functions(__name__, ("attend_tiles",))


def tile_for(device: torch.device | None = None, sm: int | None = None) -> int:
    """Key positions per loop iteration: 64, or 32 before sm_80, where a 64-position fp16 tile spills registers."""
    if sm is None:
        sm = 80
        if device is not None and device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            sm = 10 * major + minor
    return DEFAULT_TILE if sm >= 80 else DEFAULT_TILE // 2


def block_q_for(queries_per_kv: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M): new tokens per program and its rows, at least MIN_ROWS of them (tl.dot's smallest M)."""
    block_m = max(MIN_ROWS, triton.next_power_of_2(queries_per_kv))
    return max(1, block_m // queries_per_kv), block_m


def _launch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, *, num_tokens, num_seqs, num_heads,
            num_kv_heads, head_dim, block_size, scale, tile, k_scale, v_scale, num_warps=None, num_stages=None,
            sliding_window=None):
    quantized = is_quantized(k_cache, k_scale, v_scale)
    if num_tokens == 0 or num_seqs == 0:
        return out
    check_mode(q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables, seq_lens, query_start_loc = (t.contiguous() for t in (block_tables, seq_lens, query_start_loc))
    tile = tile or tile_for(q.device)
    queries_per_kv = num_heads // num_kv_heads
    block_q, block_m = block_q_for(queries_per_kv)
    head_dim_pad = triton.next_power_of_2(head_dim)
    # Enough q blocks for every sequence (see the kernel): tokens // BLOCK_Q + one per sequence.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    # fp32 dots for fp32 queries, and always in the interpreter (its bf16 arithmetic is off); else 16-bit dots.
    dot_fp32 = RUNS_IN_INTERPRETER or q.dtype == torch.float32
    with triton_language_as(interpreted=RUNS_IN_INTERPRETER):
        unified_attention_kernel[grid](
            out, q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, scale,
            sliding_window or 0, num_seqs, num_kv_heads,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            QUERIES_PER_KV=queries_per_kv, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, TILE=tile, QUANTIZED=quantized,
            DOT_FP32=dot_fp32, SLIDING=sliding_window is not None,
            num_warps=num_warps or num_warps_for(block_m, head_dim_pad, tile),
            **({"num_stages": num_stages} if num_stages else {}),
        )
    return out


def num_warps_for(block_m: int, head_dim_pad: int, tile: int) -> int:
    """Warps per program: 8 once its K/V tile and accumulator pass 16k fp32 values, else 4."""
    return 8 if max(tile, block_m) * head_dim_pad >= 16384 else 4


def launch_unified_attention(shape: PagedAttentionShape, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                             out, tile=None, k_scale=None, v_scale=None, num_warps=None, num_stages=None):
    """Launch the unified kernel on validated inputs (shape from validate_paged_attention_inputs); no host sync.

    tile, num_warps, num_stages: None for the defaults (tile_for, num_warps_for, Triton's); the benchmark's
    autotune passes others. The sliding window is the shape's: the one the table entries were validated for.
    """
    return _launch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, num_tokens=shape.num_tokens,
                   num_seqs=shape.num_seqs, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                   head_dim=shape.head_dim, block_size=shape.block_size, scale=shape.scale, tile=tile,
                   k_scale=k_scale, v_scale=v_scale, num_warps=num_warps, num_stages=num_stages,
                   sliding_window=shape.sliding_window)


def unified_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None, k_scale=None,
                      v_scale=None, sliding_window=None):
    """Causal attention of a ragged step's new tokens over their sequences' paged K/V: q's shape and dtype out.

    q: [num_tokens, num_heads, head_dim], each sequence's new tokens end to end; query_start_loc int32
    [num_seqs + 1]; seq_lens int32 [num_seqs], the new tokens included and already written to the pools;
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; block_tables int32 [num_seqs, max_blocks].
    int8 / float8_e4m3fn pools take k_scale, v_scale float32 [num_blocks, num_kv_heads].
    sliding_window: None for full attention, or W: each query sees its last W positions, and table entries
    wholly before every query's window are never read (they may hold a freed block's placeholder).
    """
    shape = validate_paged_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                            k_scale, v_scale, sliding_window)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return launch_unified_attention(shape, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
                                    k_scale=k_scale, v_scale=v_scale)


def launch_paged_decode(shape: PagedAttentionShape, q, k_cache, v_cache, block_tables, seq_lens, out, tile=None,
                        k_scale=None, v_scale=None):
    """The decode case on validated inputs (shape from validate_paged_decode_inputs): one new token per sequence.

    q, out: [num_seqs, num_heads, head_dim]; k_scale, v_scale: [num_blocks, num_kv_heads] float32 for 8-bit pools.
    """
    query_start_loc = torch.arange(shape.num_seqs + 1, dtype=torch.int32, device=q.device)
    return launch_unified_attention(shape, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, tile,
                                    k_scale, v_scale)


def paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale=None, k_scale=None, v_scale=None,
                           sliding_window=None):
    """Attention of each sequence's one new query over its seq_len cached tokens, read through its block table.

    q: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: int32 [num_seqs, max_blocks_per_seq]; seq_lens: int32 [num_seqs]. Returns q's shape and dtype.
    int8 / float8_e4m3fn pools: k_scale, v_scale float32 [num_blocks, num_kv_heads] (real value = stored * scale),
    e.g. an 8-bit PagedKVCache's k_scales[layer] and v_scales[layer]; None for unquantized pools.
    sliding_window: None (full attention) or W, each query seeing its last W positions.
    """
    shape = validate_paged_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, None, scale, k_scale,
                                            v_scale, sliding_window)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return launch_paged_decode(shape, q, k_cache, v_cache, block_tables, seq_lens, out, k_scale=k_scale,
                               v_scale=v_scale)
