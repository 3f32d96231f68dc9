"""benchmarks/figure12_gpu.py at a reduced grid: Figure 12's search on the simulated A100 runs end to end in seconds."""

import json

from test_serving_benchmarks import load


def test_figure12_searches_each_knee_and_reports_the_ratios(tmp_path):
    figure12 = load("figure12_gpu")
    out = tmp_path / "figure12.json"
    report = figure12.main(["--requests", "60", "--coarse", "0.5", "2", "8", "--refine", "1", "--min-rate", "0.125",
                            "--seeds", "0", "1", "--systems", "paged", "orca-max", "static", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report)), "the report is saved as printed"
    curves, bound = report["curves_s_per_token"], report["bound_s_per_token"]
    assert bound == 2 * curves["paged"]["0.5"], "the bound is 2x paged's normalized latency at the lowest rate"
    for seed, by_system in report["curves_by_seed"].items():
        assert {s: set(c) for s, c in by_system.items()} == {s: set(c) for s, c in curves.items()}, (
            f"seed {seed}: every seed runs a system at the same rates, so the median curve has one point per rate")
    max_rates = sorted(float(r) for r in curves["orca-max"])
    assert max_rates == [0.5, 1.25, 2.0], (
        "Orca(Max) is within the bound at 0.5 req/s and above it at 2: one bisection adds the midpoint, and the "
        f"search runs nothing past the knee; it ran {max_rates}")
    assert curves["static"]["0.5"] > bound and min(float(r) for r in curves["static"]) < 0.5, (
        "static batching is above the bound at the lowest coarse rate, so the search goes down by halves")
    crossing, ratio = report["crossing_rate"], report["ratios"]["orca-max"]["crossing_median_curves"]
    assert crossing["paged"] > crossing["orca-max"] > 0 and ratio > 1, (
        "paging fits more requests in the same memory than reserving max_model_len each, so it sustains more")
    again = figure12.main(["--from-json", str(out), "--json", str(tmp_path / "again.json")])
    assert again["crossing_rate"] == crossing, "--from-json summarises a saved sweep to the same figures"


def test_on_a_buddy_arena_orca_oracle_sustains_less_than_on_the_pools_blocks(tmp_path):
    figure12 = load("figure12_gpu")
    args = ["--requests", "120", "--coarse", "1", "2", "4", "--refine", "1", "--seeds", "0",
            "--systems", "paged", "orca-oracle"]
    pool = figure12.main([*args, "--json", str(tmp_path / "pool.json")])
    buddy = figure12.main([*args, "--arena", "buddy", "--json", str(tmp_path / "buddy.json")])
    assert (pool["arena"], buddy["arena"]) == ("pool", "buddy"), "the saved report says where reservations lived"
    assert buddy["curves_s_per_token"]["paged"] == pool["curves_s_per_token"]["paged"], \
        "paging reserves nothing: the arena changes none of its runs"
    assert buddy["crossing_rate"]["orca-oracle"] < pool["crossing_rate"]["orca-oracle"], (
        "a buddy allocator rounds each reservation up to a power of two and aligns it: fewer requests fit, "
        "so Orca(Oracle) crosses the bound at a lower rate")
