"""Chapter 7 on Chapter 14's pools: the Triton paged decode kernels reading int8 / fp8 K and V with their scales.

The pools come from an 8-bit kvlab.cache.paged_cache.PagedKVCache (random K/V written through its `write`, a
prefill then one decode token, so block scales grow and requantise as in serving), and the kernels get
its k_pools[layer], v_pools[layer], k_scales[layer] and v_scales[layer] as they are. Tolerances:

  kernel vs the reference on the dequantised pool   atol = rtol = 1e-5 with fp32 q (only the summation order
                                                    differs; measured 2e-6 on outputs up to about 5), the output
                                                    dtype's rounding with fp16 / bf16 q (2e-3, 2e-2; bf16 measured
                                                    0.016, one bf16 step at 2-4)
  kernel vs attention on the original fp32 K/V      |diff| <= TOL_VS_UNQUANTIZED x max |v| of the (sequence, head):
                                                    int8 0.03, fp8 0.125 (this test's seed: 0.009 and 0.034; worst
                                                    over 20 seeds: 0.015 and 0.068; fp8 keeps 3 mantissa bits, so
                                                    V alone may be off by 1/16 of its value)

Runs in Triton's interpreter on CPU (kvlab.kernels sets TRITON_INTERPRET=1 without CUDA); shapes stay short.
"""

import pytest
import torch

import kvlab.kernels.split_kv as split_kv
import kvlab.kernels.triton_unified_attention as unified
from kvlab.cache.paged_cache import PagedKVCache, paged_attention
from kvlab.kernels import (
    launch_paged_decode,
    launch_paged_decode_split_kv,
    paged_attention_decode,
    paged_attention_decode_reference,
    paged_attention_decode_split_kv,
    quantized_cache_dtypes,
    validate_paged_decode_inputs,
)
from kvlab.kernels.interpreter import RUNS_IN_INTERPRETER
from kvlab.quantization import quantize

DEVICE = torch.device("cpu" if RUNS_IN_INTERPRETER else "cuda")
HAS_FP8 = hasattr(torch, "float8_e4m3fn")
KV_DTYPES = ["int8", pytest.param("fp8", marks=pytest.mark.skipif(
    not HAS_FP8, reason=f"torch {torch.__version__} has no torch.float8_e4m3fn (it arrived in torch 2.1)"))]
KERNELS = {"one-pass": paged_attention_decode, "split-KV": paged_attention_decode_split_kv}
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
TOL_VS_UNQUANTIZED = {"int8": 0.03, "fp8": 0.125}
LAYER = 1  # of a 2-layer cache: the kernels read whichever layer's pools and scales they are given


class Batch:
    """A decode batch on an 8-bit PagedKVCache, and the same K/V unquantised in fp32 pools of the same layout."""

    def __init__(self, kv_cache_dtype, seq_lens, *, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                 q_dtype=torch.float32, spare_blocks=3, seed=0):
        gen = torch.Generator().manual_seed(seed)
        blocks_needed = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_needed) + spare_blocks
        self.cache = PagedKVCache(2, num_blocks, block_size, num_kv_heads, head_dim, kv_cache_dtype=kv_cache_dtype,
                                           device=DEVICE)
        self.k_orig = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE)
        self.v_orig = torch.zeros_like(self.k_orig)
        placement = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables = torch.full((len(seq_lens), max(blocks_needed) + 1), -1, dtype=torch.int32)
        # Heads and blocks of different ranges, so each (block, head) gets its own scale and a wrong one shows.
        head_range = torch.tensor([0.5, 1.5])[torch.arange(num_kv_heads) % 2]
        for i, n in enumerate(seq_lens):
            blocks = [placement.pop() for _ in range(blocks_needed[i])]
            self.tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            block_range = torch.tensor([0.5, 1.0, 2.0])[torch.arange(n) // block_size % 3]
            ranges = block_range[:, None, None] * head_range[None, :, None]           # [n, Hkv, 1]
            k = torch.randn(n, num_kv_heads, head_dim, generator=gen) * ranges
            v = torch.randn(n, num_kv_heads, head_dim, generator=gen) * ranges
            slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(n)])
            k, v, slots = k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE)
            # Layer 0 gets other values: reading the wrong layer's pools or scales would show.
            self.cache.write(0, -2 * v, 3 * k, slots)
            # The prompt, then the new token's K/V, written before the decode attends (as the runner hook does).
            self.cache.write(LAYER, k[:-1], v[:-1], slots[:-1])
            self.cache.write(LAYER, k[-1:], v[-1:], slots[-1:])
            self.k_orig.view(-1, num_kv_heads, head_dim)[slots] = k
            self.v_orig.view(-1, num_kv_heads, head_dim)[slots] = v
        self.q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(q_dtype).to(DEVICE)
        self.tables = self.tables.to(DEVICE)
        self.lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)

    @property
    def args(self):
        """Positional arguments of the kernels, as before quantization: q, k_cache, v_cache, block_tables, seq_lens."""
        return [self.q, self.cache.k_pools[LAYER], self.cache.v_pools[LAYER], self.tables, self.lens]

    @property
    def scales(self):
        return {"k_scale": self.cache.k_scales[LAYER], "v_scale": self.cache.v_scales[LAYER]}


def check(name, yours, spec, tol):
    """Same shape and dtype as the spec and within tol; print both side by side if not."""
    assert yours.shape == spec.shape and yours.dtype == spec.dtype, (
        f"{name}: got {tuple(yours.shape)} {yours.dtype}, expected {tuple(spec.shape)} {spec.dtype} "
        f"(q's shape and dtype)")
    diff = (yours.float() - spec.float()).abs()
    worst = int(diff.flatten().nan_to_num(float("inf")).argmax())
    assert torch.allclose(yours.float(), spec.float(), atol=tol, rtol=tol), (
        f"{name}: max |yours - spec| = {diff.max().item():.3g} (tolerance {tol:g})\n"
        f"  Yours: {yours.flatten()[worst:worst + 4].tolist()}\n  Spec:  {spec.flatten()[worst:worst + 4].tolist()}")


@pytest.mark.parametrize("kernel_name", list(KERNELS))
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_kernels_equal_the_reference_on_the_dequantised_pool(kv_cache_dtype, kernel_name):
    """Load 8 bits, convert to fp32, times the (block, head) scale: the reference's numbers to fp32 rounding."""
    batch = Batch(kv_cache_dtype, [1, 45, 16, 70])
    assert batch.cache.k_pools[LAYER].dtype in quantized_cache_dtypes()
    k_real, v_real = batch.cache.dequantized(LAYER)  # fp32 [num_blocks, block_size, Hkv, D]
    spec = paged_attention_decode_reference(batch.q, k_real, v_real, batch.tables, batch.lens)
    dequantising_spec = paged_attention_decode_reference(*batch.args, **batch.scales)
    assert torch.equal(dequantising_spec, spec), "the reference with scales dequantises exactly as the cache does"
    kwargs = {"num_splits": 2} if kernel_name == "split-KV" else {}
    out = KERNELS[kernel_name](*batch.args, **batch.scales, **kwargs)
    check(f"{kernel_name} on {kv_cache_dtype} pools vs the reference on dequantised pools", out, spec,
          TOL[torch.float32])


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_close_to_attention_on_the_unquantized_kv(kv_cache_dtype):
    """What 8 bits cost: within TOL_VS_UNQUANTIZED x max |v| (per sequence and head) of the fp32 answer."""
    batch = Batch(kv_cache_dtype, [1, 45, 16, 70], seed=1)
    exact = paged_attention_decode_reference(batch.q, batch.k_orig, batch.v_orig, batch.tables, batch.lens)
    group = batch.q.shape[1] // batch.k_orig.shape[2]
    for name, kernel in KERNELS.items():
        out = kernel(*batch.args, **batch.scales)
        for i, n in enumerate(batch.lens.tolist()):
            blocks = batch.tables[i, : -(-n // 16)].long()
            v_max = batch.v_orig[blocks].flatten(0, 1)[:n].abs().amax(dim=(0, 2)).repeat_interleave(group)  # [H]
            error = ((out[i] - exact[i]).abs().amax(dim=-1) / v_max).max().item()
            assert error <= TOL_VS_UNQUANTIZED[kv_cache_dtype], (
                f"{name}, {kv_cache_dtype}, sequence {i} ({n} tokens): off by {error:.3f} x max |v| from attention on "
                f"the unquantised K/V (tolerance {TOL_VS_UNQUANTIZED[kv_cache_dtype]})")
        assert not torch.equal(out, exact), "8-bit pools cannot reproduce fp32 attention exactly"


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_fp16_and_bf16_queries_on_8_bit_pools(kv_cache_dtype, q_dtype):
    """fp16 or bf16 q over int8 / fp8 pools (head_dim 80, padded): out in q's dtype with the reference's values."""
    batch = Batch(kv_cache_dtype, [33, 9], head_dim=80, q_dtype=q_dtype)
    spec = paged_attention_decode_reference(*batch.args, **batch.scales)
    for name, kernel in KERNELS.items():
        check(f"{name}, {q_dtype} q on {kv_cache_dtype} pools", kernel(*batch.args, **batch.scales), spec, TOL[q_dtype])


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 1), (8, 2)], ids=["MHA", "MQA", "GQA-4:1"])
def test_each_query_head_uses_its_kv_heads_scale(num_heads, num_kv_heads):
    """The scale row is [num_kv_heads]: query head h reads scale[block, h // (num_heads // num_kv_heads)]."""
    batch = Batch("int8", [9, 40], num_heads=num_heads, num_kv_heads=num_kv_heads)
    spec = paged_attention_decode_reference(*batch.args, **batch.scales)
    for name, kernel in KERNELS.items():
        check(f"{name}, {num_heads} heads on {num_kv_heads} KV heads", kernel(*batch.args, **batch.scales), spec, 1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_split_kv_equals_the_one_pass_kernel(num_splits):
    """Split-KV on int8 pools: splits rescaled and added give the one-pass answer, empty splits included."""
    batch = Batch("int8", [150, 1], num_heads=2, num_kv_heads=1)
    one_pass = paged_attention_decode(*batch.args, **batch.scales)
    check(f"split-KV ({num_splits} splits) vs one-pass", paged_attention_decode_split_kv(
        *batch.args, **batch.scales, num_splits=num_splits), one_pass, 1e-5)
    check("one-pass vs the reference", one_pass, paged_attention_decode_reference(*batch.args, **batch.scales), 1e-5)


def test_matches_the_caches_quantized_attention():
    """The kernel agrees with the 8-bit cache's own path (gather, dequantise, causal attention) for one query."""
    batch = Batch("int8", [30, 17], num_heads=4, num_kv_heads=2)
    out = paged_attention_decode(*batch.args, **batch.scales)
    cache = batch.cache
    for i, n in enumerate(batch.lens.tolist()):
        table = batch.tables[i, : -(-n // 16)].tolist()
        chapter10 = paged_attention(batch.q[i][:, None], cache.k_pools[LAYER], cache.v_pools[LAYER], table, n,
                                    64 ** -0.5, cache.k_scales[LAYER], cache.v_scales[LAYER])[0]
        check(f"kernel vs the cache's paged_attention on 8-bit pools, sequence {i}", out[i], chapter10, 1e-5)


def test_quantized_directly_with_the_caches_functions():
    """Pools quantised by hand with kvlab.quantization.quantize and a per-head scale: same answer as the reference."""
    gen = torch.Generator().manual_seed(3)
    k_real, v_real = torch.randn(2, 5, 8, 2, 32, generator=gen)                   # [num_blocks, block_size, Hkv, D]
    k_scale = (k_real.abs().amax(dim=(1, 3)) / 127).contiguous()                   # [num_blocks, Hkv], per block
    v_scale = torch.tensor([0.02, 0.05]).expand(5, 2).contiguous()                # per head only, saturating some
    k_pool, v_pool = quantize(k_real, k_scale[:, None, :], "int8"), quantize(v_real, v_scale[:, None, :], "int8")
    q, tables, lens = torch.randn(2, 4, 32, generator=gen), torch.tensor([[4, 0], [2, 3]], dtype=torch.int32), \
        torch.tensor([13, 9], dtype=torch.int32)
    args = [t.to(DEVICE) for t in (q, k_pool, v_pool, tables, lens)]
    scales = {"k_scale": k_scale.to(DEVICE), "v_scale": v_scale.to(DEVICE)}
    spec = paged_attention_decode_reference(*args, **scales)
    for name, kernel in KERNELS.items():
        check(f"{name} on hand-quantised pools", kernel(*args, **scales), spec, 1e-5)


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_never_reads_scales_or_slots_outside_its_blocks(kv_cache_dtype):
    """Unused blocks get scale 1e30 (and NaN where fp8 has one), slots past the end the largest value: same answer."""
    batch = Batch(kv_cache_dtype, [21, 40], spare_blocks=4)
    spec = paged_attention_decode_reference(*batch.args, **batch.scales)
    k_pool, v_pool = batch.cache.k_pools[LAYER].clone(), batch.cache.v_pools[LAYER].clone()
    k_scale, v_scale = batch.scales["k_scale"].clone(), batch.scales["v_scale"].clone()
    tables = batch.tables.clone()
    used = torch.zeros(k_pool.shape[0], dtype=torch.bool, device=DEVICE)
    big = torch.tensor(127.0 if kv_cache_dtype == "int8" else 448.0)
    for i, n in enumerate(batch.lens.tolist()):
        blocks = tables[i, : -(-n // 16)].long()
        used[blocks] = True
        filled = n - (len(blocks) - 1) * 16
        k_pool[blocks[-1], filled:] = big.to(k_pool.dtype)
        v_pool[blocks[-1], filled:] = (big if kv_cache_dtype == "int8" else torch.tensor(float("nan"))).to(v_pool.dtype)
        tables[i, len(blocks):] = 10**6  # junk past the last used entry
    k_scale[~used], v_scale[~used] = 1e30, 1e30
    if kv_cache_dtype == "fp8":  # 0x7F is float8_e4m3fn's NaN; torch has no masked fill for fp8 itself
        k_pool.view(torch.uint8)[~used], v_pool.view(torch.uint8)[~used] = 0x7F, 0x7F
    for name, kernel in KERNELS.items():
        out = kernel(batch.q, k_pool, v_pool, tables, batch.lens, k_scale=k_scale, v_scale=v_scale)
        assert torch.isfinite(out).all(), f"{name}: NaN/inf in the output, so a poisoned slot or scale was read"
        check(f"{name} on the poisoned pool", out, spec, 1e-5)


def test_the_launchers_take_the_scales_too():
    """launch_paged_decode / launch_paged_decode_split_kv accept k_scale, v_scale after their old arguments."""
    batch = Batch("int8", [20, 5])
    shape = validate_paged_decode_inputs(*batch.args, None, **batch.scales)
    spec = paged_attention_decode_reference(*batch.args, **batch.scales)
    out = torch.empty_like(batch.q)
    check("launch_paged_decode", launch_paged_decode(shape, *batch.args, out, **batch.scales), spec, 1e-5)
    out = torch.empty_like(batch.q)
    check("launch_paged_decode_split_kv", launch_paged_decode_split_kv(shape, *batch.args, out, 2, **batch.scales),
          spec, 1e-5)
    with pytest.raises(ValueError, match="int8 pools need k_scale and v_scale both given"):
        launch_paged_decode(shape, *batch.args, out)


# --- validation: every mistake is a ValueError naming it, raised before any kernel is launched ----------------

def _valid():
    """int8 pools of 6 blocks x 16 slots x 2 KV heads x 64, fp32 q with 4 heads: [args, scales]."""
    batch = Batch("int8", [20, 5])
    return batch.args, batch.scales


def _scale(name, value):
    def mutate(args, scales):
        scales[name] = value(scales[name]) if callable(value) else value
    return mutate


def _put(name, i, j, value):
    """Set one entry of a scale (on a copy: the cache's own scales stay valid)."""
    def mutate(args, scales):
        scales[name] = scales[name].clone()
        scales[name][i, j] = value
    return mutate


def _pools(to):
    def mutate(args, scales):
        args[1], args[2] = to(args[1]), to(args[2])
    return mutate


def _fp8_to(dtype_name):
    return lambda t: (t.float() * 0).to(getattr(torch, dtype_name))


def _bytes(t):
    """A copy of t's bytes: compares NaN scales and fp8 pools (which torch.equal cannot) exactly."""
    return t.contiguous().view(torch.uint8).clone()


BAD_INPUTS = {
    "int8 pools without scales": (lambda a, s: s.clear(), "required \\(k_scale and v_scale missing\\)"),
    "int8 pools without v_scale": (lambda a, s: s.pop("v_scale"), "\\(v_scale missing\\)"),
    "k_scale of one block only": (_scale("k_scale", lambda t: t[:1]),
                                  "shape \\[num_blocks, num_kv_heads\\] = \\(6, 2\\)"),
    "v_scale per head only": (_scale("v_scale", lambda t: t[0]), "v_scale must have shape"),
    "k_scale transposed": (_scale("k_scale", lambda t: t.t().contiguous()), "got \\(2, 6\\)"),
    "fp16 k_scale": (_scale("k_scale", lambda t: t.half()), "k_scale must be float32"),
    "float64 v_scale": (_scale("v_scale", lambda t: t.double()), "v_scale must be float32"),
    "k_scale on another device": (_scale("k_scale", lambda t: t.to("meta")), "k_scale is on meta"),
    "a broadcast (non-contiguous) v_scale": (_scale("v_scale", lambda t: t[:1].expand(6, 2)),
                                             "v_scale must be contiguous"),
    "a NaN scale": (_put("k_scale", 4, 1, float("nan")),
                    "k_scale\\[4, 1\\] is nan: every scale must be positive and finite"),
    "an infinite scale": (_put("v_scale", 0, 0, float("inf")), "v_scale\\[0, 0\\] is inf"),
    "a zero scale": (_put("k_scale", 2, 0, 0.0), "k_scale\\[2, 0\\] is 0.0"),
    "a negative scale": (_scale("v_scale", lambda t: -t), "v_scale\\[0, 0\\] is -"),
    "int8 q": (lambda a, s: a.__setitem__(0, a[0].to(torch.int8)), "q has dtype int8, which is not supported"),
    "int8 K with fp8 V": (lambda a, s: a.__setitem__(2, _fp8_to("float8_e4m3fn")(a[2])), "must share one dtype"),
    "fp8 e5m2 pools": (_pools(_fp8_to("float8_e5m2")), "float8_e5m2, which is not supported"),
    "uint8 pools": (_pools(lambda t: t.view(torch.uint8)), "uint8, which is not supported"),
    "scales with fp32 pools": (_pools(lambda t: t.float()), "scales are only for int8 or fp8 pools"),
    "k_scale alone with fp16 pools": (lambda a, s: [_pools(lambda t: t.half())(a, s), s.pop("v_scale"),
                                                     a.__setitem__(0, a[0].half())],
                                      "k_scale given, but the caches are"),
}


@pytest.mark.parametrize("kernel_name", list(KERNELS))
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_quantized_inputs_raise_before_launch(case, kernel_name, monkeypatch):
    """Each mistake raises ValueError naming it before any kernel is launched; the inputs are left as they were."""
    if not HAS_FP8 and ("fp8" in case or "e5m2" in case):
        pytest.skip(f"torch {torch.__version__} has no float8 dtypes")
    args, scales = _valid()
    mutate, message = BAD_INPUTS[case]
    mutate(args, scales)
    before = [_bytes(t) for t in args + list(scales.values()) if t.device.type != "meta"]

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError(f"{case}: a kernel was launched; validation must reject the inputs first")

    monkeypatch.setattr(unified, "unified_attention_kernel", NoLaunch())
    for name in ("paged_decode_split_kernel", "split_reduce_kernel"):
        monkeypatch.setattr(split_kv, name, NoLaunch())
    with pytest.raises(ValueError, match=message):
        KERNELS[kernel_name](*args, **scales)
    after = [_bytes(t) for t in args + list(scales.values()) if t.device.type != "meta"]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), f"{case}: the call modified an input"


def test_a_scale_that_is_not_a_tensor_is_a_type_error():
    """One number for every block is not accepted: build the [num_blocks, num_kv_heads] tensor (torch.full)."""
    args, scales = _valid()
    with pytest.raises(TypeError, match="k_scale must be a torch.Tensor"):
        paged_attention_decode(*args, k_scale=0.1, v_scale=scales["v_scale"])


@pytest.mark.skipif(not HAS_FP8, reason="needs an fp8 pool to pass while pretending torch has no float8")
@pytest.mark.parametrize("kernel_name", list(KERNELS))
def test_fp8_pools_on_a_torch_without_float8(kernel_name, monkeypatch):
    """Where torch lacks float8_e4m3fn, only int8 pools are quantized, and an fp8 request says why."""
    batch = Batch("fp8", [20, 5])
    monkeypatch.delattr(torch, "float8_e4m3fn")
    assert quantized_cache_dtypes() == (torch.int8,)
    with pytest.raises(ValueError, match="fp8 pools need torch.float8_e4m3fn, which torch .* does not have"):
        KERNELS[kernel_name](*batch.args, **batch.scales)


def test_the_reference_refuses_8_bit_pools_without_scales():
    """The spec would otherwise attend over raw int8 codes."""
    args, scales = _valid()
    with pytest.raises(ValueError, match="int8 pools hold scaled values: pass k_scale and v_scale"):
        paged_attention_decode_reference(*args)
    with pytest.raises(ValueError, match="give both k_scale and v_scale"):
        paged_attention_decode_reference(*args, k_scale=scales["k_scale"])
