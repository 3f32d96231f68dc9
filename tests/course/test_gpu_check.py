"""scripts/gpu_check.sh can pass on its first GPU: what a CPU machine can check of it, checked here.

A GPU is lent only now and then, for minutes: the script must spend them measuring, not failing on a
missing package, a test file it forgot, or a test that builds CPU tensors for compiled kernels.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
# Kernel tests that need CUDA hidden (ahead-of-time compiles) or drive the benchmark on CPU: not for the GPU run.
# test_grading_guards.py: the Triton interpreter's address guard, which has nothing to do on a GPU.
CPU_ONLY = {"tests/kernels/test_kernel_aot.py", "tests/kernels/test_gpu_benchmark.py",
            "tests/kernels/test_grading_guards.py"}


def listed_tests() -> list[str]:
    text = SCRIPT.read_text()
    block = re.search(r"GPU_TESTS=\(([^)]*)\)", text)
    assert block, "gpu_check.sh must list its test files in GPU_TESTS=(...)"
    return block.group(1).split()


def test_the_script_parses_and_runs_every_kernel_test_file():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    listed = listed_tests()
    missing = [path for path in listed if not (ROOT / path).is_file()]
    assert not missing, f"gpu_check.sh lists test files that do not exist: {missing}"
    kernel_tests = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests" / "kernels").glob("test_*.py")}
    forgotten = sorted(kernel_tests - set(listed) - CPU_ONLY)
    assert not forgotten, f"kernel tests the GPU run would skip: {forgotten}; add them to GPU_TESTS"
    assert "ipywidgets" not in SCRIPT.read_text(), "the GPU checks need no widgets"


def test_on_a_machine_without_cuda_the_script_stops_at_once_and_says_why():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    run = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "no CUDA GPU here" in run.stderr, (run.returncode, run.stderr[-2000:])


def test_compiled_kernels_pick_the_torch_path_for_cpu_pools_and_refuse_cpu_tensors():
    """TRITON_INTERPRET=0 as on a GPU machine: auto follows the pools' device, and CPU tensors get a clear error."""
    code = textwrap.dedent("""
        import torch
        import kvlab.kernels as kernels
        from conftest import make_tiny_model
        from kvlab.cache.paged_cache import PagedKVCache

        assert not kernels.RUNS_IN_INTERPRETER, "TRITON_INTERPRET=0 compiles the kernels"
        model = make_tiny_model("llama")
        assert PagedKVCache.for_model(model, 4, 8, attention_backend="auto").attention_backend == "torch"
        try:
            PagedKVCache.for_model(model, 4, 8, attention_backend="triton")
        except ValueError as err:
            assert "runs on a CUDA device" in str(err), err
        else:
            raise AssertionError("a triton backend over CPU pools with compiled kernels must be refused")
        q = torch.randn(1, 4, 16)
        k = torch.randn(2, 8, 2, 16)
        args = (q, k, k.clone(), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
        for fn in (kernels.paged_attention_decode, kernels.paged_attention_decode_split_kv):
            try:
                fn(*args)
            except RuntimeError as err:
                assert "TRITON_INTERPRET=1" in str(err), err
            else:
                raise AssertionError(f"{fn.__name__} ran compiled kernels on CPU tensors")
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
