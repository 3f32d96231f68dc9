"""benchmarks/spec_decode.py runs end to end on a tiny setting: every path, the table, the targets and the JSON."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_runs_and_reports(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("spec_decode_benchmark", ROOT / "benchmarks" / "spec_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "NEW_TOKENS", 12)
    monkeypatch.setattr(bench, "LOOP_TOKENS", 30)
    out = tmp_path / "spec.json"
    bench.main(["--max-k", "2", "--batches", "1", "--repeats", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "targets, n-gram on the repetitive trace at batch 1" in printed
    assert "greedy outputs differing from the runs without speculation: 0" in printed, \
        "greedy speculation changed an output"
    report = json.loads(out.read_text())
    methods = {(r["method"], r["k"]) for r in report["kvlab"]}
    assert {("none", 0), ("ngram", 1), ("ngram", 2), ("draft_model", 2), ("draft alone", 0)} <= methods
    assert all(r["tokens_per_s"] > 0 for r in report["kvlab"])
    assert set(report["transformers_batch1"]) == {"generate", "prompt lookup k=1", "prompt lookup k=2",
                                                  "assistant (draft model)"}
