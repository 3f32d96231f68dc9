"""benchmarks/disagg_run.py runs end to end on tiny settings: both set-ups measured, the bytes of a pull counted."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_disagg_run_measures_both_setups_and_the_bytes_of_a_pull(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("disagg_run", ROOT / "benchmarks" / "disagg_run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["disagg_run"] = module
    spec.loader.exec_module(module)
    out = tmp_path / "disagg.json"
    report = module.main(["--runs", "1", "--num-decoders", "1", "--decode-tokens", "6", "--num-long", "2",
                          "--long-len", "41", "--long-output", "3", "--long-gap-s", "0.05", "--warmup-s", "0.1",
                          "--num-blocks", "32", "--json", str(out)])
    for setup in ("colocated", "disaggregated"):
        medians = report["medians"][setup]
        assert medians["output_tok_s"] > 0 and medians["ttft_long_ms_p50"] > 0 and medians["itl_decode_ms_p99"] > 0
    moved = report["bytes"]
    per_token = moved["bytes_arithmetic"] // 41
    assert moved["prompt_tokens"] == 41 and moved["blocks"] == 3, "40 of the 41 tokens: 3 blocks of 16"
    assert moved["bytes_moved"] == 3 * 16 * per_token, "whole blocks, each block_size tokens of Chapter 1's bytes"
    assert json.loads(out.read_text())["medians"] == report["medians"]
    assert "P/D + proxy" in capsys.readouterr().out
