"""Compile Chapter 7's kernels ahead of time for a GPU that need not be here (sm_75, sm_80, sm_90, ...).

The interpreter runs a kernel's Python on CPU tensors and so cannot see what only the compiler
checks: types that do not unify across a loop, a constexpr that should be one, shapes the GPU
backend refuses. triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", sm, 32))
runs the real pipeline (Triton IR, LLVM IR, PTX, then the ptxas bundled with triton to a cubin) with no
GPU and no driver.

The kernels are rebuilt as compiled JITFunctions from their Python source even when
kvlab.kernels was imported with the interpreter on (the default on a machine without CUDA).

    python -m kvlab.kernels.aot --sm 75 80 90 [--head-dim 128] [--block-size 16] [--out DIR] [--json]
"""

import argparse
import contextlib
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from . import paged_attention as pa

# Triton's names for the element types of q, the caches and the output.
DTYPES = ("fp32", "fp16", "bf16")


@dataclass(slots=True)
class CompiledKernel:
    """One kernel compiled for one target: what came out and how long it took."""

    kernel: str          # the @triton.jit function's name
    sm: int              # compute capability, e.g. 80 for an A100
    dtype: str           # element type of q, the caches and the output
    head_dim: int
    block_size: int
    ptx_target: str      # the PTX's .target line, e.g. sm_80 (sm_90a on Hopper)
    ptx_bytes: int       # size of the PTX text (0 if none was produced)
    vector_loads: int    # 16-byte ld.global.v4 instructions in the PTX: how K and V rows are read
    cubin_bytes: int     # size of the cubin ptxas produced (0 if none)
    cubin_is_elf: bool   # a cubin is an ELF file, ready for cuModuleLoad on that GPU
    shared_bytes: int    # shared memory the kernel needs per program
    seconds: float


def dtypes_for(sm: int) -> list[str]:
    """Element types worth compiling for sm: bf16 needs sm_80 or newer (T4, sm_75, has none)."""
    return ["fp32", "fp16"] + (["bf16"] if sm >= 80 else [])


@contextlib.contextmanager
def _compiler_mode():
    # Triton consults TRITON_INTERPRET while compiling too (constexpr helpers), and triton.language's own
    # @jit helpers must be compiler-mode functions: kvlab.kernels may have switched both to the interpreter.
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        with pa.triton_language_as(interpreted=False):
            yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def _jit(kernel) -> JITFunction:
    # With the interpreter on, @triton.jit returned an InterpretedFunction; its .fn is the plain Python
    # function, which JITFunction compiles like any kernel.
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)


def _signatures(dtype: str, head_dim: int, block_size: int, tile: int = pa.DEFAULT_TILE):
    """(kernel, signature, constexprs, num_warps) for the three kernels, as the launchers would pass them."""
    head_dim_pad = triton.next_power_of_2(head_dim)
    num_warps = pa._num_warps(head_dim_pad, tile)
    # QUERIES_PER_KV 4 as in Llama-3-8B (32 query heads on 8 KV heads).
    shape = {"QUERIES_PER_KV": 4, "HEAD_DIM": head_dim, "HEAD_DIM_PAD": head_dim_pad,
             "BLOCK_SIZE": block_size, "TILE": tile}
    io = f"*{dtype}"  # a pointer to that element type
    decode = {"out_ptr": io, "q_ptr": io, "k_cache_ptr": io, "v_cache_ptr": io, "block_tables_ptr": "*i32",
              "seq_lens_ptr": "*i32", "scale": "fp32", "stride_q_seq": "i32", "stride_q_head": "i32",
              "stride_out_seq": "i32", "stride_out_head": "i32", "stride_cache_block": "i32",
              "stride_cache_slot": "i32", "stride_cache_head": "i32", "stride_table_seq": "i32"}
    split = {"part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "part_acc_ptr": "*fp32", "q_ptr": io,
             "k_cache_ptr": io, "v_cache_ptr": io, "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
             "scale": "fp32", "tokens_per_split": "i32", "stride_q_seq": "i32", "stride_q_head": "i32",
             "stride_cache_block": "i32", "stride_cache_slot": "i32", "stride_cache_head": "i32",
             "stride_table_seq": "i32"}
    reduce = {"out_ptr": io, "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "part_acc_ptr": "*fp32",
              "seq_lens_ptr": "*i32", "tokens_per_split": "i32", "num_splits": "i32",
              "stride_out_seq": "i32", "stride_out_head": "i32"}
    reduce_consts = {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": head_dim_pad, "NUM_SPLITS_PAD": 16}
    return [(pa._paged_decode_kernel, decode, shape, num_warps),
            (pa._paged_decode_split_kernel, split, shape, num_warps),
            (pa._split_reduce_kernel, reduce, reduce_consts, 4)]  # the launcher's num_warps for the reduce


def compile_kernels(sm: int, head_dim: int = 128, block_size: int = 16, dtypes=None, out_dir=None) -> list[CompiledKernel]:
    """Compile the decode, split-KV and reduce kernels for GPUTarget("cuda", sm, 32) in each dtype."""
    results = []
    for dtype in dtypes or dtypes_for(sm):
        for kernel, signature, constexprs, num_warps in _signatures(dtype, head_dim, block_size):
            fn = _jit(kernel)
            signature = dict(signature, **{name: "constexpr" for name in constexprs})
            # What the JIT infers at run time from real arguments: pointers 16-byte aligned (torch allocates
            # them so) and strides divisible by 16 (multiples of head_dim 128 or 80). Without these hints the
            # compiler cannot prove a row of K is 16-byte aligned and loads it 2 bytes at a time.
            attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
                     for name, ty in signature.items() if ty.startswith("*") or name.startswith("stride")}
            start = time.perf_counter()
            with _compiler_mode():
                compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", sm, 32),
                                          options={"num_warps": num_warps})
            seconds = time.perf_counter() - start
            ptx, cubin = compiled.asm.get("ptx", ""), compiled.asm.get("cubin", b"")
            name = fn.__name__.strip("_")
            if out_dir is not None:
                stem = Path(out_dir) / f"{name}_sm{sm}_{dtype}_d{head_dim}_b{block_size}"
                stem.parent.mkdir(parents=True, exist_ok=True)
                stem.with_suffix(".ptx").write_text(ptx)
                if cubin:
                    stem.with_suffix(".cubin").write_bytes(cubin)
            target = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE)
            results.append(CompiledKernel(name, sm, dtype, head_dim, block_size, target.group(1) if target else "",
                                          len(ptx), ptx.count("ld.global.v4"), len(cubin), cubin[:4] == b"\x7fELF",
                                          int(compiled.metadata.shared), round(seconds, 2)))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sm", type=int, nargs="+", default=[75, 80, 90], help="compute capabilities, e.g. 75 80 90")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, help="default: fp32 fp16, and bf16 from sm_80")
    parser.add_argument("--out", help="write each kernel's .ptx and .cubin here")
    parser.add_argument("--json", action="store_true", help="one JSON object per compiled kernel")
    args = parser.parse_args(argv)
    print(f"# triton {triton.__version__}; kernels compiled from their @triton.jit source "
          f"(kvlab.kernels imported with the interpreter {'on' if pa.RUNS_IN_INTERPRETER else 'off'})", flush=True)
    for sm in args.sm:
        for result in compile_kernels(sm, args.head_dim, args.block_size, args.dtypes, args.out):
            if args.json:
                print(json.dumps(asdict(result)), flush=True)
            else:
                print(f"{result.ptx_target:7} {result.dtype:4} {result.kernel:26} head_dim {result.head_dim:3} "
                      f"block {result.block_size:3}: PTX {result.ptx_bytes / 1024:5.1f} KiB "
                      f"({result.vector_loads} 16-byte loads), cubin {result.cubin_bytes / 1024:5.1f} KiB, "
                      f"{result.seconds:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
