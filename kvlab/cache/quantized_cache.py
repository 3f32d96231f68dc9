"""Chapter 8's quantized paged KV store: the same pools and runner hook as PagedKVCache, in 8 bits.

Each layer keeps a K pool and a V pool of blocks [num_blocks, block_size, Hkv, D], stored as int8
or as fp8 (torch.float8_e4m3fn), plus a float32 scale per (block, KV head) for K and one for V:

    stored = quantize(x / scale)        x ~ stored * scale (dequantised after the gather)

int8 is symmetric: scale = amax / 127, so every element is off by at most scale / 2. fp8 e4m3 uses
the same per-(block, head) scale, chosen so the block's largest value lands on fp8's largest
(448); each element then keeps 3 mantissa bits, a relative error of at most 1/16.

A scale is found from the values written, so it can only grow as a block fills. When new tokens
need a larger scale than the block already has, the block's stored values are requantised to the
new scale: they pay a second rounding, so their error grows from scale_old / 2 to at most
scale_old / 2 + scale_new / 2 for int8 (about twice the one-rounding bound in the worst case).
A write to a block's first slot starts the block afresh: the block manager hands a sequence a
block's slot 0 only when the block is new to it, so whatever the block held before is stale.

Fixed (calibrated) scales can be set per layer with `set_scales`; such a layer never rescales, and
values beyond 127 (int8) or 448 (fp8) times the scale saturate.

The attention itself is the torch reference of Chapter 3: gather the sequence's blocks through
its block table, dequantise, then causal attention.
"""

import math
from dataclasses import dataclass

import torch

from kvlab.cache.attention import causal_attention
from kvlab.analysis.kv_size import DTYPE_BYTES, kv_shape
from kvlab.cache.paged_cache import PagedKVCache
from kvlab.cache.ragged_batch import SequenceChunk, forward_batch
from kvlab.cache.paged_cache import gather_kv as gather_stored
from kvlab.model.config import context_length
from kvlab.core.paging import num_blocks_needed
from kvlab.validation import check_block_size, check_positive_int
from kvlab.quantization import (
    SCALE_BYTES,
    SCALE_FLOOR,
    SUPPORTED_KV_CACHE_DTYPES,
    dequantize,
    quantize,
    storage_format,
)


def gather_kv(pool: torch.Tensor, scales: torch.Tensor, block_table: list[int], seq_len: int,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One sequence's dequantised keys (or values): pool [num_blocks, block_size, Hkv, D], scales [num_blocks, Hkv] -> [Hkv, seq_len, D]."""
    stored = gather_stored(pool, block_table, seq_len)  # [Hkv, seq_len, D], still int8 / fp8
    table = torch.as_tensor(block_table, dtype=torch.long, device=pool.device)
    per_token = scales[table].repeat_interleave(pool.shape[1], dim=0)[:seq_len]  # [seq_len, Hkv]
    return dequantize(stored, per_token.transpose(0, 1), dtype)


def quantized_paged_attention(q, k_pool, v_pool, k_scales, v_scales, block_table, seq_len, scaling):
    """Reference paged attention over quantised pools: gather, dequantise, causal attention.

    q: [H, T_new, D] for the last T_new positions of a sequence of seq_len tokens. Returns [T_new, H, D].
    """
    k = gather_kv(k_pool, k_scales, block_table, seq_len, q.dtype)
    v = gather_kv(v_pool, v_scales, block_table, seq_len, q.dtype)
    return causal_attention(q, k, v, scaling)


def _check_scale(name: str, scale, num_blocks: int, num_kv_heads: int) -> torch.Tensor:
    """A user-given scale as [num_blocks, Hkv] float32, or ValueError if it is not positive and finite."""
    scale = torch.as_tensor(scale, dtype=torch.float32)
    if scale.ndim not in (0, 1, 2) or (scale.ndim >= 1 and scale.shape[-1] != num_kv_heads) or (
            scale.ndim == 2 and scale.shape[0] != num_blocks):
        raise ValueError(
            f"{name} has shape {tuple(scale.shape)}; give a number, one scale per KV head ({num_kv_heads},) "
            f"or one per block and head ({num_blocks}, {num_kv_heads})"
        )
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        bad = scale.flatten()[~(torch.isfinite(scale.flatten()) & (scale.flatten() > 0))][0]
        raise ValueError(f"{name} must be positive and finite, got {float(bad)}")
    return scale.expand(num_blocks, num_kv_heads).clone()


class QuantizedPagedKVCache(PagedKVCache):
    """K and V pools for every layer in int8 or fp8, [num_blocks, block_size, Hkv, D], with scales [num_blocks, Hkv]."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, kv_cache_dtype="int8",
                 dtype=torch.float32, device="cpu"):
        storage, self.qmax = storage_format(kv_cache_dtype)  # raises for an unsupported name
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=storage, device=device)
        self.kv_cache_dtype = kv_cache_dtype
        self.dtype = dtype  # what attention computes in: the model's dtype
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.k_scales = [torch.full((num_blocks, num_kv_heads), SCALE_FLOOR, device=device) for _ in range(num_layers)]
        self.v_scales = [torch.full((num_blocks, num_kv_heads), SCALE_FLOOR, device=device) for _ in range(num_layers)]
        self.static = [False] * num_layers  # True once set_scales fixed the layer's scales
        self.num_requantized = 0            # (block, head) pairs whose stored values were rounded a second time

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int, kv_cache_dtype: str = "int8"):
        """Quantised pools sized for a transformers model's layers, KV heads and head dim; attention in the model's dtype."""
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, head_dim,
                   kv_cache_dtype=kv_cache_dtype, dtype=model.dtype, device=model.device)

    @property
    def num_layers(self) -> int:
        """Layers with a pool."""
        return len(self.k_pools)

    @property
    def nbytes(self) -> int:
        """Bytes of every pool and every scale."""
        tensors = self.k_pools + self.v_pools + self.k_scales + self.v_scales
        return sum(t.numel() * t.element_size() for t in tensors)

    def bytes_per_token(self) -> float:
        """Bytes one token slot costs across all layers, K and V, its share of the block scales included."""
        return self.nbytes / self.num_slots

    def _check_slots(self, slot_mapping: torch.Tensor, num_tokens: int) -> None:
        if slot_mapping.shape != (num_tokens,):
            raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}; expected ({num_tokens},), one slot per token")
        if slot_mapping.numel() and (int(slot_mapping.min()) < 0 or int(slot_mapping.max()) >= self.num_slots):
            bad = slot_mapping[(slot_mapping < 0) | (slot_mapping >= self.num_slots)][0]
            raise ValueError(f"slot {int(bad)} is outside the pool of {self.num_slots} slots ({self.num_blocks} blocks of {self.block_size})")

    def _store(self, pool: torch.Tensor, scales: torch.Tensor, static: bool, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantise x [T, Hkv, D] into pool at slot_mapping, growing (and requantising) block scales as needed."""
        blocks = slot_mapping // self.block_size
        touched, which = blocks.unique(return_inverse=True)  # [n] blocks written, and each token's index among them
        if not static:
            token_amax = x.abs().amax(dim=-1).float()  # [T, Hkv]
            amax = torch.zeros(len(touched), x.shape[1], device=x.device).scatter_reduce_(
                0, which[:, None].expand_as(token_amax), token_amax, "amax")  # [n, Hkv]
            fresh = torch.isin(touched, blocks[slot_mapping % self.block_size == 0])  # [n]
            old = scales[touched]
            base = torch.where(fresh[:, None], torch.full_like(old, SCALE_FLOOR), old)
            new = torch.maximum(base, amax / self.qmax)  # [n, Hkv]
            # Existing values of a block whose scale grows are rounded again at the new scale.
            grown = (new > base) & ~fresh[:, None]
            rows = grown.any(dim=1)  # [n] blocks with at least one head to requantise
            if bool(rows.any()):
                kept = dequantize(pool[touched[rows]], old[rows][:, None, :])  # [m, block_size, Hkv, D]
                pool[touched[rows]] = quantize(kept, new[rows][:, None, :], self.kv_cache_dtype)
                self.num_requantized += int(grown.sum())
            if bool(fresh.any()):
                pool[touched[fresh]] = torch.zeros((), dtype=pool.dtype, device=pool.device)  # stale values go
            scales[touched] = new
        flat = pool.view(self.num_slots, *pool.shape[2:])
        flat[slot_mapping] = quantize(x, scales[blocks], self.kv_cache_dtype)

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantise new k, v [T, Hkv, D] into their slots of layer layer_idx's pools (all checks before any change)."""
        slot_mapping = torch.as_tensor(slot_mapping, dtype=torch.long, device=k.device)
        self._check_slots(slot_mapping, k.shape[0])
        if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
            raise ValueError(f"layer {layer_idx}: K or V holds NaN or inf, which no scale can represent")
        if slot_mapping.numel() == 0:
            return
        self._store(self.k_pools[layer_idx], self.k_scales[layer_idx], self.static[layer_idx], k, slot_mapping)
        self._store(self.v_pools[layer_idx], self.v_scales[layer_idx], self.static[layer_idx], v, slot_mapping)

    def set_scales(self, layer_idx: int, k_scale, v_scale) -> None:
        """Fix layer layer_idx's scales (a number, [Hkv] or [num_blocks, Hkv]); stored values are requantised to them.

        The layer then never rescales: calibrated (static) scales, as vLLM's fp8 k_scale / v_scale.
        """
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer {layer_idx} does not exist; the cache has {self.num_layers} layers")
        # Both checked before either is applied, so a bad V scale leaves K untouched too.
        k_new = _check_scale("k_scale", k_scale, self.num_blocks, self.num_kv_heads).to(self.k_scales[layer_idx].device)
        v_new = _check_scale("v_scale", v_scale, self.num_blocks, self.num_kv_heads).to(self.v_scales[layer_idx].device)
        for pool, scales, new in ((self.k_pools[layer_idx], self.k_scales[layer_idx], k_new),
                                  (self.v_pools[layer_idx], self.v_scales[layer_idx], v_new)):
            pool.copy_(quantize(dequantize(pool, scales[:, None, :]), new[:, None, :], self.kv_cache_dtype))
            scales.copy_(new)
        self.static[layer_idx] = True

    def copy_blocks(self, copies) -> None:
        """Copy block src's stored K/V and its scales into block dst for every (src, dst) and layer (copy-on-write)."""
        from kvlab.cache.paged_cache import copy_blocks

        copy_blocks(self, copies)

    def dequantized(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer layer_idx's K and V pools as real numbers: two [num_blocks, block_size, Hkv, D] tensors."""
        return (dequantize(self.k_pools[layer_idx], self.k_scales[layer_idx][:, None, :], self.dtype),
                dequantize(self.v_pools[layer_idx], self.v_scales[layer_idx][:, None, :], self.dtype))

    def attend(self, layer_idx, query, key, value, scaling):
        """The runner hook: quantise this pass's K/V into their slots, then each sequence attends over its dequantised blocks ([1, T, H, D])."""
        batch = self.batch
        if batch is None:
            raise RuntimeError("call set_batch(...) before running the model on a QuantizedPagedKVCache")
        self.write(layer_idx, key[0].transpose(0, 1), value[0].transpose(0, 1), batch.slot_mapping)
        outs, start = [], 0
        for q_len, seq_len, table in zip(batch.query_lens, batch.context_lens, batch.block_tables):
            q = query[0, :, start:start + q_len]
            outs.append(quantized_paged_attention(q, self.k_pools[layer_idx], self.v_pools[layer_idx],
                                                  self.k_scales[layer_idx], self.v_scales[layer_idx], table, seq_len, scaling))
            start += q_len
        return torch.cat(outs, dim=0)[None]


# ---------------------------------------------------------------------------------------------
# Capacity: how many tokens a byte budget holds, unquantised or quantised.

def _bytes_per_element(kv_cache_dtype: str) -> tuple[int, bool]:
    """(bytes per stored element, whether it carries per-block scales)."""
    if kv_cache_dtype in SUPPORTED_KV_CACHE_DTYPES:
        return 1, True
    name = str(kv_cache_dtype).removeprefix("torch.")
    if name in DTYPE_BYTES and name not in ("int8", "fp8", "float8_e4m3fn", "float8_e5m2"):
        return DTYPE_BYTES[name], False
    raise ValueError(
        f"unsupported kv_cache_dtype {kv_cache_dtype!r}; quantised: {', '.join(SUPPORTED_KV_CACHE_DTYPES)}; "
        f"unquantised: float32, float16, bfloat16"
    )


def block_bytes(config, kv_cache_dtype: str, block_size: int = 16) -> int:
    """Bytes of one block across all layers, K and V: elements, plus one float32 scale per KV head when quantised."""
    check_block_size(block_size)
    shape = kv_shape(config)
    elem_bytes, scaled = _bytes_per_element(kv_cache_dtype)
    per_head = block_size * shape["head_dim"] * elem_bytes + (SCALE_BYTES if scaled else 0)
    return 2 * shape["num_layers"] * shape["num_kv_heads"] * per_head


def tokens_that_fit(config, memory_bytes: int, kv_cache_dtype: str, block_size: int = 16) -> int:
    """Tokens a pool of whole blocks holds in memory_bytes."""
    if memory_bytes < 0:
        raise ValueError(f"memory_bytes must not be negative, got {memory_bytes}")
    return int(memory_bytes // block_bytes(config, kv_cache_dtype, block_size)) * block_size


@dataclass(slots=True)
class CapacityComparison:
    """Tokens that fit in one byte budget, unquantised vs quantised."""

    memory_bytes: int
    baseline_dtype: str      # e.g. "float16"
    quantized_dtype: str     # e.g. "int8"
    baseline_tokens: int
    quantized_tokens: int
    ratio: float             # quantized_tokens / baseline_tokens


def compare_capacity(config, memory_bytes: int, kv_cache_dtype: str = "int8", baseline: str = "float16",
                     block_size: int = 16) -> CapacityComparison:
    """How many more tokens an 8-bit pool holds than a `baseline` one in the same bytes (about 2x vs fp16, 4x vs fp32)."""
    base = tokens_that_fit(config, memory_bytes, baseline, block_size)
    quant = tokens_that_fit(config, memory_bytes, kv_cache_dtype, block_size)
    return CapacityComparison(memory_bytes, baseline, kv_cache_dtype, base, quant, quant / base if base else math.inf)


# ---------------------------------------------------------------------------------------------
# What quantisation costs the model: logits and perplexity, teacher-forced through the cache.

@dataclass(slots=True)
class QuantizationEffect:
    """Quantised vs unquantised paged cache on the same text, teacher-forced."""

    kv_cache_dtype: str
    num_tokens: int               # tokens fed through the model
    max_abs_logit_diff: float     # over every position and vocabulary entry
    mean_abs_logit_diff: float
    perplexity_reference: float   # unquantised paged cache (the model's dtype)
    perplexity_quantized: float
    relative_perplexity_change: float  # (quantized - reference) / reference
    top1_agreement: float         # share of positions whose argmax agrees


def _teacher_forced_logits(model, token_ids: list[int], cache, chunk_size: int, block_table: list[int]) -> torch.Tensor:
    """Logits [n, vocab] of one sequence fed chunk by chunk, so later chunks read earlier chunks' K/V from the cache."""
    outs = []
    for start in range(0, len(token_ids), chunk_size):
        chunk = SequenceChunk(token_ids[start:start + chunk_size], start, block_table)
        logits, _ = forward_batch(model, cache, [chunk])  # every row: teacher forcing scores each position
        outs.append(logits.float().cpu())
    return torch.cat(outs)


def logit_and_perplexity_change(model, tokenizer, text: str, kv_cache_dtype: str = "int8", chunk_size: int = 8,
                                block_size: int = 16, seed: int = 0) -> QuantizationEffect:
    """Run `text` through the model on an unquantised and a quantised paged cache and compare logits and perplexity.

    The text is cut into windows of the model's context; each window is one sequence fed in chunks
    of chunk_size tokens, its blocks placed at random in the pool (seeded).
    """
    storage_format(kv_cache_dtype)  # reject a bad dtype before any work
    check_positive_int("chunk_size", chunk_size)
    # verbose=False: the text may be longer than the model's context; it is cut into windows below.
    ids = [int(t) for t in tokenizer(text, verbose=False)["input_ids"]]
    if len(ids) < 2:
        raise ValueError("the text must have at least 2 tokens to measure perplexity")
    window = context_length(model)
    num_blocks = num_blocks_needed(min(window, len(ids)), block_size)
    generator = torch.Generator().manual_seed(seed)
    ref_logits, quant_logits, targets = [], [], []
    for start in range(0, len(ids), window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        table = torch.randperm(num_blocks, generator=generator).tolist()
        reference = PagedKVCache.for_model(model, num_blocks, block_size)
        quantized = QuantizedPagedKVCache.for_model(model, num_blocks, block_size, kv_cache_dtype)
        ref_logits.append(_teacher_forced_logits(model, chunk, reference, chunk_size, table)[:-1])
        quant_logits.append(_teacher_forced_logits(model, chunk, quantized, chunk_size, table)[:-1])
        targets.append(torch.tensor(chunk[1:]))
    ref, quant, target = torch.cat(ref_logits), torch.cat(quant_logits), torch.cat(targets)
    diff = (quant - ref).abs()
    ppl_ref = math.exp(float(torch.nn.functional.cross_entropy(ref, target)))
    ppl_quant = math.exp(float(torch.nn.functional.cross_entropy(quant, target)))
    return QuantizationEffect(
        kv_cache_dtype=kv_cache_dtype, num_tokens=len(ids),
        max_abs_logit_diff=float(diff.max()), mean_abs_logit_diff=float(diff.mean()),
        perplexity_reference=ppl_ref, perplexity_quantized=ppl_quant,
        relative_perplexity_change=(ppl_quant - ppl_ref) / ppl_ref,
        top1_agreement=float((quant.argmax(-1) == ref.argmax(-1)).float().mean()),
    )
