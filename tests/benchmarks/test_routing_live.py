"""benchmarks/routing_live.py runs end to end on tiny settings: one replica and a policy over two, the same answers."""

import importlib.util
import json
import sys
from pathlib import Path

from kvlab.benchmarks.routing_workload import RequestRecord, RoutingRunResult

ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("routing_live", ROOT / "benchmarks" / "routing_live.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["routing_live"] = module
    spec.loader.exec_module(module)
    return module


def test_routing_live_measures_each_setup_and_compares_answers(tmp_path, capsys):
    out = tmp_path / "routing.json"
    status = load_script().main(["--policies", "kv-cost", "--replicas", "2", "--conversations", "4", "--turns", "2",
                                 "--rate", "100", "--think-time-s", "0", "--num-blocks", "32", "--json", str(out)])
    report = json.loads(out.read_text())
    assert status == 0 and report["answers_equal"] is True
    for setup, replicas in (("1 replica", 1), ("kv-cost", 2)):
        (run,) = report["rows"][setup]
        assert run["requests"] == 8 and len(run["replica_requests"]) == replicas
        assert sum(run["replica_requests"]) == 8, "the replicas' /metrics count every request once"
        assert run["prefix_cache_hits"] > 0 and run["ttft_p50_ms"] > 0
    printed = capsys.readouterr().out
    assert "| kv-cost |" in printed and "| 1 replica |" in printed and "answers equal" in printed


def test_a_different_answer_is_reported():
    module = load_script()

    def run(answer):
        return RoutingRunResult(requests=[RequestRecord(0, 0, answer="What is "), RequestRecord(0, 1, answer=answer)])

    equal, sentence = module.compare_answers({"round-robin": [run("Ay")], "kv-cost": [run("Ay"), run("Nay")]})
    assert not equal and "kv-cost run 2" in sentence and "conversation 0 turn 1" in sentence
    assert module.compare_answers({"round-robin": [run("Ay")], "kv-cost": [run("Ay")]})[0]
    stats = {"replicas": [{"url": "http://a:1", "routed": 3}, {"url": "http://b:2/", "routed": 5}]}
    after = {"replicas": [{"url": "http://b:2/", "routed": 5}, {"url": "http://a:1", "routed": 7}]}
    assert module.routed_counts(stats, after) == {"http://a:1": 4, "http://b:2": 0}
