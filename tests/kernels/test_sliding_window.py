"""Sliding-window attention in the kernels and the attention backends: a hybrid model's windowed layers.

A layer with window W lets the query at position p see keys p - W + 1 .. p (transformers' convention).
vLLM's KV cache manager frees the blocks whose tokens every future query's window has left and puts a
placeholder in the block table, so these tests build steps where those entries hold the first id past
the pool, num_blocks: the pools are views of a larger allocation whose extra block (the trap) is NaN, so
a kernel that followed such an entry reads NaN (not wild memory, on a GPU either) and fails the check.
The interpreter's load counter then shows that no load touched those entries or the trap. Slots no
sequence owns hold NaN too.
In Triton's interpreter on CPU; the same tests run compiled on a GPU (scripts/gpu_check.sh).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvlab.kernels.triton_unified_attention as unified
from kvlab.cache.attention_backends import ReferenceBackend, TorchBackend, TritonBackend
from kvlab.cache.kv_storage import KVStorage
from kvlab.cache.ragged_batch import BatchLayout
from kvlab.kernels import (
    paged_attention_decode,
    paged_attention_decode_reference,
    paged_attention_decode_split_kv,
    unified_attention,
    unified_attention_reference,
)
from kvlab.kernels.interpreter import RUNS_IN_INTERPRETER
from kvlab.kernels.load_counter import count_requested_bytes

ROOT = Path(__file__).resolve().parents[2]
DEVICE = torch.device("cpu" if RUNS_IN_INTERPRETER else "cuda")
TOL = 1e-5
needs_interpreter = pytest.mark.skipif(not RUNS_IN_INTERPRETER, reason="the load counter reads the interpreter's loads")


def first_seen(seq_len: int, q_len: int, window: int) -> int:
    """The lowest position any of a sequence's new tokens sees: the first new token's window start."""
    return max(0, seq_len - q_len - window + 1)


def make_windowed_step(q_lens, seq_lens, window, *, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, seed=0):
    """A ragged step on a shuffled pool where blocks wholly before every query's window are freed: their table
    entries hold num_blocks, the trap block just past the pools.

    Returns (q, k, v, tables, seq_lens, query_start_loc), the number of freed entries per sequence and the
    trap blocks (k_trap, v_trap), views of the NaN block that follows each pool in memory.
    """
    gen = torch.Generator().manual_seed(seed)
    freed = [first_seen(n, q, window) // block_size for q, n in zip(q_lens, seq_lens)]
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(n - f for n, f in zip(needed, freed)) + 2
    k = torch.randn(num_blocks + 1, block_size, num_kv_heads, head_dim, generator=gen)   # + the trap
    v = torch.randn(num_blocks + 1, block_size, num_kv_heads, head_dim, generator=gen)
    owned = torch.zeros(num_blocks + 1, block_size, dtype=torch.bool)
    placement = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max(needed) + 1), -7, dtype=torch.int32)   # -7 past the last block
    for i, n in enumerate(seq_lens):
        tables[i, :freed[i]] = num_blocks
        for j in range(freed[i], needed[i]):
            block = placement.pop()
            tables[i, j] = block
            owned[block, :min(block_size, n - j * block_size)] = True
    k[~owned], v[~owned] = float("nan"), float("nan")
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    k, v = k.to(DEVICE), v.to(DEVICE)   # moved with their traps, then cut: the pools are contiguous prefixes
    step = (q.to(DEVICE), k[:num_blocks], v[:num_blocks], tables.to(DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), starts.to(DEVICE))
    return step, freed, (k[num_blocks], v[num_blocks])


def check(name, yours, spec, tol=TOL):
    assert yours.shape == spec.shape and yours.dtype == spec.dtype, f"{name}: shape or dtype differs from q's"
    diff = (yours.float() - spec.float()).abs().nan_to_num(float("inf"))
    worst = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
    assert diff.max().item() <= tol * (1 + spec.float().abs().max().item()), (
        f"{name}: max |kernel - reference| = {diff.max().item():.3g} at token/head/dim {worst} (tolerance {tol:g}); "
        f"NaN means a slot outside the window's blocks was read\n  Yours: {yours[worst[:2]][:4].tolist()}\n"
        f"  Spec:  {spec[worst[:2]][:4].tolist()}")


def test_the_reference_masks_as_transformers_does():
    """The reference keeps key k for the query at p exactly where transformers' sliding-window causal mask
    (masking_utils.sliding_window_causal_mask_function) does: p - W < k <= p."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    gen = torch.Generator().manual_seed(1)
    seq_len, q_len, window, block_size = 20, 6, 5, 4
    k = torch.randn(seq_len, 1, 16, generator=gen)     # one KV head, on blocks 0, 1, ... in order
    v = torch.randn(seq_len, 1, 16, generator=gen)
    q = torch.randn(q_len, 1, 16, generator=gen)
    table = torch.arange(seq_len // block_size, dtype=torch.int32)[None]
    out = unified_attention_reference(q, k.view(-1, block_size, 1, 16), v.view(-1, block_size, 1, 16), table,
                                      torch.tensor([seq_len], dtype=torch.int32),
                                      torch.tensor([0, q_len], dtype=torch.int32), sliding_window=window)
    allowed = sliding_window_causal_mask_function(window)
    mask = allowed(torch.tensor(0), torch.tensor(0), torch.arange(seq_len - q_len, seq_len)[:, None],
                   torch.arange(seq_len)[None, :])                                         # [q_len, seq_len]
    assert mask.sum(dim=1).tolist() == [window] * q_len, "each query sees W keys, itself included"
    scores = (q[:, 0] @ k[:, 0].T * 16 ** -0.5).masked_fill(~mask, float("-inf"))
    check("reference vs transformers' mask", out[:, 0], torch.softmax(scores, dim=-1) @ v[:, 0])


# (q_lens, seq_lens, window, make_windowed_step's keywords): the contexts are 40, 27, 6 tokens.
CASES = {
    "decodes, window smaller than every context": ([1, 1, 1], [40, 27, 6], 5, {}),
    "decodes, window equal to the longest context": ([1, 1, 1], [40, 27, 6], 40, {}),
    "decodes, window larger than every context": ([1, 1, 1], [40, 27, 6], 1000, {}),
    "window of 1: each token sees only itself": ([3, 1], [20, 33], 1, {}),
    "prefill chunks and decodes mixed, GQA 4:1": ([9, 1, 17, 1], [40, 50, 17, 3], 12, dict(num_heads=8)),
    "a chunk after freed blocks, GQA 8:1, block size 32": ([5, 1, 2], [70, 65, 40], 20,
                                                          dict(num_heads=16, block_size=32)),
    "MHA, a 20-token chunk spanning two programs": ([20, 1], [52, 30], 9, dict(num_heads=2, num_kv_heads=2)),
    "block size 32, window a whole block": ([4, 1], [96, 64], 32, dict(block_size=32)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_windowed_ragged_step_equals_the_reference_and_never_reads_a_freed_entry(name):
    q_lens, seq_lens, window, kwargs = CASES[name]
    step, freed, _ = make_windowed_step(q_lens, seq_lens, window, **kwargs)
    spec = unified_attention_reference(*step, sliding_window=window)
    check(name, unified_attention(*step, sliding_window=window), spec)
    if window >= max(seq_lens):   # nothing freed, every query sees its whole sequence: full attention
        assert not any(freed)
        check(f"{name}, vs full attention", unified_attention(*step), unified_attention_reference(*step))


@pytest.mark.parametrize("window", [7, 16, 33, 200])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decodes_one_pass_and_split_kv_agree_with_the_reference(window, block_size):
    """The decode wrapper and split-KV (1, 2 and 3 ranges over the window) read only the window's blocks."""
    q, k, v, tables, lens, _ = make_windowed_step([1, 1, 1], [75, 33, 8], window, num_heads=8,
                                                  block_size=block_size)[0]
    spec = paged_attention_decode_reference(q, k, v, tables, lens, sliding_window=window)
    step = (q, k, v, tables, lens)
    check(f"one pass, W={window}", paged_attention_decode(*step, sliding_window=window), spec)
    for splits in (1, 2, 3):
        check(f"split-KV x{splits}, W={window}",
              paged_attention_decode_split_kv(*step, num_splits=splits, sliding_window=window), spec)


@needs_interpreter
@pytest.mark.parametrize("block_size", [16, 32])
def test_the_load_counter_sees_no_read_of_a_freed_entry_and_exactly_the_windows_keys(block_size):
    """Counted in the interpreter: no byte of a freed table entry is loaded, by the one-pass kernel or split-KV;
    a decode with window W requests exactly W keys per KV head; and the same counter does see those entries
    read when the same step runs as full attention (with real blocks there), so it would catch a kernel that
    loaded them."""
    window, seq_lens = 20, [70, 45, 9]
    step, freed, (k_trap, v_trap) = make_windowed_step([1, 1, 1], seq_lens, window, block_size=block_size)
    q, k, v, tables, lens, starts = step
    freed_entries = {f"freed_{i}": tables[i, :n] for i, n in enumerate(freed) if n}
    assert freed_entries, "the step must have freed blocks to test"
    per_key = k.shape[2] * k.shape[3] * k.element_size()     # one position, all KV heads
    for name, run in (("one pass", lambda: paged_attention_decode(q, k, v, tables, lens, sliding_window=window)),
                      ("split-KV x2", lambda: paged_attention_decode_split_kv(q, k, v, tables, lens, num_splits=2,
                                                                              sliding_window=window))):
        with count_requested_bytes(k_cache=k, k_trap=k_trap, v_trap=v_trap, **freed_entries) as reads:
            run()
        touched = {entry: n for entry, n in reads.items() if ("freed" in entry or "trap" in entry) and n}
        assert not touched, (f"{name} loaded freed table entries or the block they name (bytes): {touched}; "
                             "its loop must start at the window")
        keys = sum(min(n, window) for n in seq_lens)
        assert reads["k_cache"] == keys * per_key, (
            f"{name}: requested {reads['k_cache'] / per_key:.0f} key positions, the windows hold {keys}")
    # The control: the same table with real blocks in place of the placeholders, attended in full.
    full_tables = tables.clone()
    full_tables[full_tables == k.shape[0]] = 0
    with count_requested_bytes(**{name: full_tables[int(name[6:]), :len(t)] for name, t in freed_entries.items()}
                               ) as reads:
        paged_attention_decode(q, k.nan_to_num(0.0), v.nan_to_num(0.0), full_tables, lens)
    assert all(reads[name] > 0 for name in freed_entries), "full attention reads every entry: the counter sees it"


@needs_interpreter
def test_a_chunk_starts_each_program_at_its_first_rows_window():
    """A 32-token chunk (MHA: 16 tokens per program), window 8, after 40 cached tokens: the first program's rows
    (positions 40..55) see keys 33..55 (23 keys), the second's (56..71) see 49..71 (23 keys)."""
    step, _, _ = make_windowed_step([32], [72], 8, num_heads=2, num_kv_heads=2)
    q, k, v, tables, lens, starts = step
    with count_requested_bytes(k_cache=k) as reads:
        unified_attention(*step, sliding_window=8)
    per_key = k.shape[2] * k.shape[3] * k.element_size()
    assert reads["k_cache"] == (23 + 23) * per_key, f"{reads['k_cache'] / per_key:.0f} keys requested, not 46"


def test_full_attention_is_none_and_unchanged():
    """sliding_window=None is the kernel as it was: the same output as a call without the argument, bit for bit."""
    q, k, v, tables, lens, starts = make_windowed_step([3, 1], [20, 33], 1000)[0]
    tables = tables.masked_fill(tables < 0, 0)
    plain = unified_attention(q, k, v, tables, lens, starts)
    assert torch.equal(plain, unified_attention(q, k, v, tables, lens, starts, sliding_window=None))


BAD_WINDOWS = [0, -3, 2.5, "8", True]


@pytest.mark.parametrize("window", BAD_WINDOWS, ids=repr)
def test_a_bad_window_raises_naming_sliding_window_before_any_launch(window, monkeypatch):
    step, _, _ = make_windowed_step([3, 1], [20, 33], 8)

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the kernel was launched; sliding_window must be rejected first")

    monkeypatch.setattr(unified, "unified_attention_kernel", NoLaunch())
    for fn in (unified_attention, unified_attention_reference):
        with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
            fn(*step, sliding_window=window)
    q, k, v, tables, lens, _ = step
    for fn in (paged_attention_decode, paged_attention_decode_split_kv, paged_attention_decode_reference):
        with pytest.raises(ValueError, match="sliding_window"):
            fn(q[:2], k, v, tables, lens, sliding_window=window)


def test_validation_still_refuses_a_bad_entry_inside_the_window():
    step, _, _ = make_windowed_step([1, 1], [40, 20], 10)
    q, k, v, tables, lens, starts = step
    tables = tables.clone()
    tables[0, 2] = -1          # sequence 0's window (positions 30..39) lies in its blocks 1 and 2
    with pytest.raises(ValueError, match=r"block_tables\[0, 2\].*windows reach"):
        unified_attention(q, k, v, tables, lens, starts, sliding_window=10)


# -- the attention backends: one seam, forward(..., sliding_window=W) per layer --------------------------------------

def test_every_backend_attends_a_layers_window_and_skips_the_null_block():
    """A pass of a prefill chunk and two decodes, two layers (window 6 and full attention) sharing one metadata:
    the reference, torch and Triton backends agree with the kernels' reference, and freed entries hold vLLM's
    null block (id 0), filled with large junk that would show in any output that used it."""
    block_size, num_kv_heads, head_dim, num_heads, window = 16, 2, 32, 4, 6
    gen = torch.Generator().manual_seed(3)
    storage = KVStorage(2, 12, block_size, num_kv_heads, head_dim, device=DEVICE)
    for pool in storage.k_pools + storage.v_pools:
        pool.copy_(torch.randn(pool.shape, generator=gen))
        pool[0] = 1e4          # the null block
    query_lens, context_lens = [5, 1, 1], [37, 40, 9]
    full_tables = [[1, 2, 3], [4, 5, 6], [7]]
    # Windowed layer: blocks wholly before each sequence's first query's window are freed (null block 0).
    win_tables = [[0 if (j + 1) * block_size <= first_seen(n, ql, window) else b for j, b in enumerate(t)]
                  for t, n, ql in zip(full_tables, context_lens, query_lens)]
    assert win_tables[0][0] == 0 and win_tables[1][:2] == [0, 0], "the pass must have freed blocks"
    query = torch.randn(1, num_heads, sum(query_lens), head_dim, generator=gen).to(DEVICE)
    starts = torch.tensor([0, 5, 6, 7], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    for tables, layer, layer_window in ((win_tables, 0, window), (full_tables, 1, None)):
        padded = torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
        spec = unified_attention_reference(query[0].transpose(0, 1), storage.k_pools[layer], storage.v_pools[layer],
                                           padded, lens, starts, scale=0.3, sliding_window=layer_window)
        batch = BatchLayout(query_lens, context_lens, tables, torch.zeros(sum(query_lens), dtype=torch.long))
        for backend in (ReferenceBackend(), TorchBackend(), TritonBackend()):
            metadata = backend.build_metadata(batch, block_size, DEVICE)
            out = backend.forward(storage, layer, query, metadata, 0.3, sliding_window=layer_window)
            check(f"{backend.name} backend, layer {layer} (window {layer_window})", out, spec, 1e-4)
    with pytest.raises(ValueError, match="sliding_window"):
        TorchBackend().forward(storage, 0, query, TorchBackend().build_metadata(batch, block_size, DEVICE), 0.3,
                               sliding_window=-1)


@needs_interpreter
def test_the_triton_backend_never_loads_the_null_block_of_a_windowed_layer():
    block_size, window = 16, 6
    gen = torch.Generator().manual_seed(4)
    storage = KVStorage(1, 8, block_size, 2, 32)
    for pool in storage.k_pools + storage.v_pools:
        pool.copy_(torch.randn(pool.shape, generator=gen))
    tables = [[0, 0, 3], [0, 5, 6]]           # the first entries freed: vLLM's null block, id 0
    batch = BatchLayout([1, 4], [40, 38], tables, torch.zeros(5, dtype=torch.long))
    backend = TritonBackend()
    metadata = backend.build_metadata(batch, block_size, "cpu")
    with count_requested_bytes(null_block=storage.k_pools[0][0]) as reads:
        backend.forward(storage, 0, torch.randn(1, 4, 5, 32, generator=gen), metadata, 0.3, sliding_window=window)
    assert reads["null_block"] == 0, f"the kernel loaded {reads['null_block']} bytes of the null block"


def test_the_sliding_variants_compile_for_a_gpu_without_spilling(tmp_path):
    """The SLIDING=True kernels compiled ahead of time for sm_80 in fp16 (no GPU needed): PTX, a cubin, no spill."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    code = ("from kvlab.kernels.aot import compile_kernels; import json\n"
            "for r in compile_kernels(80, dtypes=['fp16'], kv_dtypes=[], sliding=True):\n"
            "    print(json.dumps([r.kernel, r.cubin_is_elf, r.spill_bytes]))")
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("[")]
    compiled = {kernel for kernel, elf, spill in records if elf and spill == 0}
    assert {"unified_attention_kernel", "paged_decode_split_kernel", "split_reduce_kernel"} <= compiled, records
