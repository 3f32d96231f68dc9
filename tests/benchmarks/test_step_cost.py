"""kvlab.benchmarks.step_cost: the cases it times, the line it fits, and benchmarks/step_cost.py end to end."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kvlab.benchmarks.step_cost import PassCase, fit_cost, fits, measure_passes, pass_cases, torch_threads

ROOT = Path(__file__).resolve().parents[2]


def test_a_pass_carries_its_sequences_new_tokens_and_reads_their_causal_context():
    decode = PassCase("decode", num_seqs=8, new_tokens=1, context=100)
    assert decode.tokens == 8
    assert decode.kv_reads == 8 * 101, "each decode query reads its 100 cached positions and its own"
    verify = PassCase("verify", num_seqs=1, new_tokens=4, context=10)
    assert verify.kv_reads == 11 + 12 + 13 + 14, "draft i reads the context, the drafts before it and itself"
    prefill = PassCase("prefill", num_seqs=1, new_tokens=5, context=0)
    assert prefill.kv_reads == 1 + 2 + 3 + 4 + 5


def test_the_cases_fit_the_model_context():
    cases = pass_cases(64, token_counts=(1, 8, 64), decode_contexts=(16, 63), verify_context=40)
    assert {c.kind for c in cases} == {"prefill", "decode", "verify"}
    assert all(c.context + c.new_tokens <= 64 for c in cases), "no position beyond the model's context"
    assert [c.tokens for c in cases if c.kind == "verify"] == [1, 8], "40 + 64 tokens would not fit"
    with pytest.raises(ValueError, match="no room"):
        pass_cases(64, decode_contexts=(64,))


def test_the_fit_recovers_a_known_line_and_plane():
    tokens = [1, 2, 4, 8, 16, 32]
    line = fit_cost(tokens, [0.004 + 0.0002 * t for t in tokens])
    assert line.a == pytest.approx(0.004) and line.b == pytest.approx(0.0002) and line.c == 0.0
    assert line.r2 == pytest.approx(1.0) and line.max_relative_residual < 1e-9
    assert line.break_even_tokens == pytest.approx(20.0), "a / b: the tokens that cost as much as the pass itself"
    reads = [t * 100 + 3 * t for t in tokens[:3]] + [t * 5 for t in tokens[3:]]
    plane = fit_cost(tokens, [0.004 + 0.0002 * t + 1e-7 * r for t, r in zip(tokens, reads)], reads)
    assert (plane.a, plane.b, plane.c) == pytest.approx((0.004, 0.0002, 1e-7))
    assert plane.predict(10, 1000) == pytest.approx(0.004 + 0.002 + 1e-4)


def test_the_fit_reports_a_bad_line():
    tokens = [1, 2, 4, 8, 16, 32]
    bent = fit_cost(tokens, [0.001 * t * t for t in tokens])
    assert bent.r2 < 0.95 and bent.max_relative_residual > 0.3, "a parabola is not a line, and R^2 says so"
    assert sum(bent.residuals) == pytest.approx(0.0, abs=1e-12), "least squares with an intercept: residuals sum to 0"


def test_the_fit_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="one time per point"):
        fit_cost([1, 2, 3], [0.1, 0.2])
    with pytest.raises(ValueError, match="token counts"):
        fit_cost([4, 4, 4], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="cannot fit"):
        fit_cost([1, 2, 3], [0.1, 0.2, 0.3], [1, 5, 9])


def test_measured_passes_get_slower_with_more_tokens_and_threads_come_back():
    from kvlab.model.loader import load_model

    model, _ = load_model()
    cases = [PassCase("prefill", 1, 1, 0), PassCase("prefill", 1, 128, 0), PassCase("decode", 32, 1, 200),
             PassCase("verify", 1, 5, 120)]
    before = torch.get_num_threads()
    rounds = []
    times = measure_passes(model, cases, rounds=3, progress=lambda r, n: rounds.append((r, n)))
    assert torch.get_num_threads() == before, "the measurement pins one thread only while it runs"
    assert rounds == [(1, 3), (2, 3), (3, 3)]
    assert all(len(ts) == 3 and min(ts) > 0 for ts in times.values())
    low = min(times[cases[0]])
    assert min(times[cases[1]]) > low, "128 prompt tokens cost more than one, whatever the machine's speed"
    with pytest.raises(ValueError, match="rounds"):
        measure_passes(model, cases, rounds=0)


def test_torch_threads_restores_the_count_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), torch_threads(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before


def test_fits_name_each_kind_and_the_whole():
    medians = {}
    for n in (1, 4, 16, 64):
        medians[PassCase("prefill", 1, n, 0)] = 0.004 + 0.0001 * n
        medians[PassCase("verify", 1, n, 100)] = 0.004 + 0.00011 * n
        for context in (16, 128):
            case = PassCase("decode", n, 1, context)
            medians[case] = 0.004 + 0.0001 * n + 1e-8 * case.kv_reads
    fitted = fits(medians)
    assert set(fitted) == {"prefill", "verify", "decode, context 16", "decode, context 128", "decode", "all"}
    assert fitted["decode"].c == pytest.approx(1e-8) and fitted["decode"].b == pytest.approx(0.0001)
    assert fitted["decode, context 128"].b > fitted["decode, context 16"].b, "a longer context costs more per decode"


def test_the_benchmark_prints_its_table_and_fits(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("step_cost_benchmark", ROOT / "benchmarks" / "step_cost.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import kvlab.benchmarks.step_cost as step_cost

    monkeypatch.setattr(step_cost, "TOKEN_COUNTS", (1, 4, 16))
    monkeypatch.setattr(step_cost, "DECODE_CONTEXTS", (16, 64))
    original = step_cost.pass_cases
    monkeypatch.setattr(step_cost, "pass_cases",
                        lambda max_len: original(max_len, (1, 4, 16), (16, 64)))
    out = tmp_path / "step_cost.json"
    report = bench.main(["--rounds", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "1 thread" in printed and "| prefill (1 sequence, from position 0) |" in printed
    assert "| all |" in printed and "R^2" in printed
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    assert {c["kind"] for c in saved["cases"]} == {"prefill", "decode", "verify"}
    assert all(len(c["runs_s"]) == 2 and c["median_s"] > 0 for c in saved["cases"])
    assert set(saved["fits"]) >= {"prefill", "decode", "all"}
