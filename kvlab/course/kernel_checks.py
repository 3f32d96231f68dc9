"""Chapter 7's checks: test batches full of NaN traps, a launch that records what a kernel reads, per-sequence verdicts.

The test cells load this file afresh (as they load kvlab/course/checks.py), and this module loads the checks
and the reference it compares with afresh too, so nothing a notebook redefines takes part in grading.
"""

import contextlib
import importlib.util
import itertools
import os
from functools import partial

import numpy as np
import torch
import triton


def _fresh(name: str):
    """A new copy of module `name`, executed from its file, whatever sys.modules holds for it."""
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_checks = _fresh("kvlab.course.checks")
_reference = _fresh("kvlab.kernels.reference")
_load_counter = _fresh("kvlab.kernels.load_counter")
CheckFailed, check_close, limited_output = _checks.CheckFailed, _checks.check_close, _checks.limited_output

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")  # where the test batches live

READS_PAST_END = ("a load read a slot past seq_len or a block the sequence does not own (make_batch put NaN there): "
                  "mask the table, K and V loads with pos < seq_len, and give those positions a score of -inf")


def check_output(name, yours, expected, hint=None, nan_hint=None, atol=1e-5, rtol=1e-4):
    """check_close, with a plain message when yours holds NaN or inf where the expected value is finite."""
    if isinstance(yours, torch.Tensor) and tuple(yours.shape) == tuple(expected.shape):
        yours = torch.Tensor.as_subclass(yours, torch.Tensor)
        bad = ~yours.isfinite() & expected.isfinite()
        if bool(bad.any()):
            index = tuple(int(i) for i in bad.nonzero()[0])
            raise CheckFailed(f"{name}: not what was expected.\n"
                              f"  Yours:    {yours[index].item()} at index {index} "
                              f"({int(bad.sum())} values not finite)\n"
                              f"  Expected: {expected[index].item():.6g}\n"
                              f"  Hint: {nan_hint or hint or 'look for exp overflowing'}")
    check_close(name, yours, expected, atol=atol, rtol=rtol, hint=hint)


PEAK_SCALE = 100.0  # planted keys' factor: their scores reach the hundreds, where exp overflows fp32 past about 88


def make_batch(seq_lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, seed=0, padding="spare",
               peak=None, peak_at=16):
    """A decode batch on a shuffled pool, NaN wherever a kernel must not read: (q, k_cache, v_cache, tables, seq_lens).

    padding: what the table entries past each sequence's last block hold, "spare" (the NaN spare block) or
    "garbage" (block numbers far outside the pool, negative ones included: any number may be there).
    peak: "late" multiplies the keys at positions >= peak_at by PEAK_SCALE, so that later tiles' scores rise
    hundreds above the first tile's; "early" does it to the positions before peak_at (later scores far below).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 1                                    # + one spare block
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    placement = torch.randperm(num_blocks, generator=gen).tolist()         # physical blocks in random order
    spare = placement.pop()
    k_cache[spare], v_cache[spare] = float("nan"), float("nan")
    # Wide enough that even a tile running past a sequence's end finds an entry (the spare block).
    width = max(max(blocks_needed), -(-max(16, triton.next_power_of_2(max(seq_lens))) // block_size)) + 1
    block_tables = torch.full((len(seq_lens), width), spare, dtype=torch.int32)
    for i, (n, need) in enumerate(zip(seq_lens, blocks_needed)):
        block_tables[i, :need] = torch.tensor([placement.pop() for _ in range(need)], dtype=torch.int32)
        last, filled = block_tables[i, need - 1], n - (need - 1) * block_size
        k_cache[last, filled:], v_cache[last, filled:] = float("nan"), float("nan")  # slots past the end
        if padding == "garbage":
            junk = torch.randint(num_blocks, 2**30, (width - need,), generator=gen, dtype=torch.int32)
            block_tables[i, need:] = torch.where(torch.arange(width - need) % 2 == 0, junk, -junk)
    if peak is not None:
        if peak not in ("late", "early"):
            raise ValueError(f"peak must be None, 'late' or 'early'; got {peak!r}")
        for i, n in enumerate(seq_lens):
            for pos in range(n):
                if (pos >= peak_at) == (peak == "late"):
                    block, slot = int(block_tables[i, pos // block_size]), pos % block_size
                    k_cache[block, slot] *= PEAK_SCALE
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    return tuple(t.to(DEVICE) for t in (q, k_cache, v_cache, block_tables, seq_lens))


READ_LOG = {}  # after an interpreted launch: tensor name -> bool array, True for every element a load read


def _track_reads(tensors):
    """Patch the interpreter's load so that it marks, per tensor, each element a masked-in lane reads."""
    from triton.runtime.interpreter import InterpreterBuilder
    original = InterpreterBuilder.create_masked_load
    spans = [(name, t.data_ptr(), t.element_size(), t.numel()) for name, t in tensors.items()]
    READ_LOG.clear()
    READ_LOG.update({name: np.zeros(numel, dtype=bool) for name, _, _, numel in spans})
    READ_LOG["elsewhere"] = 0

    def create_masked_load(self, ptrs, mask, other, *args):
        addresses = np.broadcast_to(ptrs.data, mask.data.shape)[mask.data].astype(np.int64)
        known = np.zeros(addresses.shape, dtype=bool)
        for name, start, size, numel in spans:
            inside = (addresses >= start) & (addresses < start + size * numel)
            READ_LOG[name][(addresses[inside] - start) // size] = True
            known |= inside
        READ_LOG["elsewhere"] += int((~known).sum())
        return original(self, ptrs, mask, other, *args)

    InterpreterBuilder.create_masked_load = create_masked_load
    return lambda: setattr(InterpreterBuilder, "create_masked_load", original)


def group_rows(queries_per_kv):
    """Rows of a group program: the query heads of one KV head, padded to a power of two >= 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(queries_per_kv))


def launch(kernel, q, k_cache, v_cache, block_tables, seq_lens, scale=None, tile=None, group=False):
    """Validate, allocate the output, run kernel on the grid (num_seqs, num_heads); tile=None: one tile per sequence.

    group=True: the grid (num_seqs, num_kv_heads), one program per KV head and its query-head group, with
    BLOCK_M = group_rows(QUERIES_PER_KV) rows.
    """
    from kvlab.kernels import validate_paged_decode_inputs

    shape = validate_paged_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens, scale)
    q, block_tables, seq_lens = q.contiguous(), block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(q)
    if shape.num_seqs == 0:
        return out
    tile = tile or max(16, triton.next_power_of_2(shape.max_seq_len))
    queries_per_kv = shape.num_heads // shape.num_kv_heads
    grid = (shape.num_seqs, shape.num_kv_heads if group else shape.num_heads)
    rows = dict(BLOCK_M=group_rows(queries_per_kv)) if group else {}
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens, out=out)
    untrack = _track_reads(tensors) if INTERPRETED else None
    try:
        # The interpreter computes with NumPy, which warns (on stderr) where a GPU silently gives inf or NaN.
        with np.errstate(all="ignore"), _guarded(kernel, tensors):
            kernel[grid](
                out, q, k_cache, v_cache, block_tables, seq_lens, shape.scale,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
                QUERIES_PER_KV=queries_per_kv, HEAD_DIM=shape.head_dim,
                HEAD_DIM_PAD=triton.next_power_of_2(shape.head_dim), BLOCK_SIZE=shape.block_size, TILE=tile, **rows)
    finally:
        if untrack:
            untrack()
    return out


def launch_group(kernel, q, k_cache, v_cache, block_tables, seq_lens, scale=None, tile=16):
    """launch on the grid (num_seqs, num_kv_heads): each program serves one KV head's group in BLOCK_M rows."""
    return launch(kernel, q, k_cache, v_cache, block_tables, seq_lens, scale, tile=tile, group=True)


def _raise_stub(kernel, err):
    """Turn the stub's NotImplementedError, as the interpreter or the compiler reports it, into a plain one."""
    # The interpreter wraps the stub's NotImplementedError; the compiler refuses a `raise` in a kernel.
    if isinstance(err.__cause__, NotImplementedError) or "AST node type: Raise" in str(err):
        raise NotImplementedError(f"{getattr(kernel, '__name__', kernel)} still raises NotImplementedError: "
                                  "write its body") from None


def _kernel_references():
    """kvlab's attention kernels, their launchers and references: what no exercise kernel may reach."""
    import kvlab.kernels
    from kvlab.kernels import cache_write, split_kv, triton_unified_attention

    device_code = [triton_unified_attention.attend_tiles, triton_unified_attention.unified_attention_kernel,
                   split_kv.paged_decode_split_kernel, split_kv.split_reduce_kernel,
                   cache_write.reshape_and_cache_kernel]
    python = [kvlab.kernels.paged_attention_decode, kvlab.kernels.paged_attention_decode_split_kv,
              kvlab.kernels.paged_attention_decode_reference, kvlab.kernels.unified_attention,
              kvlab.kernels.unified_attention_reference, kvlab.kernels.reshape_and_cache,
              kvlab.kernels.reshape_and_cache_reference]
    return python, device_code


def _refusing():
    """While a learner's kernel runs, kvlab's kernels and references refuse to run, however they are reached."""
    python, device_code = _kernel_references()
    return _checks.refusing(*python, *device_code)


@contextlib.contextmanager
def _guarded(kernel, tensors):
    """Run a learner's launch: wild addresses refused before they are touched, kvlab's references refused."""
    refuse = _load_counter.refuse_out_of_bounds(**tensors) if INTERPRETED else contextlib.nullcontext()
    try:
        with refuse, _refusing():
            yield
    except CheckFailed:
        raise
    except _checks.ReferenceRefused as err:
        raise CheckFailed(f"{getattr(kernel, '__name__', kernel)}: {err}") from None
    except Exception as err:
        refused = _refused_cause(err)
        if refused is not None:
            raise CheckFailed(f"{getattr(kernel, '__name__', kernel)}: {refused}") from None
        wild = _load_counter.out_of_bounds_cause(err)
        if wild is not None:
            raise CheckFailed(f"{getattr(kernel, '__name__', kernel)}: {wild}") from None
        _raise_stub(kernel, err)
        raise


def _refused_cause(err):
    """The ReferenceRefused behind err (the interpreter wraps what a kernel raises), or None."""
    seen = set()
    while err is not None and id(err) not in seen:
        if type(err).__name__ == "ReferenceRefused":   # from any copy of kvlab.course.checks
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _snapshot(**tensors):
    """Copies of the inputs, to check after a launch that the kernel left them as they were."""
    return {name: t.detach().clone() for name, t in tensors.items()}


def unchanged_inputs(case, before, **after):
    """Fail when a tensor in after differs from its copy in before (NaN equal to NaN): a kernel wrote into an input."""
    for name, now in after.items():
        then = before[name]
        same = (now == then) | (now.isnan() & then.isnan()) if now.is_floating_point() else now == then
        if not bool(same.all()):
            index = tuple(int(i) for i in (~same).nonzero()[0])
            raise CheckFailed(f"{case}: your kernel changed its input {name} at index {index} "
                              f"(it held {then[index].item()}, now {now[index].item()}). "
                              "Hint: a kernel writes only its output; check the pointer of every tl.store")


def own_kernel(kernel):
    """Fail unless kernel is a @triton.jit kernel written in the notebook, not one of kvlab's."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, (JITFunction, InterpretedFunction)):
        raise CheckFailed(f"{kernel!r} is not a @triton.jit kernel: keep the decorator and the signature")
    # kvlab's device functions and kernels too: a notebook kernel could call attend_tiles inside its body.
    python, device_code = _kernel_references()
    _checks.own_implementation(kernel.fn, *python, *device_code, *(f.fn for f in device_code))


def forbidden_reads(k_cache, v_cache, block_tables, seq_lens):
    """What the last interpreted launch read that it must not have, as sentences naming the load and sequence."""
    if not READ_LOG:
        return []
    lens, tables = seq_lens.tolist(), block_tables.contiguous().cpu()
    block_size, problems = k_cache.shape[1], []
    table_read = READ_LOG["block_tables"].reshape(tables.shape)
    for s, n in enumerate(lens):
        used = -(-n // block_size)
        extra = table_read[s, used:].nonzero()[0]
        if len(extra):
            problems.append(f"sequence {s} (length {n}, {used} block(s), table row of {tables.shape[1]}) had its "
                            f"table entries {(extra + used).tolist()[:6]} read: they are padding and may hold any "
                            "number. Mask the block-table load with pos < seq_len")
    owner = {}  # physical block -> (sequence, logical block) for the blocks sequences use
    for s, n in enumerate(lens):
        for j in range(-(-n // block_size)):
            owner[int(tables[s, j])] = (s, j)
    for name, pool in (("K", k_cache), ("V", v_cache)):
        poisoned = READ_LOG[name.lower() + "_cache"] & pool.detach().cpu().flatten().isnan().numpy()
        if poisoned.any():
            block, slot = divmod(int(poisoned.nonzero()[0][0]) // pool.stride(1), block_size)
            if block in owner:
                s, j = owner[block]
                where = (f"slot {slot} of sequence {s}'s last block, position {j * block_size + slot}, "
                         f"past its length {lens[s]}")
            else:
                where = f"block {block}, which no sequence's table uses"
            problems.append(f"the {name} load read {where}. Mask the {name} load with pos < seq_len "
                            "(and the head-dim lanes), and give those positions a score of -inf")
    if READ_LOG["elsewhere"]:
        problems.append(f"{READ_LOG['elsewhere']} lane(s) read memory outside every tensor passed: "
                        "an unmasked load past a tensor's end")
    return problems


def check_kernel(name, q, k_cache, v_cache, block_tables, seq_lens, *, kernel, tile=None, scale=None, hint=None,
                 nan_hint=None, group=False, max_kv_reads=None):
    """Launch kernel on a batch, then check what it read and, sequence by sequence, what it returned.

    group: launch on the group grid (launch_group); max_kv_reads: in the interpreter, the most K (and V) bytes
    the kernel may request, as a multiple of the bytes the sequences hold (None: not checked).
    """
    lens = seq_lens.tolist()
    case = (f"{name} [seq_lens {lens}, {q.shape[1]} heads on {k_cache.shape[2]} KV heads, head_dim {q.shape[2]}, "
            f"block size {k_cache.shape[1]}]")
    before = _snapshot(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens)
    with limited_output(), _load_counter.count_requested_bytes(k_cache=k_cache, v_cache=v_cache) as requested:
        yours = launch(kernel, q, k_cache, v_cache, block_tables, seq_lens, scale, tile=tile, group=group)
    unchanged_inputs(case, before, q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens)
    problems = forbidden_reads(k_cache, v_cache, block_tables, seq_lens)
    if problems:
        raise CheckFailed(f"{case}: your kernel read what it must not.\n  " + "\n  ".join(problems))
    expected = _reference.paged_attention_decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale=scale)
    yours, expected = yours.float().cpu(), expected.float().cpu()
    not_finite = (~yours.isfinite()).flatten(1).any(1)
    error = (yours - expected).abs().nan_to_num(float("inf")).flatten(1).amax(1)
    wrong = not_finite | (error > 1e-4 + 1e-4 * expected.abs().flatten(1).amax(1))
    if not wrong.any():
        _check_requested(case, requested, k_cache, lens, max_kv_reads)
        print(f"✓ {name}")
        return
    lines = [f"sequence {s} (length {lens[s]}): " + ("NaN or inf" if not_finite[s] else f"max error {error[s]:.3g}")
             for s in range(len(lens)) if wrong[s]]
    right = [n for s, n in enumerate(lens) if not wrong[s]]
    if not_finite.any():
        advice = nan_hint or (
            "no load read a NaN slot, so the NaN comes from the arithmetic: exp of a large score overflowing "
            "(subtract the max first), or 0 / 0 where all of a sequence's scores are -inf (is the pos < seq_len "
            "mask on the scores the right way round?)" if READ_LOG else READS_PAST_END)
    elif right and min(n for s, n in enumerate(lens) if wrong[s]) > max(right):
        advice = (f"only the sequences longer than {max(right)} positions are wrong: does your loop stop "
                  "before seq_len? It must run over every tile up to each program's own seq_len")
    elif max(n for s, n in enumerate(lens) if wrong[s]) > 64:
        advice = ("a long sequence is wrong: does your loop run over every tile up to the program's own seq_len "
                  "(no fixed bound)? Otherwise " + (hint or "compare the addressing with the spec"))
    else:
        advice = hint or ("compare the addressing with the spec: block = table[pos // BLOCK_SIZE], "
                          "slot = pos % BLOCK_SIZE")
    raise CheckFailed(f"{case}: not what the spec returns for {int(wrong.sum())} of {len(lens)} sequence(s).\n  "
                      + "\n  ".join(lines) + f"\n  Hint: {advice}")


def _check_requested(case, requested, k_cache, lens, limit):
    """Fail when the last launch requested more than limit times the K or V bytes the sequences hold."""
    if limit is None or not INTERPRETED:
        return
    held = _load_counter.kv_bytes_held(k_cache, lens)
    ratios = {name: requested[f"{name.lower()}_cache"] / held for name in ("K", "V")}
    if max(ratios.values()) > limit:
        raise CheckFailed(f"{case}: right values, but your kernel requested {ratios['K']:.2f}x the K bytes and "
                          f"{ratios['V']:.2f}x the V bytes the sequences hold (at most {limit:.2f}x).\n"
                          "  Hint: load each K/V tile once per program and use it for every row of the group: "
                          "the scores of all rows are one tl.dot(q, tl.trans(k)), the output one tl.dot(p, v)")


def kernel_checker(kernel, tile=None, group=False, max_kv_reads=None):
    """check_kernel with the kernel and tile fixed: checker(name, *batch, scale=..., hint=...)."""
    return partial(check_kernel, kernel=kernel, tile=tile, group=group, max_kv_reads=max_kv_reads)



# ------------------------------------------------------------------------------------------------
# Exercise 5: a whole ragged step (chunked prefills, prefix hits, decodes) through one unified kernel
# ------------------------------------------------------------------------------------------------

def make_step(seq_lens, q_lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, seed=0, padding="spare",
              peak=None, peak_at=16):
    """A ragged step on make_batch's NaN-trapped pool: (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc).

    Sequence i holds seq_lens[i] tokens in the pool, its q_lens[i] new ones (its last positions) included;
    q [sum(q_lens), num_heads, head_dim] holds the new tokens' queries, sequence after sequence; peak and
    peak_at plant large scores as make_batch does.
    """
    _, k_cache, v_cache, block_tables, lens = make_batch(seq_lens, num_heads, num_kv_heads, head_dim, block_size,
                                                         seed, padding, peak, peak_at)
    gen = torch.Generator().manual_seed(seed + 1000)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    query_start_loc = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    return (q.to(DEVICE), k_cache, v_cache, block_tables, lens, query_start_loc.to(DEVICE))


def step_rows(queries_per_kv):
    """(BLOCK_Q, BLOCK_M): new tokens per program and its rows, BLOCK_Q x queries_per_kv padded to >= 16."""
    block_m = group_rows(queries_per_kv)
    return max(1, block_m // queries_per_kv), block_m


WRITE_LOG = {}  # after an interpreted launch_step: "out" -> int array, how often each element was stored


def _track_writes(out):
    """Patch the interpreter's store so that it counts, per element of out, the masked-in lanes writing it."""
    from triton.runtime.interpreter import InterpreterBuilder
    original = InterpreterBuilder.create_masked_store
    start, size, numel = out.data_ptr(), out.element_size(), out.numel()
    WRITE_LOG.clear()
    WRITE_LOG["out"] = np.zeros(numel, dtype=np.int64)

    def create_masked_store(self, ptrs, value, mask, *args):
        addresses = np.broadcast_to(ptrs.data, mask.data.shape)[mask.data].astype(np.int64)
        inside = (addresses >= start) & (addresses < start + size * numel)
        np.add.at(WRITE_LOG["out"], (addresses[inside] - start) // size, 1)
        return original(self, ptrs, value, mask, *args)

    InterpreterBuilder.create_masked_store = create_masked_store
    return lambda: setattr(InterpreterBuilder, "create_masked_store", original)


def launch_step(kernel, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None, tile=16):
    """Validate, run kernel on the grid (num_seqs, num_kv_heads, q blocks of the longest chunk): (out, spare rows).

    q and out get spare rows after the step's last token (q's hold NaN), so that a row past a sequence's
    q_len reads and writes memory of this launch only; out's rows nobody writes stay NaN.
    """
    from kvlab.kernels import validate_paged_attention_inputs

    shape = validate_paged_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    num_tokens, num_heads, head_dim = q.shape
    queries_per_kv = num_heads // shape.num_kv_heads
    block_q, block_m = step_rows(queries_per_kv)
    spare = 2 * block_m + block_q
    q_rows = torch.full((num_tokens + spare, num_heads, head_dim), float("nan"), dtype=q.dtype, device=q.device)
    q_rows[:num_tokens] = q
    out_rows = torch.full_like(q_rows, float("nan"))
    starts = query_start_loc.tolist()
    max_q_len = max([b - a for a, b in zip(starts, starts[1:])] + [0])
    if shape.num_seqs == 0 or max_q_len == 0:
        return out_rows[:num_tokens], out_rows[num_tokens:]
    block_tables, seq_lens, query_start_loc = (t.contiguous() for t in (block_tables, seq_lens, query_start_loc))
    grid = (shape.num_seqs, shape.num_kv_heads, triton.cdiv(max_q_len, block_q))
    tensors = dict(q=q_rows, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens,
                   query_start_loc=query_start_loc, out=out_rows)
    untrack_reads = _track_reads(tensors) if INTERPRETED else None
    untrack_writes = _track_writes(out_rows) if INTERPRETED else None
    try:
        with np.errstate(all="ignore"), _guarded(kernel, tensors):
            kernel[grid](
                out_rows, q_rows, k_cache, v_cache, block_tables, seq_lens, query_start_loc, shape.scale,
                q_rows.stride(0), q_rows.stride(1), out_rows.stride(0), out_rows.stride(1),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
                QUERIES_PER_KV=queries_per_kv, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim,
                HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=shape.block_size, TILE=tile)
    finally:
        for undo in (untrack_reads, untrack_writes):
            if undo:
                undo()
    return out_rows[:num_tokens], out_rows[num_tokens:]


def unified_step(kernel, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None):
    """The step's attention output [num_tokens, num_heads, head_dim] from kernel: launch_step without spare rows."""
    return launch_step(kernel, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)[0]


ROW_MASK_HINT = ("store a row only when it is one of this program's (token, head) pairs: row_ok needs "
                 "rows < BLOCK_Q * QUERIES_PER_KV (the rows that pad the program to BLOCK_M) and tok < q_len")


def check_step(name, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, kernel, scale=None,
               hint=None, nan_hint=None):
    """Launch kernel on a ragged step; check what it read and wrote, then each new token against the spec."""
    lens, starts = seq_lens.tolist(), query_start_loc.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    block_q, _ = step_rows(num_heads // num_kv_heads)
    case = (f"{name} [seq_lens {lens}, q_lens {q_lens}, {num_heads} heads on {num_kv_heads} KV heads, "
            f"block size {k_cache.shape[1]}, {block_q} tokens per program]")
    before = _snapshot(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens,
                       query_start_loc=query_start_loc)
    with limited_output():
        yours, spare = launch_step(kernel, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    unchanged_inputs(case, before, q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                     seq_lens=seq_lens, query_start_loc=query_start_loc)
    problems = forbidden_reads(k_cache, v_cache, block_tables, seq_lens)
    if problems:
        raise CheckFailed(f"{case}: your kernel read what it must not.\n  " + "\n  ".join(problems))

    def where(token):
        s = max(i for i, a in enumerate(starts[:-1]) if a <= token and q_lens[i] > 0)
        return f"new token {token - starts[s]} of sequence {s} (seq_len {lens[s]}, q_len {q_lens[s]})"

    if WRITE_LOG:
        head_dim = q.shape[2]
        writes = WRITE_LOG["out"].reshape(-1, num_heads, head_dim)
        beyond = writes[len(yours):].sum()
        if beyond:
            raise CheckFailed(f"{case}: your kernel stored {int(beyond)} value(s) past the step's last token "
                              f"(rows of tokens past a sequence's q_len).\n  Hint: {ROW_MASK_HINT}")
        twice = (writes[:len(yours)] > 1).any(2).nonzero()
        if len(twice[0]):
            token, head = int(twice[0][0]), int(twice[1][0])
            raise CheckFailed(f"{case}: the output of {where(token)}, head {head} was stored "
                              f"{int(writes[token, head].max())} times: a second row wrote it, "
                              f"with another row's result.\n  Hint: {ROW_MASK_HINT}")
    expected = _reference.unified_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                                    scale=scale)
    yours, expected = yours.float().cpu(), expected.float().cpu()
    not_finite = (~yours.isfinite()).flatten(1).any(1)
    error = (yours - expected).abs().nan_to_num(float("inf")).flatten(1).amax(1)
    wrong = not_finite | (error > 1e-4 + 1e-4 * expected.abs().flatten(1).amax(1))
    if not wrong.any():
        print(f"✓ {name}")
        return
    bad = wrong.nonzero().flatten().tolist()
    if nan_hint and not_finite.any():
        hint = nan_hint
    lines = [f"{where(t)}, at position {lens[s] - q_lens[s] + t - starts[s]}: "
             + ("NaN or inf" if not_finite[t] else f"max error {error[t]:.3g}")
             for t in bad[:6] for s in [max(i for i, a in enumerate(starts[:-1]) if a <= t and q_lens[i] > 0)]]
    advice = hint or ("new token t of a sequence sits at position (seq_len - q_len) + t, after the tokens already "
                      "in the pool (a prefix-cache hit, earlier chunks); it sees every key at or before that "
                      "position, its own included: visible = row_ok & in_range & (pos <= query_pos)")
    raise CheckFailed(f"{case}: not what the spec returns for {len(bad)} of {len(yours)} new token(s).\n  "
                      + "\n  ".join(lines) + ("\n  ..." if len(bad) > 6 else "") + f"\n  Hint: {advice}")


def step_checker(kernel):
    """check_step with the kernel fixed: checker(name, *step, scale=..., hint=...)."""
    return partial(check_step, kernel=kernel)


# ------------------------------------------------------------------------------------------------
# Exercise 7: the cache write (vLLM's reshape_and_cache): a step's new K/V stored at their slots
# ------------------------------------------------------------------------------------------------

def make_cache_write(slots, num_blocks=6, block_size=8, num_kv_heads=2, head_dim=32, seed=0):
    """A cache write: (key, value, k_cache, v_cache, slot_mapping), one row per entry of slots.

    The pools hold random values; a padding row (slot -1) holds NaN, so that writing it anywhere shows.
    """
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    key = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen)
    value = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen)
    key[slot_mapping < 0], value[slot_mapping < 0] = float("nan"), float("nan")
    return tuple(t.to(DEVICE) for t in (key, value, k_cache, v_cache, slot_mapping))


def launch_cache_write(kernel, key, value, k_cache, v_cache, slot_mapping):
    """Validate, then run kernel on the grid (num_tokens,): one program per row of key and value."""
    from kvlab.kernels.cache_write import validate_cache_write_inputs

    validate_cache_write_inputs(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    tensors = dict(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    with np.errstate(all="ignore"), _guarded(kernel, tensors):
        kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads, NUM_KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1])


def check_cache_write(name, key, value, k_cache, v_cache, slot_mapping, *, kernel, hint=None):
    """Run kernel's write on copies of the pools; every slot must then hold what the engine's write puts there."""
    slots = slot_mapping.tolist()
    block_size = k_cache.shape[1]
    case = (f"{name} [slot_mapping {slots}, {tuple(k_cache.shape[:2])} blocks x slots, {key.shape[1]} KV heads, "
            f"head_dim {key.shape[2]}]")
    before = _snapshot(key=key, value=value, slot_mapping=slot_mapping)
    yours_k, yours_v = k_cache.clone(), v_cache.clone()
    with limited_output():
        launch_cache_write(kernel, key, value, yours_k, yours_v, slot_mapping)
    unchanged_inputs(case, before, key=key, value=value, slot_mapping=slot_mapping)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    _reference.reshape_and_cache_reference(key, value, expected_k, expected_v, slot_mapping)
    for pool, yours, expected in (("k_cache", yours_k, expected_k), ("v_cache", yours_v, expected_v)):
        wrong = ~((yours == expected) | (yours.isnan() & expected.isnan()))
        if not bool(wrong.any()):
            continue
        per_slot = wrong.flatten(2).any(2).flatten().nonzero().flatten().tolist()   # [num_slots]
        slot = per_slot[0]
        block, offset = divmod(slot, block_size)
        if slot in slots:
            token = slots.index(slot)
            what = (f"token {token}'s row (slot_mapping[{token}] = {slot}) should be in block {block}, slot {offset}, "
                    "but is not all there")
            advice = hint or ("block = slot // BLOCK_SIZE, offset = slot % BLOCK_SIZE; store every KV head and "
                              "head-dim lane of the token's K and V rows there")
        elif bool(yours.flatten(0, 1)[slot].isnan().any()):
            what = f"block {block}, slot {offset} holds NaN: a padding row (slot -1, its key and value NaN) was written"
            advice = hint or "a token whose slot is -1 is padding: write nothing for it (if slot >= 0: ...)"
        else:
            what = f"block {block}, slot {offset} changed, but no token's slot is {slot}"
            advice = hint or ("compute the destination from the token's own slot: block = slot // BLOCK_SIZE, "
                              "offset = slot % BLOCK_SIZE, with the pool's strides")
        raise CheckFailed(f"{case}: {pool} is not what the engine's cache write leaves there in "
                          f"{len(per_slot)} slot(s).\n  First: {what}.\n  Hint: {advice}")
    print(f"✓ {name}")


def cache_write_checker(kernel):
    """check_cache_write with the kernel fixed: checker(name, *make_cache_write(...), hint=...)."""
    return partial(check_cache_write, kernel=kernel)
