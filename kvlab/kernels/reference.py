"""Chapter 7's spec: the kernels' contract in plain torch, one sequence at a time, to check the kernels against.

One reference for one contract: a ragged step's new tokens attend causally over their sequences' paged
K/V (unified_attention_reference); a decode is its one-new-token case. The math is that of
kvlab.cache.paged_cache.paged_attention: gather the sequence's keys and values through its block table,
then softmax(q k^T * scale) v in fp32, on the kernels' tensor layout.
Quantized pools (int8 or fp8, Chapter 14) are dequantised right after the gather with
kvlab.quantization.dequantize: stored * the scale of each (block, KV head).

Sliding-window attention (sliding_window = W; None is full attention): the query at position p sees the
keys at positions p - W + 1 .. p, W of them counting itself. This is transformers' convention, read in
transformers/masking_utils.py: sliding_window_causal_mask_function(W) is sliding_window_overlay (key
kept when kv_idx > q_idx - W) and-ed with causal_mask_function (kv_idx <= q_idx); its flash-attention
path passes window_size (W - 1, W - 1) (modeling_flash_attention_utils.py) for the same set. A block
whose tokens all lie before the first new token's window is never gathered: vLLM frees such blocks and
puts a placeholder in the block table, so those entries may hold anything.
"""

import torch

from kvlab.quantization import dequantize
from kvlab.validation import check_sliding_window


def gather_blocks(cache, blocks, scales=None):
    """cache[blocks] in fp32 [n, block_size, num_kv_heads, head_dim]; 8-bit ones times scales[blocks]
    [n, num_kv_heads]."""
    stored = cache[blocks]
    if scales is None:
        return stored.float()
    return dequantize(stored, scales[blocks][:, None, :])  # one scale per (block, head), shared by its slots and dims


def unified_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None,
                              k_scale=None, v_scale=None, sliding_window=None):
    """A ragged step's new tokens attending causally over their sequences, gathered block by block, in fp32.

    q: [num_tokens, num_heads, head_dim]; query_start_loc: [num_seqs + 1]; seq_lens: [num_seqs], the new
    tokens included; pools and scales as paged_attention_decode_reference. sliding_window: None, or W (each
    query sees its last W positions; table entries wholly before every query's window are not read).
    Returns q's shape and dtype.
    """
    sliding_window = check_sliding_window(sliding_window)
    if (k_scale is None) != (v_scale is None):
        raise ValueError("give both k_scale and v_scale (8-bit pools) or neither")
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    starts = [int(x) for x in query_start_loc]
    for i in range(len(starts) - 1):
        seq_len, q_len = int(seq_lens[i]), starts[i + 1] - starts[i]
        if q_len == 0:
            continue
        # The first new token's window starts lowest: blocks wholly before it are skipped (first is a block start).
        first = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1) // block_size * block_size
        blocks = block_tables[i, first // block_size: -(-seq_len // block_size)].long()
        k = gather_blocks(k_cache, blocks, k_scale).flatten(0, 1)[:seq_len - first]
        v = gather_blocks(v_cache, blocks, v_scale).flatten(0, 1)[:seq_len - first]
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)        # [seq_len - first, num_heads, head_dim]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        queries = q[starts[i]:starts[i + 1]].float()                       # [q_len, num_heads, head_dim]
        scores = torch.einsum("qhd,thd->hqt", queries, k) * scale          # [num_heads, q_len, seq_len - first]
        query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        key_pos = torch.arange(first, seq_len)[None, :]
        hidden = key_pos > query_pos
        if sliding_window is not None:
            hidden |= key_pos <= query_pos - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[starts[i]:starts[i + 1]] = torch.einsum("hqt,thd->qhd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out


def paged_attention_decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale=None, k_scale=None,
                                     v_scale=None, sliding_window=None):
    """Each sequence's one query attending over its seq_len tokens, gathered through its block table.

    q: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: [num_seqs, max_blocks_per_seq]; seq_lens: [num_seqs]. Returns q's shape and dtype.
    int8 / fp8 pools need k_scale, v_scale [num_blocks, num_kv_heads]: real value = stored * scale.
    The decode is the ragged step's one-token case, so this is unified_attention_reference with
    query_start_loc = 0, 1, ..., num_seqs. sliding_window: None (full) or W, the last W positions.
    """
    if k_scale is None and k_cache.element_size() == 1:
        raise ValueError(f"{str(k_cache.dtype).removeprefix('torch.')} pools hold scaled values: "
                         f"pass k_scale and v_scale")
    query_start_loc = torch.arange(q.shape[0] + 1)
    return unified_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale,
                                       v_scale, sliding_window)


def reshape_and_cache_reference(key, value, k_cache, v_cache, slot_mapping):
    """The cache write in torch, as kvlab's engine stores a step's K/V: rows with slot -1 (padding) skipped.

    key, value: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim], changed in place; slot_mapping: [num_tokens] int64.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)
