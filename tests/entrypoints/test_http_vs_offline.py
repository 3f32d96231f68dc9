"""benchmarks/http_vs_offline.py on a few requests: a real `kvlab serve` process, the same greedy texts as
LLM.generate on every path, the figures reported side by side, and the server process stopped afterwards."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load():
    spec = importlib.util.spec_from_file_location("http_vs_offline", ROOT / "benchmarks" / "http_vs_offline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["http_vs_offline"] = module
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_compares_equal_work_and_stops_its_server(monkeypatch, tmp_path):
    bench = load()
    started = []
    real_start = bench.start_server

    def tracked(*args, **kwargs):
        started.append(real_start(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(bench, "start_server", tracked)
    report = bench.main(["--requests", "4", "--repeats", "1", "--max-num-seqs", "4", "--num-blocks", "64",
                         "--breakdown", "--json", str(tmp_path / "out.json")])
    # main() raises if any path's greedy texts differ from LLM.generate's, so reaching here means equal work.
    assert set(report["median_tok_per_s"]) == {"offline", "engine delta", "async (no http)", "http"}
    assert all(v > 0 for v in report["median_tok_per_s"].values())
    assert report["ratio_of_medians"] == report["median_tok_per_s"]["http"] / report["median_tok_per_s"]["offline"]
    runs = report["runs"]["http"]
    assert len(runs) == 1 and runs[0]["tokens"] == report["output_tokens"], "every requested token came back"
    assert started and all(proc.poll() is not None for proc in started), "the server process must be stopped"
    cpu = report["server_cpu_seconds"]
    assert set(cpu) == {"event loop", "engine and other threads"} and cpu["engine and other threads"] > 0, (
        "the server's CPU time is read per thread over the timed HTTP runs: the engine thread did the work")
    assert (tmp_path / "out.json").exists()
