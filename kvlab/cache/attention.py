"""Reference causal attention of new queries over a sequence's cached keys and values (plain torch)."""

import torch

from kvlab.validation import check_sliding_window


def expand_kv_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Repeat each KV head for the query heads that share it (GQA/MQA): [Hkv, T, D] -> [H, T, D]."""
    num_kv_heads = x.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    return x.repeat_interleave(num_heads // num_kv_heads, dim=0)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                     sliding_window: int | None = None) -> torch.Tensor:
    """Attention of the last Tq positions over all Tk cached positions.

    q: [H, Tq, D] queries for the newest Tq tokens; k, v: [Hkv, Tk, D] for all tokens so far (Tk >= Tq).
    sliding_window: None, or W: a query at position p sees only keys p - W + 1 .. p (transformers' convention,
    kvlab.kernels.reference), so k, v may start anywhere at or before the first query's window.
    Returns [Tq, H, D], the layout transformers' attention functions return.
    """
    sliding_window = check_sliding_window(sliding_window)
    num_heads, num_new, _ = q.shape
    num_total = k.shape[1]
    if num_new > num_total:
        raise ValueError(f"{num_new} queries but only {num_total} cached keys: append the new K/V before attending")
    k = expand_kv_heads(k, num_heads)
    v = expand_kv_heads(v, num_heads)
    # Softmax in fp32 so half-precision caches give the same tokens as the float model.
    scores = torch.matmul(q.float(), k.float().transpose(1, 2)) * scaling  # [H, Tq, Tk]
    # Query i sits at absolute position Tk - Tq + i and may see keys up to that position.
    query_pos = torch.arange(num_total - num_new, num_total, device=q.device)[:, None]
    key_pos = torch.arange(num_total, device=q.device)[None, :]
    hidden = key_pos > query_pos
    if sliding_window is not None:
        hidden = hidden | (key_pos <= query_pos - sliding_window)
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.float())  # [H, Tq, D]
    return out.transpose(0, 1).to(q.dtype)
