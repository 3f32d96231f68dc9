"""benchmarks/figure12.py and benchmarks/chunked_prefill.py run end to end on tiny settings and write their JSON."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_figure12_sweeps_every_system(tmp_path, capsys):
    out = tmp_path / "fig12.json"
    report = load("figure12").main(["--requests", "4", "--rates", "1000", "--num-blocks", "32",
                                    "--systems", "paged", "orca-max", "static", "--seeds", "0", "--json", str(out)])
    assert set(report["curves_s_per_token"]) == {"paged", "orca-max", "static"}
    assert all(v > 0 for curve in report["curves_s_per_token"].values() for v in curve.values())
    assert json.loads(out.read_text())["num_blocks"] == 32
    assert "paged / orca-max" in capsys.readouterr().out or report["sustained_rate"]["orca-max"] == 0


def test_figure12_reports_the_median_and_every_seed(tmp_path):
    """Each seed draws other arrivals; the curves are the median over the seeds, and every seed's run is kept."""
    out = tmp_path / "fig12.json"
    report = load("figure12").main(["--requests", "3", "--rates", "1000", "--num-blocks", "32",
                                    "--systems", "paged", "orca-max", "--seeds", "4", "5", "6", "--json", str(out)])
    assert report["seeds"] == [4, 5, 6] and set(report["curves_by_seed"]) == {"4", "5", "6"}
    for system in ("paged", "orca-max"):
        runs = sorted(report["curves_by_seed"][seed][system]["1000.0"] for seed in ("4", "5", "6"))
        assert report["curves_s_per_token"][system]["1000.0"] == runs[1], "the median of three runs is the middle one"
    assert set(report["sustained_by_seed"]) == {"4", "5", "6"}
    assert json.loads(out.read_text())["curves_by_seed"] == report["curves_by_seed"]


def test_figure12_interpolates_where_a_curve_crosses_the_bound(tmp_path):
    """Between the last rate within the bound and the first above it, the crossing is interpolated linearly;
    --from-json summarises a saved sweep again without measuring anything."""
    figure12 = load("figure12")
    assert figure12.crossing_rate({1.0: 1.0, 2.0: 1.5, 4.0: 3.0}, 2.0) == pytest.approx(2 + 2 * 0.5 / 1.5)
    assert figure12.crossing_rate({1.0: 3.0, 2.0: 4.0}, 2.0) == 0.0, "above the bound from the lowest rate on"
    assert figure12.crossing_rate({1.0: 1.0, 2.0: 1.5}, 2.0) == 2.0, "never above it: the highest rate"
    saved = {"requests": 3, "num_blocks": 8, "seconds": 1.0, "curves_by_seed": {
        "0": {"paged": {"1.0": 1.0, "2.0": 1.5, "4.0": 3.0}, "orca-max": {"1.0": 1.2, "2.0": 2.5, "4.0": 5.0}},
        "1": {"paged": {"1.0": 1.0, "2.0": 1.6, "4.0": 2.8}, "orca-max": {"1.0": 1.1, "2.0": 2.2, "4.0": 4.0}}}}
    (tmp_path / "in.json").write_text(json.dumps(saved))
    report = figure12.main(["--from-json", str(tmp_path / "in.json"), "--bound", "2",
                            "--json", str(tmp_path / "o.json")])
    assert report["curves_s_per_token"]["paged"]["2.0"] == pytest.approx(1.55), "the median of two runs is their mean"
    assert report["crossing_by_seed"]["0"]["paged"] == pytest.approx(2 + 2 * 0.5 / 1.5)
    assert report["crossing_by_seed"]["0"]["orca-max"] == pytest.approx(1 + 0.8 / 1.3)
    ratio = report["ratios"]["orca-max"]["crossing_per_seed"][0]
    assert ratio == pytest.approx((2 + 2 * 0.5 / 1.5) / (1 + 0.8 / 1.3))


def test_chunked_prefill_reports_each_budget(tmp_path):
    out = tmp_path / "chunk.json"
    report = load("chunked_prefill").main(["--budgets", "16", "64", "--decodes", "3", "--long", "1",
                                           "--decode-tokens", "6", "--long-len", "40", "--json", str(out)])
    rows = report["rows"]
    assert [r["max_num_batched_tokens"] for r in rows] == [16, 64]
    assert all(r["ttft_long_p99_ms"] >= r["ttft_long_mean_ms"] > 0 for r in rows)
    assert json.loads(out.read_text())["rows"] == rows


def test_serving_compares_systems_on_the_same_tokens(tmp_path, capsys):
    """benchmarks/serving.py: each system in its own process, alternated runs, the same greedy tokens everywhere;
    --baseline-tree measures another checkout (here this one) as a further system."""
    out = tmp_path / "serving.json"
    report = load("serving").main(["--model", "draft", "--workload", "mixed", "--requests", "6", "--repeats", "2",
                                   "--systems", "kvlab continuous", "kvlab static", "--baseline-tree", str(ROOT),
                                   "--json", str(out)])
    baseline = f"kvlab continuous @ {ROOT}"
    assert set(report) == {"kvlab continuous", "kvlab static", baseline}
    assert all(len(r["run_seconds"]) == 2 and r["tokens"] == report["kvlab continuous"]["tokens"]
               for r in report.values()), "every system runs the same requests once per round"
    assert report["kvlab static"]["outputs"] == report["kvlab continuous"]["outputs"] == report[baseline]["outputs"], (
        "greedy decoding gives the same tokens whichever engine batches the requests")
    printed = capsys.readouterr().out
    assert "6/6" in printed and "median of 2 alternated runs" in printed
    assert set(json.loads(out.read_text())) == set(report)


def test_profile_step_accounts_every_part(capsys):
    """benchmarks/profile_step.py profiles serving.py's kvlab run in a child process and splits its time by part."""
    (result,) = load("profile_step").main(["--model", "draft", "--workload", "mixed", "--top", "3"])
    assert set(result["parts"]) == set(load("profile_step").PARTS) and sum(result["parts"].values()) > 0
    assert result["parts"]["scheduler and KV"] > 0 and result["parts"]["torch ops"] > 0, (
        "the engine's own bookkeeping and torch's operators both show up in a real run")
    assert len(result["top"]) == 3 and "under cProfile" in capsys.readouterr().out
