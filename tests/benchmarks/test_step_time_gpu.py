"""benchmarks/step_time_gpu.py, the simulator's calibration on a lent GPU, works before its first GPU run.

A GPU is lent only now and then, for minutes: what a CPU can check of the script is checked here (its whole code
path on a tiny model with the torch backend, the GPU table lookup, the cases it leaves out for memory).
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kvlab.benchmarks.step_cost import PassCase
from kvlab.simulation.step_time import ModelSpec, step_time

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("step_time_gpu", ROOT / "benchmarks" / "step_time_gpu.py")
step_time_gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_time_gpu)

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 256,
        "torch_dtype": "float32"}


@pytest.mark.parametrize("device_name, entry", [
    ("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA L4", "L4"), ("Tesla T4", "T4"),
    ("NVIDIA H100 PCIe", None), ("NVIDIA L40S", None), ("NVIDIA GeForce RTX 4090", None)])
def test_the_device_name_finds_its_datasheet_entry_or_none(device_name, entry):
    assert step_time_gpu.gpu_for_device(device_name) == entry, (
        f"{device_name!r} must predict with {entry!r}: a wrong entry would calibrate against another GPU's datasheet")


def test_on_the_cpu_the_whole_path_runs_and_writes_what_it_printed(tmp_path, capsys):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    code = step_time_gpu.main(["--device", "cpu", "--config", str(config), "--dtype", "fp32", "--gpu", "H200",
                               "--rounds", "1", "--decode-batches", "1", "3", "--contexts", "20", "--prefills", "8",
                               "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "step_time_gpu.json").read_text())
    assert [(r["kind"], r["num_seqs"], r["tokens"]) for r in result["rows"]] == [
        ("decode", 1, 1), ("decode", 3, 3), ("prefill", 1, 8)]
    spec = ModelSpec.from_config(TINY, dtype="float32")
    for row in result["rows"]:
        assert row["measured_ms"] > 0
        steps = ({"decodes": [row["context"] + 1] * row["num_seqs"]} if row["kind"] == "decode"
                 else {"prefills": [(row["new_tokens"], row["context"])]})
        expected = step_time(spec, "H200", step_overhead_s=0.0, **steps).total_s * 1e3
        assert row["predicted_ms"] == pytest.approx(expected), "the prediction leaves out only the fixed per-step cost"
        assert row["measured_over_predicted"] == pytest.approx(row["measured_ms"] / row["predicted_ms"])
    assert set(result["summary"]) == {"decode", "prefill", "batch1_decode_unexplained_ms"}
    assert "measured / predicted median" in capsys.readouterr().out


def test_without_cuda_it_says_so_and_exits_0(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert step_time_gpu.main([]) == 0
    assert "no CUDA GPU here" in capsys.readouterr().out


def test_cases_whose_pool_does_not_fit_are_left_out_and_named():
    small, big = PassCase("decode", 1, 1, 100), PassCase("decode", 64, 1, 4000)
    per_token = 1000
    kept, dropped = step_time_gpu.cases_that_fit([small, big], per_token, free_bytes=10_000_000)
    assert kept == [small] and dropped == [big], "64 x 4,001 tokens x 1,000 B is 256 MB, past 80% of 10 MB"
    assert step_time_gpu.cases_that_fit([small, big], per_token, None) == ([small, big], [])
