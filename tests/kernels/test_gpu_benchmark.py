"""benchmarks/paged_attention_gpu.py, every measurement path driven on CPU in the interpreter with a fake timer.

The benchmark only times on a GPU; here its inputs, launches, SDPA comparisons, mixed steps, autotune and
outputs run on tiny shapes, so the first GPU call measures instead of meeting a typo.
"""

import importlib.util
from argparse import Namespace
from pathlib import Path

import pytest
import torch

import kvlab.kernels as kernels

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("paged_attention_gpu", ROOT / "benchmarks" / "paged_attention_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class NoBar:
    def update(self, n=1):
        pass

    def close(self):
        pass


@pytest.mark.skipif(not kernels.RUNS_IN_INTERPRETER, reason="the GPU runs the real benchmark (scripts/gpu_check.sh)")
def test_every_measurement_runs_on_a_tiny_grid(tmp_path):
    bm = load_benchmark()
    calls = []

    def bench(fn):
        calls.append(fn)
        fn()
        return 1.0   # milliseconds

    args = Namespace(dtype="fp32", num_heads=4, head_dim=16, copy_bytes=2**16, progress=lambda **kwargs: NoBar(),
                     grid={"batch": (2,), "context": (40,), "block_size": (8,), "gqa": (2, 4)},
                     mixed=[(2, 20, 5)], autotune_shape=(2, 24))
    results = bm.run(args, torch.device("cpu"), bench, num_sms=4, log=lambda *a: None)
    rows, mixed, tuned = results["rows"], results["mixed"], results["tuned"]
    assert [(r["gqa"], r["batch"], r["context"], r["block_size"]) for r in rows] == [(2, 2, 40, 8), (4, 2, 40, 8)]
    for r in rows:
        assert r["max_diff"] < 1e-4, f"paged decode and SDPA disagree: {r}"
        assert r["mbytes"] == pytest.approx(bm.bytes_moved(2, 40, 4, 4 // r["gqa"], 16, 4) / 1e6)
    assert len(mixed) == 1 and mixed[0]["max_diff"] < 1e-4, f"the mixed step disagrees with SDPA: {mixed}"
    assert len(tuned) == 18 and all(t["note"] == "" for t in tuned), tuned
    written = bm.write_outputs(rows, mixed, tuned, tmp_path, "tiny", results["copy_gbps"])
    assert {p.name for p in written} == {"results.csv", "mixed.csv", "autotune.csv", "bandwidth.png", "vs_sdpa.png"}
    assert set(bm.COLUMNS) == set(rows[0]), "results.csv's columns and the rows must match"


def test_without_cuda_the_benchmark_says_so_and_exits_0(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: scripts/gpu_check.sh runs the benchmark")
    assert load_benchmark().main(["--quick"]) == 0
    assert "no CUDA GPU here" in capsys.readouterr().out
