"""The unified paged-attention kernel: chunked prefills, prefix hits and decodes of one ragged step in one launch.

In Triton's interpreter on CPU (as every kernel test here); the same tests run compiled on a GPU.
Every pool slot a sequence does not own holds NaN, and table entries past a sequence's last block
hold garbage, so a kernel that reads anything it must not returns NaN.
"""

import pytest
import torch

import kvlab.kernels.triton_unified_attention as unified
from kvlab.kernels import (
    paged_attention_decode,
    paged_attention_decode_split_kv,
    unified_attention,
    unified_attention_reference,
    validate_paged_attention_inputs,
)
from kvlab.kernels.interpreter import RUNS_IN_INTERPRETER
from kvlab.kernels.load_counter import count_requested_bytes, kv_bytes_held
from kvlab.quantization import quantize, storage_format

DEVICE = torch.device("cpu" if RUNS_IN_INTERPRETER else "cuda")
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def make_step(q_lens, seq_lens, *, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
              seed=0):
    """A ragged step on a shuffled pool, NaN in every slot no sequence owns: (q, k, v, tables, seq_lens, starts)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 2
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    placement = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.randint(-2**30, 2**30, (len(seq_lens), max(needed, default=0) + 2), generator=gen,
                           dtype=torch.int32)   # garbage past each sequence's blocks
    for i, (n, blocks) in enumerate(zip(seq_lens, needed)):
        row = [placement.pop() for _ in range(blocks)]
        tables[i, :blocks] = torch.tensor(row, dtype=torch.int32)
        for j, b in enumerate(row):
            owned[b, :min(block_size, n - j * block_size)] = True
    k[~owned], v[~owned] = float("nan"), float("nan")
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    tensors = (q.to(dtype), k.to(dtype), v.to(dtype), tables, torch.tensor(seq_lens, dtype=torch.int32), starts)
    return tuple(t.to(DEVICE) for t in tensors)


def check(name, yours, spec, tol):
    assert yours.shape == spec.shape and yours.dtype == spec.dtype, f"{name}: shape or dtype differs from q's"
    diff = (yours.float() - spec.float()).abs().nan_to_num(float("inf"))
    assert diff.max().item() <= tol * (1 + spec.float().abs().max().item()), (
        f"{name}: max |kernel - reference| = {diff.max().item():.3g} at token/head/dim "
        f"{tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])} (tolerance {tol:g})")


STEPS = {
    "decodes only": ([1, 1, 1], [5, 16, 11], {}),
    "a prefill, a decode, a chunk after a prefix hit": ([7, 1, 3], [7, 20, 9], {}),
    "GQA 8:1, a chunk longer than a program's 2 tokens": ([5, 1, 17], [12, 1, 40], dict(num_heads=16)),
    "MHA: 16 tokens per program, 40 new tokens": ([40, 2], [45, 30], dict(num_heads=4, num_kv_heads=4)),
    "MQA, head_dim 80 (masked to 128), block size 8": ([4, 1], [9, 70], dict(num_kv_heads=1, head_dim=80,
                                                                          block_size=8)),
    "a sequence with no new tokens": ([0, 3, 0], [4, 3, 9], {}),
    "head_dim 96, block size 32": ([6, 1], [70, 33], dict(head_dim=96, block_size=32)),
    "head_dim 128, block size 128: a tile is half a block": ([3, 1], [130, 129], dict(head_dim=128,
                                                                                    block_size=128)),
    "block size 64, a whole prompt and a long decode": ([64, 1], [64, 200], dict(block_size=64)),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_a_ragged_step_equals_the_reference(name):
    q_lens, seq_lens, kwargs = STEPS[name]
    step = make_step(q_lens, seq_lens, **kwargs)
    check(name, unified_attention(*step), unified_attention_reference(*step), TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_pools(dtype):
    step = make_step([5, 1, 2], [9, 23, 2], dtype=dtype, num_heads=8)
    check(str(dtype), unified_attention(*step), unified_attention_reference(*step), TOL[dtype])


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_8_bit_pools_with_their_scales(kv_cache_dtype):
    q, k, v, tables, lens, starts = make_step([4, 1], [10, 19], num_heads=4)
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
    _, qmax = storage_format(kv_cache_dtype)
    # One scale per (block, KV head): its largest magnitude maps to the format's largest value.
    k_scale, v_scale = (t.abs().amax(dim=(1, 3)).clamp_min(1e-6) / qmax for t in (k, v))
    k8, v8 = quantize(k, k_scale[:, None, :], kv_cache_dtype), quantize(v, v_scale[:, None, :], kv_cache_dtype)
    out = unified_attention(q, k8, v8, tables, lens, starts, k_scale=k_scale, v_scale=v_scale)
    check(kv_cache_dtype, out, unified_attention_reference(q, k8, v8, tables, lens, starts, k_scale=k_scale,
                                                         v_scale=v_scale), 1e-4)


def test_decode_is_the_one_new_token_case_and_agrees_with_split_kv():
    q, k, v, tables, lens, starts = make_step([1, 1, 1, 1], [1, 17, 64, 300], num_heads=8)
    one_pass = paged_attention_decode(q, k, v, tables, lens)
    check("decode wrapper vs unified", one_pass, unified_attention(q, k, v, tables, lens, starts), 1e-6)
    for splits in (1, 2, 5):
        check(f"split-KV x{splits} vs one pass", paged_attention_decode_split_kv(q, k, v, tables, lens,
                                                                                num_splits=splits), one_pass, 1e-5)


@pytest.mark.skipif(not RUNS_IN_INTERPRETER, reason="the byte counter reads the interpreter's loads")
@pytest.mark.parametrize("num_heads, num_kv_heads", [(16, 2), (8, 2), (8, 1)], ids=["GQA 8:1", "GQA 4:1", "MQA"])
def test_a_decode_step_requests_each_cached_byte_once(num_heads, num_kv_heads):
    """One program per (sequence, KV head) serves the whole query-head group: K and V are requested once,
    by the one-pass kernel and by split-KV alike (a program per query head would request them once per head)."""
    q, k, v, tables, lens, starts = make_step([1, 1, 1], [33, 100, 7], num_heads=num_heads,
                                              num_kv_heads=num_kv_heads)
    held = kv_bytes_held(k, lens.tolist())
    for name, run in (("one pass", lambda: paged_attention_decode(q, k, v, tables, lens)),
                      ("split-KV x3", lambda: paged_attention_decode_split_kv(q, k, v, tables, lens, num_splits=3))):
        with count_requested_bytes(k_cache=k, v_cache=v) as reads:
            run()
        for pool in ("k_cache", "v_cache"):
            assert reads[pool] / held <= 1.10, (
                f"{name}, {pool}: the decode requested {reads[pool] / held:.2f}x the bytes the pool holds for "
                "these sequences; one program per (sequence, KV head) should read each byte once")


@pytest.mark.skipif(not RUNS_IN_INTERPRETER, reason="the byte counter reads the interpreter's loads")
def test_causal_blocks_load_only_the_keys_their_tokens_see():
    """A 32-token prefill in blocks of 16 tokens (MHA): the first block stops at position 15, so 48 of 64 rows."""
    q, k, v, tables, lens, starts = make_step([32], [32], num_heads=2, num_kv_heads=2)
    with count_requested_bytes(k_cache=k) as reads:
        unified_attention(q, k, v, tables, lens, starts)
    per_position = 2 * 64 * 4    # KV heads x head_dim x fp32 bytes
    assert reads["k_cache"] == (16 + 32) * per_position


BAD = {
    "query_start_loc not from 0": (lambda s: s[:5] + (s[5] + 1,), "run from 0"),
    "query_start_loc decreasing": (lambda s: s[:5] + (torch.tensor([0, 5, 4, 6], dtype=torch.int32),),
                                   "must not decrease"),
    "query_start_loc short of num_tokens": (lambda s: s[:5] + (torch.tensor([0, 2, 4, 5], dtype=torch.int32),),
                                            "run from 0 to num_tokens"),
    "query_start_loc int64": (lambda s: s[:5] + (s[5].long(),), "int32"),
    "query_start_loc of the wrong length": (lambda s: s[:5] + (s[5][:-1],), r"num_seqs \+ 1"),
    "more new tokens than the sequence holds": (lambda s: s[:4] + (torch.tensor([2, 1, 9], dtype=torch.int32),)
                                                + s[5:], "new tokens"),
    "a used table entry outside the pool": (lambda s: s[:3] + (s[3].clone().index_fill_(1, torch.tensor([0]), 999),)
                                            + s[4:], "outside the pool"),
    "q of another dtype than the pools": (lambda s: (s[0].double(),) + s[1:], "dtype"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_raise_before_launch(case, monkeypatch):
    step = make_step([3, 1, 2], [5, 16, 9])
    bad, message = BAD[case]
    args = bad(step)

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError(f"{case}: the kernel was launched; validation must reject the inputs first")

    monkeypatch.setattr(unified, "unified_attention_kernel", NoLaunch())
    with pytest.raises(ValueError, match=message):
        unified_attention(*args)


def test_validation_returns_what_the_launcher_needs():
    shape = validate_paged_attention_inputs(*make_step([3, 1], [5, 16], num_heads=8))
    assert (shape.num_tokens, shape.num_seqs, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.block_size,
            shape.max_seq_len, shape.scale, shape.quantized) == (4, 2, 8, 2, 64, 16, 16, 64 ** -0.5, False)
