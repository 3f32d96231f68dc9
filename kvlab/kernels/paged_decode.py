"""Chapter 7: paged decode attention in Triton, the split-KV variant, and the checks every kernel shares.

Every sequence's keys and values live in the Chapter 3 pools, [num_blocks, block_size, num_kv_heads,
head_dim], scattered over physical blocks that its block table names. A kernel walks a sequence TILE
positions at a time, finds each position's physical slot through the block table
(block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE), loads those keys and values and folds
them into an online softmax (running max, running sum, rescaled accumulator), so the scores of the
whole sequence never exist at once.

The one-pass decode is the unified kernel's q_len == 1 case (kvlab.kernels.unified_attention: one
program per (sequence, KV head) for the whole query-head group, so each cached byte is requested once).
This module holds what the kernels share (validation, the interpreter/compiler switch) and the split-KV
("flash-decoding") pair for few long sequences:
  _paged_decode_split_kernel + _split_reduce_kernel
                           each program covers one range of a sequence for one query head and writes its
                           partial max, sum and accumulator to fp32 scratch; a small second kernel
                           rescales the partials to a common max and adds them. With a batch of one and
                           32 heads a one-pass grid has few programs for a GPU of 132 SMs; splitting a 32k
                           context 17 ways gives each SM about four.

Quantized pools (Chapter 10's kvlab.cache.quantized_cache): the pools may hold int8 or torch.float8_e4m3fn values
with one float32 scale per (physical block, KV head) for K and one for V, k_scale and v_scale
[num_blocks, num_kv_heads]. The kernels load the 8-bit values, convert them to fp32 and multiply each position
by its block's scale right after the load (real value = stored * scale), so everything after the loads is
unchanged. QUANTIZED is a compile-time flag: with unquantized pools the scale pointers are None and the
kernels compile to the same code as without it.

The order follows Triton's tutorials: kernels, then the wrappers that validate and launch them.
"""

import contextlib
import math
import os
import sys
from dataclasses import dataclass

import torch

# @triton.jit decides, when each decorator runs, whether the kernel is compiled for a GPU or executed by
# Triton's interpreter on CPU tensors: triton 3.x reads TRITON_INTERPRET (through triton.knobs) at that
# moment, so it must be set before the decorators below, and setting it later changes nothing for them.
# Without CUDA a compiled kernel cannot run at all ("0 active drivers"), so on such a machine we pick
# the interpreter unless the user already chose: TRITON_INTERPRET=0 keeps compiled kernels (what
# kvlab.kernels.aot needs to compile for a GPU that is not here), TRITON_INTERPRET=1 forces the
# interpreter even with CUDA. If triton was imported before this line, its own helpers (tl.sum, ...)
# were built in the other mode: triton_language_as below deals with that.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


@triton.jit
def _split_reduce_kernel(
    out_ptr,             # [num_seqs, num_heads, head_dim] written here, in q's dtype
    part_max_ptr,        # [num_seqs, num_heads, num_splits] fp32: each split's max (base 2)
    part_sum_ptr,        # [num_seqs, num_heads, num_splits] fp32: each split's sum
    part_acc_ptr,        # [num_seqs, num_heads, num_splits, head_dim] fp32: each split's accumulator
    seq_lens_ptr,        # [num_seqs] int32: tokens of each sequence
    tokens_per_split,    # positions each split covered
    num_splits,          # splits per (sequence, head) in the scratch buffers
    stride_out_seq,      # elements between two sequences' outputs
    stride_out_head,     # elements between two heads of one output
    HEAD_DIM: tl.constexpr,        # real head_dim
    HEAD_DIM_PAD: tl.constexpr,    # next power of two of HEAD_DIM
    NUM_SPLITS_PAD: tl.constexpr,  # next power of two of num_splits
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    splits = tl.arange(0, NUM_SPLITS_PAD)
    # Splits that saw at least one position; the others wrote nothing, so their scratch is never read.
    used = splits < tl.cdiv(seq_len, tokens_per_split)
    part = (seq * tl.num_programs(1) + head) * num_splits + splits
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    m = tl.load(part_max_ptr + part, mask=used, other=float("-inf"))           # [NUM_SPLITS_PAD]
    s = tl.load(part_sum_ptr + part, mask=used, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                  mask=used[:, None] & dim_ok[None, :], other=0.0)             # [NUM_SPLITS_PAD, HEAD_DIM_PAD]
    m_all = tl.max(m, axis=0)             # split 0 always has work, so this is finite
    weight = tl.exp2(m - m_all)           # moves each split's sum and accumulator onto the common max; 0 if unused
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.sum(weight * s, axis=0)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


# True when the kernels above were built by Triton's interpreter (CPU tensors), False when compiled for a GPU.
RUNS_IN_INTERPRETER = isinstance(_split_reduce_kernel, InterpretedFunction)

# triton.language's own helpers (tl.sum, tl.max, tl.zeros, tl.cdiv, ...) are @triton.jit functions too,
# built for the interpreter or the compiler when triton is first imported. When another module imported
# triton before this one switched the interpreter on, they are compiled-mode functions that refuse to run
# in the interpreter ("Cannot call @triton.jit'd outside of the scope of a kernel"); the other way round,
# interpreter-mode helpers break an ahead-of-time compile. Their twins of the right kind stand in while
# our kernels run or compile, and the originals are put back afterwards.
_TWINS = {}
# @triton.jit helpers the kernels call by their global names, per module (kvlab.kernels.unified_attention
# registers its own): they must be built in the same mode as the kernel that calls them.
DEVICE_FUNCTIONS: dict[str, tuple[str, ...]] = {}


def register_device_functions(module_name: str, names: tuple[str, ...]) -> None:
    """Let triton_language_as swap these @triton.jit helpers of module_name with the kernels."""
    DEVICE_FUNCTIONS[module_name] = tuple(names)


def _twin(helper, interpreted: bool):
    key = (helper.fn, interpreted)
    if key not in _TWINS:  # one twin per function, so Triton's identity checks (combine_fn is _sum_combine) hold
        _TWINS[key] = InterpretedFunction(helper.fn) if interpreted else JITFunction(helper.fn, **helper.kwargs)
    return _TWINS[key]


@contextlib.contextmanager
def triton_language_as(interpreted: bool):
    """Within the block, triton.language's @jit helpers are built for the interpreter (True) or the compiler (False)."""
    wrong = JITFunction if interpreted else InterpretedFunction
    swapped = []
    if isinstance(tl.sum, wrong):
        spaces = [module for name, module in list(sys.modules.items()) if name.startswith("triton.language")]
        for space in spaces + [tl.core.tensor]:  # tl.core.tensor holds the method forms, x.sum()
            for name, value in list(vars(space).items()):
                if isinstance(value, wrong) and value.fn.__module__.startswith("triton.language"):
                    swapped.append((space, name, value))
                    setattr(space, name, _twin(value, interpreted))
    # Our own device functions are called from the kernels by their global names: they must match the mode too.
    for module_name, names in DEVICE_FUNCTIONS.items():
        module = sys.modules[module_name]
        for name in names:
            value = getattr(module, name)
            if isinstance(value, wrong):
                swapped.append((module, name, value))
                setattr(module, name, _twin(value, interpreted))
    try:
        yield
    finally:
        for space, name, value in reversed(swapped):
            setattr(space, name, value)


# ------------------------------------------------------------------------------------------------
# Wrappers: validate, pick the grid, launch
# ------------------------------------------------------------------------------------------------

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # 256 x a tile of 64 fp32 values is as much as a program should hold
DEFAULT_TILE = 64                     # positions per loop iteration: 64 x 128 x 2 B = 16 KiB of K per load
MIN_TOKENS_PER_SPLIT = 256            # shorter splits cost more in scratch traffic than they add in parallelism
MAX_SPLITS = 64


@dataclass(slots=True, frozen=True)
class PagedDecodeShape:
    """What validation learned about one call: sizes, the longest sequence and the softmax scale."""

    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    max_blocks_per_seq: int
    max_seq_len: int      # longest sequence in the batch (0 for an empty batch)
    scale: float


def quantized_cache_dtypes() -> tuple[torch.dtype, ...]:
    """Pool dtypes read with k_scale / v_scale: int8, and torch.float8_e4m3fn where this torch has it (2.1+)."""
    # Looked up at call time, like kvlab.cache.quantized_cache does, so a torch without float8 is told so clearly.
    fp8 = getattr(torch, "float8_e4m3fn", None)
    return (torch.int8,) if fp8 is None else (torch.int8, fp8)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cache_dtypes_hint() -> str:
    if len(quantized_cache_dtypes()) == 2:
        return "use float32, float16 or bfloat16, or int8 / float8_e4m3fn pools with k_scale and v_scale"
    return (f"use float32, float16 or bfloat16, or int8 pools with k_scale and v_scale (fp8 pools need "
            f"torch.float8_e4m3fn, which torch {torch.__version__} does not have: it arrived in torch 2.1)")


def _check_kv_scales(k_cache, k_scale, v_scale, num_blocks: int, num_kv_heads: int) -> None:
    """Scales come with 8-bit pools and only with them: float32 [num_blocks, num_kv_heads], contiguous, > 0 and
    finite."""
    quantized = k_cache.dtype in quantized_cache_dtypes()
    cache_dtype = _dtype_name(k_cache.dtype)
    if not quantized:
        given = [name for name, t in (("k_scale", k_scale), ("v_scale", v_scale)) if t is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} given, but the caches are {cache_dtype}: scales are only for "
                             f"int8 or fp8 pools (leave k_scale and v_scale as None)")
        return
    missing = [name for name, t in (("k_scale", k_scale), ("v_scale", v_scale)) if t is None]
    if missing:
        raise ValueError(f"the caches are {cache_dtype}, so k_scale and v_scale are required ({' and '.join(missing)} "
                         f"missing): float32 [num_blocks, num_kv_heads] = [{num_blocks}, {num_kv_heads}], real value = "
                         f"stored * scale (QuantizedPagedKVCache keeps them in k_scales[layer] and v_scales[layer])")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [num_blocks, num_kv_heads] of float32; "
                            f"got {type(s).__name__}")
        if s.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 (what the kernel reads); got {_dtype_name(s.dtype)}")
        if tuple(s.shape) != (num_blocks, num_kv_heads):
            raise ValueError(f"{name} must have shape [num_blocks, num_kv_heads] = ({num_blocks}, {num_kv_heads}), "
                             f"one scale per (physical block, KV head); got {tuple(s.shape)}")
        if s.device != k_cache.device:
            raise ValueError(f"{name} is on {s.device} but the caches are on {k_cache.device}: "
                             f"all inputs must be on one device")
        if not s.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel reads scale[block, kv_head] at "
                             f"block * num_kv_heads + kv_head); got strides {s.stride()} (call .contiguous())")
        bad = ~(torch.isfinite(s) & (s > 0))
        if bad.any():
            i, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"{name}[{i}, {j}] is {float(s[i, j])}: every scale must be positive and finite "
                             f"(real value = stored * scale; an all-zero block still needs a scale > 0)")


def check_query_and_pools(named, q, k_cache, v_cache, k_scale=None, v_scale=None, q_dims="num_seqs") -> None:
    """The checks every kernel call shares: tensors, shapes, one device, dtypes, head counts, strides and scales.

    named: (name, tensor) of every input, for the type and device checks; q_dims names q's first dim.
    """
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if q.ndim != 3:
        raise ValueError(f"q must have 3 dims [{q_dims}, num_heads, head_dim]; got shape {tuple(q.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.ndim != 4:
            raise ValueError(f"{name} must have 4 dims [num_blocks, block_size, num_kv_heads, head_dim]; "
                             f"got shape {tuple(cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape; got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    devices = {name: t.device for name, t in named}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"all inputs must be on one device; got {listed}")

    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q has dtype {_dtype_name(q.dtype)}, which is not supported: use float32, float16 or "
                         f"bfloat16 (only the pools may be 8-bit, with k_scale and v_scale)")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype not in SUPPORTED_DTYPES + quantized_cache_dtypes():
            raise ValueError(f"{name} has dtype {_dtype_name(cache.dtype)}, which is not supported: "
                             f"{_cache_dtypes_hint()}")
    quantized = k_cache.dtype in quantized_cache_dtypes()
    if k_cache.dtype != v_cache.dtype or not (quantized or q.dtype == k_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share one dtype (or the pools share one 8-bit dtype); got "
                         f"{_dtype_name(q.dtype)}, {_dtype_name(k_cache.dtype)} and {_dtype_name(v_cache.dtype)}")

    num_heads, head_dim = q.shape[1], q.shape[2]
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if head_dim != cache_head_dim:
        raise ValueError(f"q has head_dim {head_dim} but the caches have head_dim {cache_head_dim}")
    if num_kv_heads < 1 or num_heads < 1:
        raise ValueError(f"need at least one head; got num_heads {num_heads} and num_kv_heads {num_kv_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}): "
                         f"every KV head serves the same number of query heads (GQA; MQA is num_kv_heads = 1)")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} is not supported: it must be a power of two (1, 2, 4, ..., 16, ...)")
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not supported: it must be between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"k_cache and v_cache must have the same strides and a contiguous head_dim; got strides "
                         f"{k_cache.stride()} and {v_cache.stride()} (call .contiguous() on the pools once)")
    _check_kv_scales(k_cache, k_scale, v_scale, num_blocks, num_kv_heads)


def resolve_scale(scale, head_dim: int) -> float:
    """The softmax scale: head_dim ** -0.5 unless given; ValueError unless finite."""
    scale = head_dim ** -0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number; got {scale}")
    return scale


def check_tables(block_tables, lens, block_size: int, num_blocks: int) -> None:
    """Each sequence fits its table row, and every entry it uses names a block of the pool (lens: int64 [num_seqs]).

    Only the entries a sequence uses must name real blocks; the rest of its row may hold anything.
    """
    max_blocks_per_seq = block_tables.shape[1]
    capacity = max_blocks_per_seq * block_size
    if (lens > capacity).any():
        i = int((lens > capacity).nonzero()[0, 0])
        raise ValueError(f"seq_lens[{i}] is {int(lens[i])} but a block table row holds only {max_blocks_per_seq} "
                         f"blocks of {block_size} = {capacity} tokens")
    blocks_used = (lens + block_size - 1) // block_size                         # [num_seqs]
    used = torch.arange(max_blocks_per_seq, device=lens.device)[None, :] \
        < blocks_used[:, None]                                                  # [num_seqs, max_blocks]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bad.any():
        i, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block_tables[{i}, {j}] is {int(block_tables[i, j])}, outside the pool of {num_blocks} "
                         f"blocks (sequence {i} has {int(lens[i])} tokens and uses its first "
                         f"{int(blocks_used[i])} entries)")


def validate_paged_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens, scale=None, k_scale=None,
                                 v_scale=None) -> PagedDecodeShape:
    """Check a decode call's inputs without launching anything; raise ValueError naming what is wrong.

    q: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: int32 [num_seqs, max_blocks_per_seq]; seq_lens: int32 [num_seqs].
    Quantized pools (int8, or float8_e4m3fn where torch has it) also need k_scale and v_scale: float32
    [num_blocks, num_kv_heads], contiguous, positive and finite; q stays float32, float16 or bfloat16.
    """
    named = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
             ("seq_lens", seq_lens))
    check_query_and_pools(named, q, k_cache, v_cache, k_scale, v_scale)
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    for name, t, dims in (("block_tables", block_tables, "[num_seqs, max_blocks_per_seq]"),
                          ("seq_lens", seq_lens, "[num_seqs]")):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 (what the kernel reads); got {_dtype_name(t.dtype)}")
        if t.ndim != dims.count(",") + 1 or t.shape[0] != num_seqs:
            raise ValueError(f"{name} must have shape {dims} with num_seqs = {num_seqs} (q's first dim); "
                             f"got {tuple(t.shape)}")
    max_blocks_per_seq = block_tables.shape[1]
    scale = resolve_scale(scale, head_dim)
    if num_seqs == 0:
        return PagedDecodeShape(0, num_heads, num_kv_heads, head_dim, num_blocks, block_size, max_blocks_per_seq,
                                0, scale)
    lens = seq_lens.long()
    if (lens < 1).any():
        i = int((lens < 1).nonzero()[0, 0])
        raise ValueError(f"seq_lens[{i}] is {int(lens[i])}: every sequence needs at least 1 token "
                         f"(the decode query attends over its own key too)")
    check_tables(block_tables, lens, block_size, num_blocks)
    return PagedDecodeShape(num_seqs, num_heads, num_kv_heads, head_dim, num_blocks, block_size,
                            max_blocks_per_seq, int(lens.max()), scale)


def _check_mode(device: torch.device) -> None:
    """Refuse CPU tensors when the kernels were compiled for a GPU (the interpreter was off at import)."""
    if device.type == "cpu" and not RUNS_IN_INTERPRETER:
        raise RuntimeError(
            "kvlab.kernels was imported with Triton's interpreter off (TRITON_INTERPRET=0, or CUDA was available), "
            "so its kernels are compiled for a GPU and cannot read CPU tensors. Move the tensors to CUDA, or set "
            "TRITON_INTERPRET=1 before importing kvlab.kernels (in a new process) to run them on the CPU.")


def _unit_last_stride(q, block_tables, seq_lens):
    # The kernels step through head_dim, a table row and seq_lens one element at a time; other strides are
    # passed in. Copying a strided q, table or seq_lens is cheap (the pools are never copied).
    return q if q.stride(-1) == 1 else q.contiguous(), \
        block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous(), seq_lens.contiguous()


def _is_quantized(k_cache, k_scale, v_scale) -> bool:
    """The launchers' one check (no device sync): scales come with 8-bit pools and only with them."""
    quantized = k_cache.dtype in quantized_cache_dtypes()
    if quantized != (k_scale is not None) or quantized != (v_scale is not None):
        raise ValueError(f"{_dtype_name(k_cache.dtype)} pools need k_scale and v_scale "
                         f"{'both given' if quantized else 'both None'} (validate_paged_decode_inputs checks them)")
    return quantized


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of device's GPU; 132 (an H100) where there is none, for the split rule."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """How many ranges to split each sequence into: enough programs for about 4 per SM, none under 256 tokens.

    A decode program serves one (sequence, KV head) and its query-head group, so a split adds num_seqs x
    num_kv_heads programs: vLLM's rule of thumb, split when those alone would leave most SMs idle.
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = triton.cdiv(4 * num_sms, programs)                 # small batches want more splits
    useful = triton.cdiv(max(1, max_seq_len), MIN_TOKENS_PER_SPLIT)  # long contexts allow more splits
    return max(1, min(wanted, useful, MAX_SPLITS))


def _launch_inputs(shape: PagedDecodeShape, q, block_tables, seq_lens):
    """Checks shared by both launchers, then q, block_tables, seq_lens with unit last stride and the padded head dim."""
    _check_mode(q.device)
    q, block_tables, seq_lens = _unit_last_stride(q, block_tables, seq_lens)
    return q, block_tables, seq_lens, triton.next_power_of_2(shape.head_dim)


def split_plan(max_seq_len: int, num_splits: int, tile: int = DEFAULT_TILE) -> tuple[int, int]:
    """(tokens_per_split, num_splits): whole tiles per split, and the splits that leaves (never more than asked)."""
    tokens_per_split = triton.cdiv(triton.cdiv(max(1, max_seq_len), num_splits), tile) * tile
    return tokens_per_split, triton.cdiv(max(1, max_seq_len), tokens_per_split)


def allocate_split_workspace(num_seqs, num_heads, num_splits, head_dim, device):
    """fp32 scratch for split-KV: max and sum [num_seqs, num_heads, num_splits], acc [..., head_dim]."""
    part_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=device)
    return part_max, torch.empty_like(part_max), torch.empty((num_seqs, num_heads, num_splits, head_dim),
                                                              dtype=torch.float32, device=device)
