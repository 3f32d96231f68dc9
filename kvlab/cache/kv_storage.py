"""How a paged cache keeps K and V: the storage format behind every PagedKVCache (vLLM's kv_cache_dtype).

    "auto"                   K/V in the model's dtype (float32, float16 or bfloat16), as Chapter 3 stores them
    "int8", "fp8_e4m3"       8-bit values plus a float32 scale per (block, KV head) for K and one for V
                             ("fp8" is accepted for fp8_e4m3, as vLLM does)
    "int8_per_token_head",   8-bit values plus a float32 scale per (token, KV head) for K and one for V,
    "fp8_per_token_head"     found from the token's own values when it is written (vLLM's formats of
                             these names); nothing is ever rounded twice

Each layer has a K pool and a V pool [num_blocks, block_size, Hkv, D]; an 8-bit storage also has
k_scales[layer] and v_scales[layer] [num_blocks, Hkv], and

    stored = quantize(x / scale)        x ~ stored * scale (dequantised when read)

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

A storage writes K/V by slot and reads them back as real numbers (a sequence through its block
table, or any list of slots); `kernel_inputs` hands a kernel the raw pools and scales instead.
`block_tensors` lists every tensor indexed by block, which copy-on-write and swapping must move
together, and `block_bytes` is the one formula for what a block of each format costs.
"""

import torch

from kvlab.analysis.kv_size import DTYPE_BYTES, kv_cache_bytes_per_token, kv_shape
from kvlab.quantization import (
    PER_TOKEN_HEAD_KV_CACHE_DTYPES,
    SCALE_BYTES,
    SCALE_FLOOR,
    SUPPORTED_KV_CACHE_DTYPES,
    dequantize,
    quantize,
    scale_granularity,
    storage_format,
)
from kvlab.validation import check_block_size

# What a paged cache and the engine accept.
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", *PER_TOKEN_HEAD_KV_CACHE_DTYPES)
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}     # vLLM's "fp8" means e4m3


def resolve_kv_cache_dtype(kv_cache_dtype) -> str:
    """vLLM's kv_cache_dtype checked and made canonical: 'auto', 'int8', 'fp8_e4m3' ('fp8' is fp8_e4m3),
    'int8_per_token_head' or 'fp8_per_token_head'."""
    name = KV_CACHE_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"unsupported kv_cache_dtype {kv_cache_dtype!r}; choose 'auto' (K/V in the model's dtype), 'int8' or "
            f"'fp8_e4m3' (also spelled 'fp8') for a scale per (block, KV head), or 'int8_per_token_head' / "
            f"'fp8_per_token_head' for a scale per (token, KV head): one of auto, int8, fp8, fp8_e4m3, "
            f"int8_per_token_head, fp8_per_token_head"
        )
    return name


def gather_kv(pool: torch.Tensor, block_table: list[int], seq_len: int) -> torch.Tensor:
    """One sequence's keys (or values) from its blocks: pool [num_blocks, block_size, Hkv, D] -> [Hkv, seq_len, D]."""
    blocks = pool[torch.as_tensor(block_table, dtype=torch.long, device=pool.device)]  # [n, block_size, Hkv, D]
    return blocks.flatten(0, 1)[:seq_len].transpose(0, 1)


def gather_dequantized(pool: torch.Tensor, scales: torch.Tensor, block_table: list[int], seq_len: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One sequence's dequantised keys (or values) -> [Hkv, seq_len, D].

    pool: [num_blocks, block_size, Hkv, D] of int8 / fp8; scales: [num_blocks, Hkv].
    """
    stored = gather_kv(pool, block_table, seq_len)  # [Hkv, seq_len, D], still int8 / fp8
    table = torch.as_tensor(block_table, dtype=torch.long, device=pool.device)
    per_token = scales[table].repeat_interleave(pool.shape[1], dim=0)[:seq_len]  # [seq_len, Hkv]
    return dequantize(stored, per_token.transpose(0, 1), dtype)


class KVStorage:
    """K and V in the model's dtype ("auto"): per layer two pools [num_blocks, block_size, Hkv, D]."""

    kv_cache_dtype = "auto"
    scale_granularity = None  # no scales: the values are stored as they are

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32, device="cpu",
                 pool_dtype: torch.dtype | None = None):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        pool_dtype = dtype if pool_dtype is None else pool_dtype
        self.k_pools = [torch.zeros(shape, dtype=pool_dtype, device=device) for _ in range(num_layers)]
        self.v_pools = [torch.zeros(shape, dtype=pool_dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype = dtype  # what attention computes in: the model's dtype
        self.device = self.k_pools[0].device if self.k_pools else torch.device(device)

    @property
    def num_layers(self) -> int:
        """Layers with a pool."""
        return len(self.k_pools)

    @property
    def num_slots(self) -> int:
        """Token slots in each pool."""
        return self.num_blocks * self.block_size

    @property
    def k_scales(self) -> list[torch.Tensor]:
        """K's scales per layer, [num_blocks, Hkv] each; none here, the values are stored as they are."""
        return []

    @property
    def v_scales(self) -> list[torch.Tensor]:
        """V's scales per layer; none here."""
        return []

    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor whose first dim is the block ([num_blocks, ...]): what a block copy or a swap must move."""
        return self.k_pools + self.v_pools + self.k_scales + self.v_scales

    @property
    def nbytes(self) -> int:
        """Bytes of every pool (and every scale)."""
        return sum(t.numel() * t.element_size() for t in self.block_tensors())

    def check_slots(self, slot_mapping: torch.Tensor, num_tokens: int) -> None:
        if slot_mapping.shape != (num_tokens,):
            raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}; expected ({num_tokens},), "
                             f"one slot per token")
        if slot_mapping.numel() and (int(slot_mapping.min()) < 0 or int(slot_mapping.max()) >= self.num_slots):
            bad = slot_mapping[(slot_mapping < 0) | (slot_mapping >= self.num_slots)][0]
            raise ValueError(f"slot {int(bad)} is outside the pool of {self.num_slots} slots "
                             f"({self.num_blocks} blocks of {self.block_size})")

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping, checked: bool = False) -> None:
        """Store new k, v [T, Hkv, D] at their slots of layer layer_idx's pools (all checks before any change).

        checked=True: slot_mapping is a long tensor on the pools' device whose slots were already checked
        (once per forward pass, by the paged cache), so no layer reads it back from the device.
        """
        if not checked:
            slot_mapping = torch.as_tensor(slot_mapping, dtype=torch.long, device=k.device)
            self.check_slots(slot_mapping, k.shape[0])
            self._store(layer_idx, k, v, slot_mapping)
            return
        if slot_mapping.shape != (k.shape[0],):
            raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}; expected ({k.shape[0]},)")
        self._store_in_pass(layer_idx, k, v, slot_mapping)

    def prepare_pass(self, slot_mapping: torch.Tensor) -> None:
        """Before a forward pass: what its writes need, computed once on the host (slot_mapping: host int64 [T])."""

    def finish_pass(self) -> None:
        """After a forward pass: raise what its writes found wrong (the pools are then as they were)."""

    def _store_in_pass(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self._store(layer_idx, k, v, slot_mapping)

    def _store(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.k_pools[layer_idx].view(self.num_slots, *k.shape[1:])[slot_mapping] = k
        self.v_pools[layer_idx].view(self.num_slots, *v.shape[1:])[slot_mapping] = v

    def gather(self, layer_idx: int, block_table: list[int], seq_len: int, dtype: torch.dtype):
        """One sequence's K and V through its block table, as real numbers (already dtype): two [Hkv, seq_len, D]."""
        return (gather_kv(self.k_pools[layer_idx], block_table, seq_len),
                gather_kv(self.v_pools[layer_idx], block_table, seq_len))

    def gather_slots(self, layer_idx: int, slots: torch.Tensor, dtype: torch.dtype):
        """K and V of any slots [N] (int64), as real numbers: two [N, Hkv, D] (already in dtype here)."""
        shape = (-1, self.num_kv_heads, self.head_dim)
        return (self.k_pools[layer_idx].view(shape).index_select(0, slots),
                self.v_pools[layer_idx].view(shape).index_select(0, slots))

    def kernel_inputs(self, layer_idx: int):
        """(k_cache, v_cache, k_scale, v_scale) as kvlab.kernels.paged_attention_decode reads them; scales None here."""
        return self.k_pools[layer_idx], self.v_pools[layer_idx], None, None

    def dequantized(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer layer_idx's K and V pools as real numbers (the pools themselves): [num_blocks, block_size, Hkv, D]."""
        return self.k_pools[layer_idx], self.v_pools[layer_idx]


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


class QuantizedKVStorage(KVStorage):
    """K and V in int8 or fp8 e4m3 pools [num_blocks, block_size, Hkv, D], with float32 scales [num_blocks, Hkv]."""

    scale_granularity = "block"

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, kv_cache_dtype="int8",
                 dtype=torch.float32, device="cpu"):
        pool_dtype, self.qmax = storage_format(kv_cache_dtype)  # raises for an unsupported name
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, pool_dtype)
        self.kv_cache_dtype = KV_CACHE_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
        self._k_scales = [torch.full((num_blocks, num_kv_heads), SCALE_FLOOR, device=device) for _ in range(num_layers)]
        self._v_scales = [torch.full((num_blocks, num_kv_heads), SCALE_FLOOR, device=device) for _ in range(num_layers)]
        self.static = [False] * num_layers  # True once set_scales fixed the layer's scales
        # (block, head) pairs whose stored values were rounded a second time: counted on the pools' device,
        # so a write never waits for the GPU; read through num_requantized.
        self._requantized = torch.zeros((), dtype=torch.long, device=device)

    @property
    def k_scales(self) -> list[torch.Tensor]:
        """K's scale per (block, KV head) for every layer: [num_blocks, Hkv] float32 each."""
        return self._k_scales

    @property
    def num_requantized(self) -> int:
        """(block, KV head) pairs whose stored values were rounded again when their scale grew."""
        return int(self._requantized)

    @property
    def v_scales(self) -> list[torch.Tensor]:
        """V's scale per (block, KV head) for every layer."""
        return self._v_scales

    @staticmethod
    def _block_plan(slot_mapping: torch.Tensor, block_size: int):
        """(blocks [T], touched [n], which [T], fresh [n]): each token's block, the blocks written, each token's
        index among them, and which of them start at their first slot (a block starting afresh)."""
        blocks = slot_mapping // block_size
        touched, which = blocks.unique(return_inverse=True)
        fresh = torch.isin(touched, blocks[slot_mapping % block_size == 0])
        return blocks, touched, which, fresh

    def _quantize_into(self, pool: torch.Tensor, scales: torch.Tensor, static: bool, x: torch.Tensor,
                       slot_mapping: torch.Tensor, plan=None, ok=None) -> None:
        """Quantise x [T, Hkv, D] into pool at slot_mapping, growing (and requantising) block scales as needed.

        plan: _block_plan's tensors, computed once per pass; ok: a device bool, False to leave everything as it was
        (the pass found NaN or inf, reported after it without a sync per layer).
        """
        blocks, touched, which, fresh = plan or self._block_plan(slot_mapping, self.block_size)

        def keep_unless_bad(new, old):
            return new if ok is None else torch.where(ok, new, old)

        if not static:
            token_amax = x.abs().amax(dim=-1).float()  # [T, Hkv]
            amax = torch.zeros(len(touched), x.shape[1], device=x.device).scatter_reduce_(
                0, which[:, None].expand_as(token_amax), token_amax, "amax")  # [n, Hkv]
            old = scales[touched]
            base = torch.where(fresh[:, None], torch.full_like(old, SCALE_FLOOR), old)
            new = torch.maximum(base, amax / self.qmax)  # [n, Hkv]
            # Existing values of a block whose scale grows are rounded again at the new scale. Every touched
            # block goes through it, with no test that would read a flag back from the device: where the scale
            # stayed, dividing by the scale it was multiplied by gives back the stored value exactly.
            grown = (new > base) & ~fresh[:, None]
            stored = pool[touched]
            kept = quantize(dequantize(stored, old[:, None, :]), new[:, None, :], self.kv_cache_dtype)
            # A block that starts afresh drops whatever a previous owner left in it.
            kept = torch.where(fresh[:, None, None, None], torch.zeros((), dtype=pool.dtype, device=pool.device), kept)
            pool[touched] = keep_unless_bad(kept, stored)
            self._requantized += grown.sum() if ok is None else grown.sum() * ok
            scales[touched] = keep_unless_bad(new, old)
        flat = pool.view(self.num_slots, *pool.shape[2:])
        flat[slot_mapping] = keep_unless_bad(quantize(x, scales[blocks], self.kv_cache_dtype), flat[slot_mapping])

    def _store(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
            raise ValueError(f"layer {layer_idx}: K or V holds NaN or inf, which no scale can represent")
        if slot_mapping.numel() == 0:
            return
        static = self.static[layer_idx]
        self._quantize_into(self.k_pools[layer_idx], self.k_scales[layer_idx], static, k, slot_mapping)
        self._quantize_into(self.v_pools[layer_idx], self.v_scales[layer_idx], static, v, slot_mapping)

    def prepare_pass(self, slot_mapping: torch.Tensor) -> None:
        """The pass's block plan, on the host (torch.unique would wait for the GPU), moved to the device once."""
        self.finish_pass()  # a pass that was never finished still reports what it found
        plan = self._block_plan(slot_mapping.cpu(), self.block_size)
        self._pass_plan = tuple(t.to(self.device, non_blocking=True) for t in plan)
        self._pass_bad = torch.zeros(self.num_layers, dtype=torch.bool, device=self.device)

    def finish_pass(self) -> None:
        """One read-back per pass: a layer whose K or V held NaN or inf wrote nothing, and is named here."""
        bad = getattr(self, "_pass_bad", None)
        self._pass_bad = None
        if bad is not None and bool(bad.any()):
            layers = bad.nonzero()[:, 0].tolist()
            raise ValueError(f"layer(s) {layers}: K or V held NaN or inf, which no scale can represent; "
                             f"nothing of this pass was stored")

    def _store_in_pass(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if getattr(self, "_pass_bad", None) is None:  # written outside a prepared pass: the checks as usual
            return self._store(layer_idx, k, v, slot_mapping)
        if slot_mapping.numel() == 0:
            return
        ok = torch.isfinite(k).all() & torch.isfinite(v).all()   # stays on the device
        self._pass_bad[layer_idx] = ~ok
        static = self.static[layer_idx]
        self._quantize_into(self.k_pools[layer_idx], self.k_scales[layer_idx], static, k, slot_mapping,
                            self._pass_plan, ok)
        self._quantize_into(self.v_pools[layer_idx], self.v_scales[layer_idx], static, v, slot_mapping,
                            self._pass_plan, ok)

    def gather(self, layer_idx: int, block_table: list[int], seq_len: int, dtype: torch.dtype):
        """One sequence's K and V through its block table, dequantised to dtype: two [Hkv, seq_len, D]."""
        return (gather_dequantized(self.k_pools[layer_idx], self.k_scales[layer_idx], block_table, seq_len, dtype),
                gather_dequantized(self.v_pools[layer_idx], self.v_scales[layer_idx], block_table, seq_len, dtype))

    def gather_slots(self, layer_idx: int, slots: torch.Tensor, dtype: torch.dtype):
        """K and V of any slots [N] (int64), dequantised to dtype with their blocks' scales: two [N, Hkv, D]."""
        stored_k, stored_v = super().gather_slots(layer_idx, slots, dtype)
        blocks = slots // self.block_size
        return (dequantize(stored_k, self.k_scales[layer_idx].index_select(0, blocks), dtype),
                dequantize(stored_v, self.v_scales[layer_idx].index_select(0, blocks), dtype))

    def kernel_inputs(self, layer_idx: int):
        """(k_cache, v_cache, k_scale, v_scale): the 8-bit pools and their [num_blocks, Hkv] float32 scales."""
        return self.k_pools[layer_idx], self.v_pools[layer_idx], self.k_scales[layer_idx], self.v_scales[layer_idx]

    def dequantized(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer layer_idx's K and V pools as real numbers: two [num_blocks, block_size, Hkv, D] tensors."""
        return (dequantize(self.k_pools[layer_idx], self.k_scales[layer_idx][:, None, :], self.dtype),
                dequantize(self.v_pools[layer_idx], self.v_scales[layer_idx][:, None, :], self.dtype))

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


class PerTokenHeadKVStorage(QuantizedKVStorage):
    """K and V in int8 or fp8 e4m3 pools [num_blocks, block_size, Hkv, D], with float32 scales
    [num_blocks, block_size, Hkv]: one per token and KV head, as vLLM's int8_per_token_head / fp8_per_token_head.

    A token's scale is amax over its head_dim / 127 (int8) or / 448 (fp8), found when it is written, so a
    large value in one token costs no precision in its neighbours and nothing is requantised.
    """

    scale_granularity = "token"

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, kv_cache_dtype="int8_per_token_head",
                 dtype=torch.float32, device="cpu"):
        if kv_cache_dtype not in PER_TOKEN_HEAD_KV_CACHE_DTYPES:
            raise ValueError(f"PerTokenHeadKVStorage stores {', '.join(PER_TOKEN_HEAD_KV_CACHE_DTYPES)}, "
                             f"got {kv_cache_dtype!r} (its per-block formats are QuantizedKVStorage's)")
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim, kv_cache_dtype, dtype, device)
        shape = (num_blocks, block_size, num_kv_heads)
        self._k_scales = [torch.full(shape, SCALE_FLOOR, device=device) for _ in range(num_layers)]
        self._v_scales = [torch.full(shape, SCALE_FLOOR, device=device) for _ in range(num_layers)]

    @property
    def k_scales(self) -> list[torch.Tensor]:
        """K's scale per (token slot, KV head) for every layer: [num_blocks, block_size, Hkv] float32 each."""
        return self._k_scales

    @property
    def v_scales(self) -> list[torch.Tensor]:
        """V's scale per (token slot, KV head) for every layer."""
        return self._v_scales

    def _quantize_into(self, pool: torch.Tensor, scales: torch.Tensor, static: bool, x: torch.Tensor,
                       slot_mapping: torch.Tensor, plan=None, ok=None) -> None:
        """Quantise x [T, Hkv, D] into pool at slot_mapping, each (token, head) at its own scale (ok: as above)."""
        scale = (x.abs().amax(dim=-1).float() / self.qmax).clamp_min(SCALE_FLOOR)  # [T, Hkv]
        stored = quantize(x, scale, self.kv_cache_dtype)
        flat_pool = pool.view(self.num_slots, *pool.shape[2:])
        flat_scales = scales.view(self.num_slots, scales.shape[-1])
        if ok is not None:  # a pass that found NaN or inf leaves every slot as it was
            stored = torch.where(ok, stored, flat_pool[slot_mapping])
            scale = torch.where(ok, scale, flat_scales[slot_mapping])
        flat_pool[slot_mapping] = stored
        flat_scales[slot_mapping] = scale

    def prepare_pass(self, slot_mapping: torch.Tensor) -> None:
        """Only the pass's NaN flags: a token's scale needs no plan of the blocks it touches."""
        self.finish_pass()
        self._pass_plan = None
        self._pass_bad = torch.zeros(self.num_layers, dtype=torch.bool, device=self.device)

    def gather(self, layer_idx: int, block_table: list[int], seq_len: int, dtype: torch.dtype):
        """One sequence's K and V through its block table, dequantised to dtype: two [Hkv, seq_len, D]."""
        table = torch.as_tensor(block_table, dtype=torch.long, device=self.device)
        out = []
        for pool, scales in ((self.k_pools[layer_idx], self.k_scales[layer_idx]),
                             (self.v_pools[layer_idx], self.v_scales[layer_idx])):
            per_token = scales[table].flatten(0, 1)[:seq_len]  # [seq_len, Hkv]
            out.append(dequantize(gather_kv(pool, block_table, seq_len), per_token.transpose(0, 1), dtype))
        return tuple(out)

    def gather_slots(self, layer_idx: int, slots: torch.Tensor, dtype: torch.dtype):
        """K and V of any slots [N] (int64), each dequantised with its own scale: two [N, Hkv, D]."""
        stored_k, stored_v = KVStorage.gather_slots(self, layer_idx, slots, dtype)
        flat = (self.num_slots, self.num_kv_heads)
        return (dequantize(stored_k, self.k_scales[layer_idx].view(flat).index_select(0, slots), dtype),
                dequantize(stored_v, self.v_scales[layer_idx].view(flat).index_select(0, slots), dtype))

    def kernel_inputs(self, layer_idx: int):
        """Refused: the Triton kernels of Chapter 7 read one scale per (block, KV head)."""
        raise ValueError(
            f"kv_cache_dtype {self.kv_cache_dtype!r} keeps a scale per (token, KV head), and kvlab's Triton kernels "
            f"read one per (block, KV head): use attention_backend 'torch' or 'reference' with it, or "
            f"kv_cache_dtype 'int8' / 'fp8_e4m3' with the kernels"
        )

    def dequantized(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer layer_idx's K and V pools as real numbers: two [num_blocks, block_size, Hkv, D] tensors."""
        return (dequantize(self.k_pools[layer_idx], self.k_scales[layer_idx], self.dtype),
                dequantize(self.v_pools[layer_idx], self.v_scales[layer_idx], self.dtype))

    def set_scales(self, layer_idx: int, k_scale, v_scale) -> None:
        """Refused: a per-token-head scale is found from each token as it is written (vLLM ignores checkpoint scales
        for these formats too)."""
        raise ValueError(
            f"kv_cache_dtype {self.kv_cache_dtype!r} computes a scale for every token and KV head when the token is "
            f"written, so there is no fixed scale to set; calibrated scales apply to 'int8' and 'fp8_e4m3'"
        )


def make_kv_storage(kv_cache_dtype, num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                    dtype=torch.float32, device="cpu") -> KVStorage:
    """The storage for a kv_cache_dtype ('auto', 'int8', 'fp8', 'fp8_e4m3', 'int8_per_token_head' or
    'fp8_per_token_head'); a ValueError naming them otherwise."""
    name = resolve_kv_cache_dtype(kv_cache_dtype)
    if name == "auto":
        return KVStorage(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    if name in PER_TOKEN_HEAD_KV_CACHE_DTYPES:
        return PerTokenHeadKVStorage(num_layers, num_blocks, block_size, num_kv_heads, head_dim, name, dtype, device)
    return QuantizedKVStorage(num_layers, num_blocks, block_size, num_kv_heads, head_dim, name, dtype, device)


# ---------------------------------------------------------------------------------------------
# What one block costs, before any pool exists: the engine sizes its pool from this.

def _element_dtype(kv_cache_dtype: str) -> tuple[str, str | None]:
    """(kv_size dtype name of one stored element, the scales' granularity: None, 'block' or 'token')."""
    if kv_cache_dtype in SUPPORTED_KV_CACHE_DTYPES:
        return "int8", scale_granularity(kv_cache_dtype)  # int8 and fp8 both store one byte per element
    name = str(kv_cache_dtype).removeprefix("torch.")
    if name in DTYPE_BYTES and name not in ("int8", "fp8", "float8_e4m3fn", "float8_e5m2"):
        return name, None
    raise ValueError(
        f"unsupported kv_cache_dtype {kv_cache_dtype!r}; quantised: {', '.join(SUPPORTED_KV_CACHE_DTYPES)}; "
        f"unquantised: float32, float16, bfloat16"
    )


def block_bytes(config, kv_cache_dtype: str, block_size: int = 16) -> int:
    """Bytes of one block across all layers, K and V: elements, plus the float32 scales when quantised
    (one per KV head per block for 'int8' / 'fp8', one per KV head per token for the per_token_head formats).

    kv_cache_dtype: a stored dtype, 'float32' / 'float16' / 'bfloat16' (what 'auto' stores for such a
    model), 'int8' / 'fp8' / 'fp8_e4m3' or 'int8_per_token_head' / 'fp8_per_token_head'. Equals a built
    cache's nbytes / num_blocks.
    """
    check_block_size(block_size)
    element, granularity = _element_dtype(kv_cache_dtype)
    shape = kv_shape(config)
    scales_per_head = {None: 0, "block": 1, "token": block_size}[granularity]
    scales = 2 * shape["num_layers"] * shape["num_kv_heads"] * scales_per_head * SCALE_BYTES
    return block_size * kv_cache_bytes_per_token(config, element) + scales
