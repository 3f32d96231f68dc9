"""Compile Chapter 7's kernels ahead of time for a GPU that need not be here (sm_75, sm_80, sm_90, ...).

The interpreter runs a kernel's Python on CPU tensors and so cannot see what only the compiler
checks: types that do not unify across a loop, a constexpr that should be one, shapes the GPU
backend refuses. triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", sm, 32))
runs the real pipeline (Triton IR, LLVM IR, PTX, then the ptxas bundled with triton to a cubin) with no
GPU and no driver.

The kernels are rebuilt as compiled JITFunctions from their Python source even when
kvlab.kernels was imported with the interpreter on (the default on a machine without CUDA). Compile in
a fresh process (`python -m kvlab.kernels.aot`, as the CI test does): once a kernel has run in the
interpreter, Triton leaves triton.language patched for it and compiling in that process fails.

The kernels are the unified paged-attention kernel (chunked prefills and decodes,
kvlab.kernels.triton_unified_attention), the split-KV decode pair (kvlab.kernels.split_kv) and the cache
write (kvlab.kernels.cache_write, in the pools' own dtype). Besides
fp32 / fp16 / bf16 pools, the unified and split-KV kernels are compiled for quantized pools
(QUANTIZED=True): int8 on every target, fp8 e4m3 (Triton's fp8e4nv, torch.float8_e4m3fn) from sm_89
on, the first NVIDIA GPUs that convert it in hardware: Triton 3.7 refuses fp8e4nv below sm_89 ("type fp8e4nv
not supported in this architecture"; it offers only fp8e4b15 and fp8e5 there).
Their q and output are fp16 by default; the reduce kernel never reads the pools, so it has no such variant.
Each compile also runs the ptxas inside the triton wheel with -v on the PTX, which reports what the GPU
compiler decided without a GPU: registers per thread and bytes spilled to local memory; with the
16-byte loads counted in the PTX and the shared memory Triton reserves, that is the kernel's fit.

    python -m kvlab.kernels.aot --sm 75 80 90 [--head-dim 128] [--block-size 16] [--kv-dtypes int8 fp8]
                                [--out DIR] [--json]
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

from . import cache_write as cw
from . import interpreter
from . import split_kv as sk
from . import triton_unified_attention as ua

# Triton's names for the element types of q, the caches and the output.
DTYPES = ("fp32", "fp16", "bf16")
# Quantized pools, by kvlab.cache.kv_storage's kv_cache_dtype name: Triton's element type for a pointer to them.
KV_DTYPES = {"int8": "i8", "fp8": "fp8e4nv"}


@dataclass(slots=True)
class CompiledKernel:
    """One kernel compiled for one target: what came out and how long it took."""

    kernel: str          # the @triton.jit function's name
    sm: int              # compute capability, e.g. 80 for an A100
    dtype: str           # element type of q and the output (and of the caches unless quantized)
    kv_dtype: str        # element type of the caches: dtype itself, or int8 / fp8 (e4m3) read with scales
    head_dim: int
    block_size: int
    ptx_target: str      # the PTX's .target line, e.g. sm_80 (sm_90a on Hopper)
    ptx_bytes: int       # size of the PTX text (0 if none was produced)
    vector_loads: int    # 16-byte global loads in the PTX (ld.global.v4, and cp.async of 16 bytes into shared
                         # memory, how Triton feeds tl.dot): how K and V rows are read
    cubin_bytes: int     # size of the cubin ptxas produced (0 if none)
    cubin_is_elf: bool   # a cubin is an ELF file, ready for cuModuleLoad on that GPU
    shared_bytes: int    # shared memory the kernel needs per program
    registers: int       # registers per thread, from ptxas -v (-1 if ptxas gave no report)
    spill_bytes: int     # bytes spilled to local memory per thread (stores + loads), from ptxas -v
    seconds: float


def sixteen_byte_loads(ptx: str) -> int:
    """Global loads of 16 bytes in a PTX: ld.global.v4 (four 32-bit lanes) and 16-byte cp.async copies."""
    return ptx.count("ld.global.v4") + len(re.findall(r"cp\.async\.\w+\.shared\.global[^;]*,\s*0x10\b", ptx))


def ptxas_report(ptx: str, sm: int) -> dict:
    """What the ptxas inside the triton wheel says of a kernel's PTX (`ptxas -v`): registers and spilled bytes."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    target = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        run = subprocess.run([get_ptxas(sm).path, "-v", f"--gpu-name={target.group(1) if target else f'sm_{sm}'}",
                              str(source), "-o", str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True)
    log = run.stdout + run.stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    return {"registers": int(registers.group(1)) if registers else -1, "spill_bytes": sum(spills), "log": log}


def dtypes_for(sm: int) -> list[str]:
    """Element types worth compiling for sm: bf16 needs sm_80 or newer (T4, sm_75, has none)."""
    return ["fp32", "fp16"] + (["bf16"] if sm >= 80 else [])


def kv_dtypes_for(sm: int) -> list[str]:
    """Quantized pools worth compiling for sm: int8 everywhere, fp8 e4m3 from sm_89 (Ada, Hopper) on."""
    return ["int8"] + (["fp8"] if sm >= 89 else [])


@contextlib.contextmanager
def _compiler_mode():
    # Triton consults TRITON_INTERPRET while compiling too (constexpr helpers), and triton.language's own
    # @jit helpers must be compiler-mode functions: kvlab.kernels may have switched both to the interpreter.
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        with interpreter.triton_language_as(interpreted=False):
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


def _signatures(dtype: str, head_dim: int, block_size: int, tile: int = ua.DEFAULT_TILE, kv_dtype=None,
                sliding: bool = False):
    """(kernel, signature, constexprs, num_warps) for the kernels, as the launchers would pass them.

    kv_dtype None: the pools hold dtype, the three kernels. "int8" or "fp8": quantized pools read with fp32
    scales, the unified and split-KV kernels only (the reduce kernel never reads the pools). sliding: the
    sliding-window variants (SLIDING=True) of the attention kernels.
    """
    head_dim_pad = triton.next_power_of_2(head_dim)
    quantized = kv_dtype is not None
    queries_per_kv = 4  # as in Llama-3-8B (32 query heads on 8 KV heads)
    io = f"*{dtype}"  # a pointer to that element type
    kv = f"*{KV_DTYPES[kv_dtype]}" if quantized else io
    if quantized:
        scales = {"k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    else:  # the launchers pass None, which the JIT turns into a constexpr: no argument, no code
        scales = {"k_scale_ptr": "constexpr", "v_scale_ptr": "constexpr"}
    block_q, block_m = ua.block_q_for(queries_per_kv)
    unified_consts = {"QUERIES_PER_KV": queries_per_kv, "BLOCK_Q": block_q, "BLOCK_M": block_m,
                      "HEAD_DIM": head_dim, "HEAD_DIM_PAD": head_dim_pad, "BLOCK_SIZE": block_size,
                      "TILE": tile, "QUANTIZED": quantized, "DOT_FP32": dtype == "fp32", "SLIDING": sliding}
    if not quantized:
        unified_consts.update(k_scale_ptr=None, v_scale_ptr=None)
    unified = {"out_ptr": io, "q_ptr": io, "k_cache_ptr": kv, "v_cache_ptr": kv, **scales, "block_tables_ptr": "*i32",
               "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "scale": "fp32", "sliding_window": "i32",
               "num_seqs": "i32",
               "num_kv_heads": "i32", "stride_q_tok": "i32", "stride_q_head": "i32", "stride_out_tok": "i32",
               "stride_out_head": "i32", "stride_cache_block": "i32", "stride_cache_slot": "i32",
               "stride_cache_head": "i32", "stride_table_seq": "i32"}
    split = {"part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "part_acc_ptr": "*fp32", "q_ptr": io,
             "k_cache_ptr": kv, "v_cache_ptr": kv, **scales, "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
             "scale": "fp32", "tokens_per_split": "i32", "sliding_window": "i32", "num_heads": "i32",
             "stride_q_seq": "i32",
             "stride_q_head": "i32", "stride_cache_block": "i32", "stride_cache_slot": "i32",
             "stride_cache_head": "i32", "stride_table_seq": "i32"}
    split_consts = {"QUERIES_PER_KV": queries_per_kv, "BLOCK_M": block_m, "HEAD_DIM": head_dim,
                    "HEAD_DIM_PAD": head_dim_pad, "BLOCK_SIZE": block_size, "TILE": tile,
                    "QUANTIZED": quantized, "DOT_FP32": dtype == "fp32", "SLIDING": sliding}
    if not quantized:
        split_consts.update(k_scale_ptr=None, v_scale_ptr=None)
    unified_warps = ua.num_warps_for(block_m, head_dim_pad, tile)
    kernels = [(ua.unified_attention_kernel, unified, unified_consts, unified_warps),
               (sk.paged_decode_split_kernel, split, split_consts, unified_warps)]
    if quantized:
        return kernels
    reduce = {"out_ptr": io, "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "part_acc_ptr": "*fp32",
              "seq_lens_ptr": "*i32", "tokens_per_split": "i32", "sliding_window": "i32", "num_splits": "i32",
              "stride_out_seq": "i32", "stride_out_head": "i32"}
    reduce_consts = {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": head_dim_pad, "NUM_SPLITS_PAD": 16, "SLIDING": sliding}
    num_kv_heads = 8  # Llama-3-8B's, as queries_per_kv above
    write = {"key_ptr": io, "value_ptr": io, "k_cache_ptr": io, "v_cache_ptr": io, "slot_mapping_ptr": "*i64",
             "stride_key_tok": "i32", "stride_key_head": "i32", "stride_value_tok": "i32", "stride_value_head": "i32",
             "stride_cache_block": "i32", "stride_cache_slot": "i32", "stride_cache_head": "i32"}
    write_consts = {"NUM_KV_HEADS": num_kv_heads, "NUM_KV_HEADS_PAD": triton.next_power_of_2(num_kv_heads),
                    "HEAD_DIM": head_dim, "HEAD_DIM_PAD": head_dim_pad, "BLOCK_SIZE": block_size}
    return kernels + [(sk.split_reduce_kernel, reduce, reduce_consts, 4),  # the launcher's num_warps for the reduce
                      (cw.reshape_and_cache_kernel, write, write_consts, 4)]


def compile_kernels(sm: int, head_dim: int = 128, block_size: int = 16, dtypes=None, out_dir=None,
                    kv_dtypes=None, kv_q_dtype: str = "fp16", sliding: bool = False) -> list[CompiledKernel]:
    """Compile the decode, split-KV and reduce kernels for GPUTarget("cuda", sm, 32) in each dtype, then the
    decode and split-KV kernels on each quantized pool kind (kv_dtypes, default kv_dtypes_for(sm)) with q in
    kv_q_dtype; sliding: their sliding-window variants."""
    variants = [(dtype, None) for dtype in (dtypes or dtypes_for(sm))]
    variants += [(kv_q_dtype, kv_dtype) for kv_dtype in (kv_dtypes_for(sm) if kv_dtypes is None else kv_dtypes)]
    results = []
    for dtype, kv_dtype in variants:
        for kernel, signature, constexprs, num_warps in _signatures(dtype, head_dim, block_size, kv_dtype=kv_dtype,
                                                                    tile=ua.tile_for(sm=sm), sliding=sliding):
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
                kv = f"_kv{kv_dtype}" if kv_dtype else ""
                stem = Path(out_dir) / f"{name}_sm{sm}_{dtype}{kv}_d{head_dim}_b{block_size}"
                stem.parent.mkdir(parents=True, exist_ok=True)
                stem.with_suffix(".ptx").write_text(ptx)
                if cubin:
                    stem.with_suffix(".cubin").write_bytes(cubin)
            target = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE)
            report = ptxas_report(ptx, sm) if ptx else {"registers": -1, "spill_bytes": 0}
            results.append(CompiledKernel(name, sm, dtype, kv_dtype or dtype, head_dim, block_size,
                                          target.group(1) if target else "",
                                          len(ptx), sixteen_byte_loads(ptx), len(cubin), cubin[:4] == b"\x7fELF",
                                          int(compiled.metadata.shared), report["registers"], report["spill_bytes"],
                                          round(seconds, 2)))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sm", type=int, nargs="+", default=[75, 80, 90], help="compute capabilities, e.g. 75 80 90")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, help="default: fp32 fp16, and bf16 from sm_80")
    parser.add_argument("--kv-dtypes", nargs="*", choices=list(KV_DTYPES),
                        help="quantized pools (none if the flag has no value); default: int8, and fp8 from sm_89")
    parser.add_argument("--kv-q-dtype", choices=DTYPES, default="fp16", help="q and output dtype with quantized pools")
    parser.add_argument("--sliding", action="store_true", help="the sliding-window variants of the attention kernels")
    parser.add_argument("--out", help="write each kernel's .ptx and .cubin here")
    parser.add_argument("--json", action="store_true", help="one JSON object per compiled kernel")
    args = parser.parse_args(argv)
    mode = "on" if interpreter.RUNS_IN_INTERPRETER else "off"
    print(f"# triton {triton.__version__}; kernels compiled from their @triton.jit source "
          f"(kvlab.kernels imported with the interpreter {mode})", flush=True)
    for sm in args.sm:
        for result in compile_kernels(sm, args.head_dim, args.block_size, args.dtypes, args.out, args.kv_dtypes,
                                      args.kv_q_dtype, args.sliding):
            if args.json:
                print(json.dumps(asdict(result)), flush=True)
            else:
                print(f"{result.ptx_target:7} {result.dtype:4} kv {result.kv_dtype:4} {result.kernel:26} "
                      f"head_dim {result.head_dim:3} "
                      f"block {result.block_size:3}: PTX {result.ptx_bytes / 1024:5.1f} KiB "
                      f"({result.vector_loads} 16-byte loads), cubin {result.cubin_bytes / 1024:5.1f} KiB, "
                      f"{result.registers} registers, {result.spill_bytes} B spilled, "
                      f"{result.shared_bytes / 1024:.1f} KiB shared, {result.seconds:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
