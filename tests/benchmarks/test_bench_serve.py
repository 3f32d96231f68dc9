"""benchmarks/bench_serve.py against a live kvlab server: Poisson arrivals over HTTP, latencies and goodput reported."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from entrypoints.serving_helpers import serve_embedded

ROOT = Path(__file__).resolve().parents[2]
served = pytest.fixture(scope="module")(serve_embedded)


def load():
    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "benchmarks" / "bench_serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_the_load_generator_measures_a_server(served, tmp_path):
    bench = load()
    out = tmp_path / "bench.json"
    report = bench.main(["--base-url", served[0], "--num-prompts", "12", "--request-rate", "40", "--seed", "3",
                         "--slo-ttft-ms", "100000", "--slo-tpot-ms", "100000", "--json", str(out),
                         "--save-requests"])
    assert report["completed"] == 12 and report["failed"] == 0, report["errors"]
    assert report["max_context"] == 256, "the context comes from the server's /v1/models"
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = report[key]
        assert 0 < s["median"] <= s["p99"] and s["mean"] > 0, (key, s)
    assert report["ttft_ms"]["median"] <= report["e2e_ms"]["median"]
    assert report["goodput"] == report["request_throughput"], "generous SLOs: every request meets them"
    requests = json.loads(out.read_text())["requests"]
    assert all(r["completion_tokens"] == r["output_len"] for r in requests), "each request ran to its length"
    assert sorted(r["sent"] for r in requests) != [requests[0]["sent"]] * 12, "Poisson arrivals are spread out"


def test_unmet_slos_lower_the_goodput(served):
    report = load().main(["--base-url", served[0], "--num-prompts", "6", "--seed", "1", "--slo-ttft-ms", "0.001"])
    assert report["completed"] == 6 and report["goodput"] == 0.0
