"""Chapter 7: the Triton paged decode kernels against the plain-torch reference, in Triton's interpreter on CPU.

Importing kvlab.kernels on a machine without CUDA sets TRITON_INTERPRET=1 (for this process and the ones
it starts) before the kernels are defined, so every test here runs the real kernel code on CPU tensors.
The interpreter costs a few milliseconds per program and loop iteration: batches stay small.
With CUDA (and TRITON_INTERPRET unset) the same tests run the compiled kernels on the GPU.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kvlab.kernels.split_kv as split_kv
import kvlab.kernels.triton_unified_attention as unified
from kvlab.cache.paged_cache import paged_attention as chapter3_paged_attention
from kvlab.kernels import (
    allocate_split_workspace,
    choose_num_splits,
    launch_paged_decode_split_kv,
    paged_attention_decode,
    paged_attention_decode_reference,
    paged_attention_decode_split_kv,
    validate_paged_decode_inputs,
)
from kvlab.kernels.interpreter import RUNS_IN_INTERPRETER

ROOT = Path(__file__).resolve().parents[2]
DEVICE = torch.device("cpu" if RUNS_IN_INTERPRETER else "cuda")  # where the kernels can run in this process
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # abs and rel; bf16 keeps 8 bits
KERNELS = {"one-pass": paged_attention_decode, "split-KV": paged_attention_decode_split_kv}


def make_batch(seq_lens, *, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
               spare_blocks=3, seed=0):
    """A pool with spare blocks, each sequence on randomly placed blocks of its own: (q, k_cache, v_cache, tables,
    lens).

    Table entries past a sequence's last block are -1: never read, so they may hold anything.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    pool_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(pool_shape, generator=gen).to(dtype)
    v_cache = torch.randn(pool_shape, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    placement = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max(blocks_needed) + 1), -1, dtype=torch.int32)
    for i, n in enumerate(blocks_needed):
        tables[i, :n] = torch.tensor([placement.pop() for _ in range(n)], dtype=torch.int32)
    return tuple(t.to(DEVICE) for t in (q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32)))


def check(name, yours, spec):
    """Same shape and dtype as the spec, and within the dtype's tolerance; print both side by side if not."""
    assert yours.shape == spec.shape, \
        f"{name}: output shape {tuple(yours.shape)}, expected {tuple(spec.shape)} (q's shape)"
    assert yours.dtype == spec.dtype, f"{name}: output dtype {yours.dtype}, expected {spec.dtype} (q's dtype)"
    tol = TOL[spec.dtype]
    diff = (yours.float() - spec.float()).abs()
    worst = int(diff.flatten().nan_to_num(float("inf")).argmax())
    assert torch.allclose(yours.float(), spec.float(), atol=tol, rtol=tol), (
        f"{name}: max |yours - spec| = {diff.max().item():.3g} (tolerance {tol:g} for {spec.dtype}) at flat index "
        f"{worst}\n  Yours: {yours.flatten()[worst:worst + 4].tolist()}\n"
        f"  Spec:  {spec.flatten()[worst:worst + 4].tolist()}")


def test_the_kernels_run_in_the_interpreter_here():
    """Without CUDA, importing kvlab.kernels switched Triton to its interpreter before defining the kernels."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the kernels are compiled for the GPU in this process")
    assert os.environ.get("TRITON_INTERPRET") == "1" and RUNS_IN_INTERPRETER, (
        "on a CPU-only machine kvlab.kernels must set TRITON_INTERPRET=1 before its @triton.jit decorators run")


def test_the_reference_equals_chapter_3s_gather_attention():
    """The spec is Chapter 3's paged attention with one query: gather through the table, softmax in fp32."""
    q, k_cache, v_cache, tables, lens = make_batch([1, 37, 64], num_heads=8, num_kv_heads=2)
    spec = paged_attention_decode_reference(q, k_cache, v_cache, tables, lens)
    for i, n in enumerate(lens.tolist()):
        table = tables[i, : -(-n // 16)].tolist()
        chapter3 = chapter3_paged_attention(q[i][:, None], k_cache, v_cache, table, n, 64 ** -0.5)[0]
        check(f"reference vs Chapter 3, sequence {i}", spec[i], chapter3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_matches_the_reference_for_each_dtype_and_head_dim(dtype, head_dim):
    """fp32 accumulation in every dtype; 80 and 96 pad tl.arange to 128 and mask the rest."""
    batch = make_batch([1, 45, 16], head_dim=head_dim, dtype=dtype)
    spec = paged_attention_decode_reference(*batch)
    for name, kernel in KERNELS.items():
        kwargs = {"num_splits": 2} if name == "split-KV" else {}
        check(f"{name}, {dtype}, head_dim {head_dim}", kernel(*batch, **kwargs), spec)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 64, 128])
def test_matches_the_reference_for_each_block_size(block_size):
    """Length 1, a length that exactly fills its blocks, and one that crosses a 64-position tile."""
    fills = block_size * max(1, 64 // block_size)  # a whole number of blocks, a whole tile at block sizes <= 64
    batch = make_batch([1, fills, 70], num_heads=2, num_kv_heads=1, block_size=block_size)
    spec = paged_attention_decode_reference(*batch)
    for name, kernel in KERNELS.items():
        kwargs = {"num_splits": 2} if name == "split-KV" else {}
        check(f"{name}, block_size {block_size}", kernel(*batch, **kwargs), spec)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 1), (16, 2)], ids=["MHA", "MQA", "GQA-8:1"])
def test_query_heads_read_their_own_kv_head(num_heads, num_kv_heads):
    """Query head h reads KV head h // (num_heads // num_kv_heads), as the reference's repeat_interleave does."""
    batch = make_batch([33, 9], num_heads=num_heads, num_kv_heads=num_kv_heads)
    spec = paged_attention_decode_reference(*batch)
    for name, kernel in KERNELS.items():
        check(f"{name}, {num_heads} heads on {num_kv_heads} KV heads", kernel(*batch), spec)


def test_shuffled_and_shared_physical_blocks():
    """Tables are free mappings: blocks out of order, and two sequences reading the same physical blocks."""
    q, k_cache, v_cache, _, _ = make_batch([64], num_heads=4, num_kv_heads=2, spare_blocks=4)
    tables = torch.tensor([[5, 2, 0, 3], [5, 2, 1, -1], [3, 0, 2, 5]], dtype=torch.int32, device=DEVICE)  # 0, 1 share
    lens = torch.tensor([64, 40, 61], dtype=torch.int32, device=DEVICE)
    q = torch.cat([q, q.flip(1), q * 0.5])  # three sequences
    spec = paged_attention_decode_reference(q, k_cache, v_cache, tables, lens)
    for name, kernel in KERNELS.items():
        check(f"{name}, shared blocks", kernel(q, k_cache, v_cache, tables, lens), spec)
    # Sequence 0 over blocks [5, 2, 0, 3] is sequence 2's data in another order: a different answer.
    assert not torch.allclose(spec[0], spec[2]), "reordering the table must change which keys a position sees"


def _poison(k_cache, v_cache, tables, lens, block_size):
    """NaN in every block no sequence uses, inf in the slots past each sequence's end, junk in unused table entries."""
    k_cache, v_cache, tables = k_cache.clone(), v_cache.clone(), tables.clone()
    used = torch.zeros(k_cache.shape[0], dtype=torch.bool, device=k_cache.device)
    for i, n in enumerate(lens.tolist()):
        blocks = tables[i, : -(-n // block_size)].long()
        used[blocks] = True
        last, filled = blocks[-1], n - (len(blocks) - 1) * block_size
        k_cache[last, filled:] = float("inf")
        v_cache[last, filled:] = float("nan")
        junk = torch.tensor([-7, 2**31 - 1, 10**6], dtype=torch.int32, device=tables.device)
        tables[i, len(blocks):] = junk.repeat(tables.shape[1])[: tables.shape[1] - len(blocks)]
    k_cache[~used], v_cache[~used] = float("nan"), float("nan")
    return k_cache, v_cache, tables


@pytest.mark.parametrize("block_size", [8, 32])
def test_never_reads_past_a_sequence_or_outside_its_blocks(block_size):
    """A poisoned pool gives the clean pool's answer: no load touches unused blocks, slots or table entries."""
    q, k_cache, v_cache, tables, lens = make_batch([1, 21, 3 * block_size - 5], block_size=block_size, spare_blocks=4)
    tables = torch.cat([tables, torch.full_like(tables[:, :2], -1)], dim=1)  # more junk columns to poison
    spec = paged_attention_decode_reference(q, k_cache, v_cache, tables, lens)
    k_bad, v_bad, tables_bad = _poison(k_cache, v_cache, tables, lens, block_size)
    # Each pool sits between two NaN guard blocks: a read one block before or after the pool shows up too.
    k_bad, v_bad = (torch.cat([torch.full_like(p[:1], float("nan")), p, torch.full_like(p[:1], float("nan"))])[1:-1]
                    for p in (k_bad, v_bad))
    for name, kernel in KERNELS.items():
        kwargs = {"num_splits": 3} if name == "split-KV" else {}
        out = kernel(q, k_bad, v_bad, tables_bad, lens, **kwargs)
        assert torch.isfinite(out).all(), (f"{name}: NaN/inf in the output, so the kernel loaded a poisoned slot "
                                           "(an unused block, a slot past seq_len, "
                                           "or a block named by an unused table entry)")
        check(f"{name} on the poisoned pool", out, spec)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 8])
def test_split_kv_equals_the_reference_and_the_one_pass_kernel(num_splits):
    """Splits rescaled onto a common max and added give the one-pass answer, empty splits included."""
    batch = make_batch([1, 150, 70, 64], num_heads=2, num_kv_heads=1, block_size=16)
    spec = paged_attention_decode_reference(*batch)
    one_pass = paged_attention_decode(*batch)
    split = paged_attention_decode_split_kv(*batch, num_splits=num_splits)
    check(f"split-KV with {num_splits} splits vs the reference", split, spec)
    check(f"split-KV with {num_splits} splits vs the one-pass kernel", split, one_pass)


def test_reduce_never_reads_the_scratch_of_empty_splits():
    """Splits past a short sequence's end write nothing; NaN left in their scratch must not reach the output."""
    batch = make_batch([1, 200], num_heads=2, num_kv_heads=1)
    shape = validate_paged_decode_inputs(*batch)
    tokens_per_split, num_splits = split_kv.split_plan(shape.max_seq_len, 4)
    assert (tokens_per_split, num_splits) == (64, 4), "200 positions in 4 splits of whole 64-position tiles"
    workspace = allocate_split_workspace(2, 2, num_splits, 64, DEVICE)
    for part in workspace:
        part.fill_(float("nan"))
    out = torch.empty_like(batch[0])
    launch_paged_decode_split_kv(shape, *batch, out, num_splits, workspace=workspace)
    assert workspace[0][0, :, 1:].isnan().all(), "sequence 0 (1 token) has work in split 0 only"
    check("split-KV with NaN scratch", out, paged_attention_decode_reference(*batch))


def test_choose_num_splits_grows_with_context_and_shrinks_with_batch():
    """More splits for long contexts and small batches, one split when the batch alone fills the GPU."""
    assert choose_num_splits(1, 32, 32768, num_sms=132) > choose_num_splits(1, 32, 2048, num_sms=132) > 1
    assert choose_num_splits(1, 32, 32768, num_sms=132) > choose_num_splits(8, 32, 32768, num_sms=132) > 1
    assert choose_num_splits(64, 32, 32768, num_sms=132) == 1, "64 x 32 programs already fill 132 SMs"
    assert choose_num_splits(1, 32, 100, num_sms=132) == 1, "no split is shorter than MIN_TOKENS_PER_SPLIT"
    assert choose_num_splits(1, 1, 10**6, num_sms=132) == split_kv.MAX_SPLITS
    batch = make_batch([300, 20], num_heads=2, num_kv_heads=1)
    check("split-KV with num_splits=None", paged_attention_decode_split_kv(*batch),
          paged_attention_decode_reference(*batch))


def test_explicit_scale_strided_inputs_and_an_empty_batch():
    """scale is passed through, strided q, tables and seq_lens are read right, and no sequences give no output."""
    q, k_cache, v_cache, tables, lens = make_batch([20, 5])
    q_strided = q.transpose(0, 1).contiguous().transpose(0, 1)               # same values, heads outermost in memory
    tables_strided = tables.t().contiguous().t()                             # column-major: a row is not contiguous
    lens_strided = torch.stack([lens, lens * 0]).t()[:, 0]                   # every other element of a buffer
    spec = paged_attention_decode_reference(q, k_cache, v_cache, tables, lens, scale=0.3)
    for name, kernel in KERNELS.items():
        out = kernel(q_strided, k_cache, v_cache, tables_strided, lens_strided, scale=0.3)
        check(f"{name}, scale 0.3, strided q, tables and seq_lens", out, spec)
        empty = kernel(q[:0], k_cache, v_cache, tables[:0], lens[:0])
        assert empty.shape == (0, 4, 64), f"{name}: an empty batch returns an empty [0, num_heads, head_dim] output"


def _valid():
    # 4 heads on 2 KV heads, head_dim 64, block size 16, 3 blocks needed + 3 spare, tables 3 wide
    return make_batch([20, 5])


def _set(index, value):
    def mutate(args):
        args[index] = value(args[index]) if callable(value) else value
    return mutate


def _set_lens(*values):
    return _set(4, lambda lens: torch.tensor(values, dtype=torch.int32, device=lens.device))


def _set_entry(i, j, value):
    def mutate(args):
        args[3] = args[3].clone()
        args[3][i, j] = value
    return mutate


BAD_INPUTS = {
    "q without a head dim": (_set(0, lambda q: q[:, 0]), "q must have 3 dims"),
    "3-dim k_cache": (_set(1, lambda k: k[0]), "k_cache must have 4 dims"),
    "v_cache of another shape": (_set(2, lambda v: v[:, :8]), "must have the same shape"),
    "q's head_dim differs": (_set(0, lambda q: q[..., :32]), "q has head_dim 32 but the caches have head_dim 64"),
    "6 heads on 4 KV heads": (lambda a: [_set(i, lambda t, n=n: torch.randn(*t.shape[:-2], n, 64, device=t.device))(a)
                                         for i, n in ((0, 6), (1, 4), (2, 4))], "multiple of num_kv_heads"),
    "int8 tensors": (lambda a: [_set(i, lambda t: t.to(torch.int8))(a) for i in range(3)],
                     "int8, which is not supported"),
    "float64 tensors": (lambda a: [_set(i, lambda t: t.double())(a) for i in range(3)],
                        "float64, which is not supported"),
    "fp16 q on fp32 caches": (_set(0, lambda q: q.half()), "must share one dtype"),
    "block size 12": (lambda a: [_set(i, lambda t: t[:, :12])(a) for i in (1, 2)], "block_size 12 is not supported"),
    "head_dim 300": (lambda a: [_set(i, lambda t: torch.randn(*t.shape[:-1], 300, device=t.device))(a)
                                for i in range(3)],
                     "head_dim 300 is not supported"),
    "head_dim 8": (lambda a: [_set(i, lambda t: t[..., :8].contiguous())(a) for i in range(3)],
                   "head_dim 8 is not supported"),
    "int64 block tables": (_set(3, lambda t: t.long()), "block_tables must be int32"),
    "int64 seq_lens": (_set(4, lambda t: t.long()), "seq_lens must be int32"),
    "a table row too few": (_set(3, lambda t: t[:1]), "block_tables must have shape"),
    "2-dim seq_lens": (_set(4, lambda t: t[:, None]), "seq_lens must have shape"),
    "tables on another device": (_set(3, lambda t: t.to("meta")), "all inputs must be on one device"),
    "an empty sequence": (_set_lens(20, 0), "seq_lens\\[1\\] is 0"),
    "a sequence longer than its table": (_set_lens(20, 3 * 16 + 1), "holds only 3 blocks of 16 = 48 tokens"),
    "a used entry past the pool": (_set_entry(0, 1, 6), "block_tables\\[0, 1\\] is 6, outside the pool of 6 blocks"),
    "a negative used entry": (_set_entry(1, 0, -1), "block_tables\\[1, 0\\] is -1"),
    "strided head_dim in v_cache": (_set(2, lambda v: torch.randn(*v.shape[:-1], 128, device=v.device)[..., ::2]),
                                    "contiguous head_dim"),
}


@pytest.mark.parametrize("kernel_name", list(KERNELS))
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise_before_launch_and_change_nothing(case, kernel_name, monkeypatch):
    """Each mistake raises ValueError naming it, before any kernel is launched, and leaves the inputs as they were."""
    mutate, message = BAD_INPUTS[case]
    args = list(_valid())
    mutate(args)
    before = [t.clone() if t.device.type != "meta" else t for t in args]

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError(f"{case}: a kernel was launched; validation must reject the inputs first")

    monkeypatch.setattr(unified, "unified_attention_kernel", NoLaunch())
    for name in ("paged_decode_split_kernel", "split_reduce_kernel"):
        monkeypatch.setattr(split_kv, name, NoLaunch())
    with pytest.raises(ValueError, match=message):
        KERNELS[kernel_name](*args)
    for name, old, new in zip(("q", "k_cache", "v_cache", "block_tables", "seq_lens"), before, args):
        if new.device.type != "meta":
            assert torch.equal(old, new), f"{case}: the call modified {name}"


def test_unused_table_entries_are_not_validated():
    """Entries past a sequence's last block are ignored: stale ids there are normal in a serving system."""
    args = list(_valid())
    args[3][0, 2:] = 10**6  # sequence 0 (20 tokens) uses entries 0 and 1 only
    assert validate_paged_decode_inputs(*args).max_seq_len == 20


@pytest.mark.parametrize("num_splits", [0, -1, 2.5, True])
def test_num_splits_must_be_a_positive_int(num_splits):
    """num_splits is None (automatic) or a positive int."""
    with pytest.raises(ValueError, match="num_splits must be a positive int"):
        paged_attention_decode_split_kv(*_valid(), num_splits=num_splits)


@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_scale_must_be_finite(scale):
    """A NaN or infinite scale would turn every output into NaN: refused up front."""
    with pytest.raises(ValueError, match="scale must be a finite number"):
        paged_attention_decode(*_valid(), scale=scale)


def test_a_good_call_changes_no_input():
    """The kernels write only their output (and split-KV its own scratch)."""
    args = _valid()
    before = [t.clone() for t in args]
    for kernel in KERNELS.values():
        kernel(*args)
    assert all(torch.equal(a, b) for a, b in zip(before, args)), \
        "a decode kernel must not write to q, the pools or the tables"


def _run_python(code, env_changes):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_changes, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_works_when_triton_was_imported_first():
    """Another module imported triton (its own @jit helpers then in compiled mode) before kvlab.kernels: still runs."""
    result = _run_python("""
        import triton, triton.language as tl
        from triton.runtime.jit import JITFunction
        assert isinstance(tl.sum, JITFunction), "triton.language was imported with the interpreter off"
        import torch
        import kvlab.kernels as K
        assert K.RUNS_IN_INTERPRETER
        q, k, v = torch.randn(2, 4, 64), torch.randn(6, 16, 2, 64), torch.randn(6, 16, 2, 64)
        tables, lens = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32), torch.tensor([30, 7], dtype=torch.int32)
        spec = K.paged_attention_decode_reference(q, k, v, tables, lens)
        for out in (K.paged_attention_decode(q, k, v, tables, lens),
                    K.paged_attention_decode_split_kv(q, k, v, tables, lens, num_splits=2)):
            assert torch.allclose(out, spec, atol=1e-5), (out - spec).abs().max()
        assert isinstance(tl.sum, JITFunction), "triton.language is restored after the launch"
        print("ok")
    """, {})
    assert result.returncode == 0 and "ok" in result.stdout, (
        f"the kernels failed after an earlier `import triton`:\n{result.stdout}\n{result.stderr[-3000:]}")


def test_cpu_tensors_with_compiled_kernels_say_how_to_fix_it():
    """TRITON_INTERPRET=0 is respected (kernels compiled for a GPU); CPU tensors then get a clear RuntimeError."""
    result = _run_python("""
        import torch
        import kvlab.kernels as K
        assert not K.RUNS_IN_INTERPRETER, "TRITON_INTERPRET=0 must keep the compiled kernels"
        q, k, v = torch.randn(1, 2, 64), torch.randn(2, 16, 2, 64), torch.randn(2, 16, 2, 64)
        try:
            K.paged_attention_decode(q, k, v, torch.tensor([[1]], dtype=torch.int32),
                                     torch.tensor([5], dtype=torch.int32))
        except RuntimeError as e:
            print(e)
    """, {"TRITON_INTERPRET": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "set TRITON_INTERPRET=1 before importing kvlab.kernels" in result.stdout, (
        f"expected a RuntimeError telling the user to set TRITON_INTERPRET=1; "
        f"got:\n{result.stdout}{result.stderr[-2000:]}")
