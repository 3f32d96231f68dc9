"""Chapter 7: the kernels compile ahead of time for sm_75, sm_80 and sm_90 with no GPU here.

The interpreter executes a kernel's Python and never runs the compiler, so type errors in loops,
shapes the GPU backend refuses or loads that are not vectorised only show up here. The compile runs
in a fresh process with TRITON_INTERPRET removed and CUDA hidden, as on a CPU-only CI machine.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("paged_decode_kernel", "paged_decode_split_kernel", "split_reduce_kernel")


def _expected():
    """(kernel, sm, dtype, head_dim) to compile: fp32/fp16 everywhere, bf16 from sm_80, head_dim 80 on sm_80."""
    wanted = set()
    for sm in (75, 80, 90):
        for dtype in ("fp32", "fp16") + (("bf16",) if sm >= 80 else ()):
            wanted |= {(kernel, sm, dtype, 128) for kernel in KERNELS}
    wanted |= {(kernel, 80, "fp16", 80) for kernel in KERNELS}
    return wanted


def test_kernels_compile_to_ptx_and_cubin_for_sm75_sm80_sm90(tmp_path):
    """Every kernel x dtype gives PTX for its target and an ELF cubin from ptxas, with 16-byte loads of K and V."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", TRITON_CACHE_DIR=str(tmp_path / "triton-cache"), OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT))
    code = ("from kvlab.kernels.aot import main; main(['--sm', '75', '80', '90', '--json']); "
            "main(['--sm', '80', '--head-dim', '80', '--dtypes', 'fp16', '--json'])")
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"ahead-of-time compile failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    got = {(r["kernel"], r["sm"], r["dtype"], r["head_dim"]) for r in records}
    assert got == _expected(), (f"missing: {sorted(_expected() - got)}; unexpected: {sorted(got - _expected())} "
                                "(bf16 is skipped on sm_75 only)")
    for r in records:
        what = f"{r['kernel']} {r['dtype']} head_dim {r['head_dim']} for sm_{r['sm']}"
        assert r["ptx_bytes"] > 0 and r["ptx_target"].startswith(f"sm_{r['sm']}"), f"{what}: no PTX for that target"
        assert r["cubin_bytes"] > 0 and r["cubin_is_elf"], f"{what}: ptxas produced no cubin"
        if r["kernel"] != "split_reduce_kernel":
            assert r["vector_loads"] > 0, (f"{what}: K and V rows are not loaded 16 bytes at a time; the compiler "
                                           "needs to know strides and pointers are multiples of 16 (tt.divisibility)")
    assert "interpreter on" in result.stdout, (
        "with CUDA hidden, kvlab.kernels switches to the interpreter; aot must still compile the @triton.jit source")
