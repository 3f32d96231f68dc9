"""What one step costs: the embedded model's forward pass against the tokens it carries, with a fitted line.

kvlab.benchmarks.step_cost times the engine's own pass (forward_batch on a PagedKVCache with the engine's
attention backend) for prefills of 1-256 tokens, decodes of 1-256 sequences at three contexts and a
speculative verify (one sequence, 1-128 new tokens after 120 cached), torch pinned to one thread, the median
of several rounds (every case once per round). It prints one table of milliseconds (rows: kind of pass,
columns: tokens carried), then the fits t = a + b*T per kind and t = a + b*T + c*R (R: cached K/V positions
the queries read) over the decodes and over every pass, with R^2 and the largest residual. Run from the
repository root (about 15 s)::

    OMP_NUM_THREADS=1 python benchmarks/step_cost.py [--rounds 9] [--json benchmarks/results/step_cost.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab


def row_label(kind: str, context: int) -> str:
    return {"prefill": "prefill (1 sequence, from position 0)",
            "decode": f"decode (T sequences, context {context})",
            "verify": f"verify (1 sequence, T new after {context})"}[kind]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9, help="times each case runs; the median is reported")
    parser.add_argument("--json", type=Path, default=None, help="also write every time and fit here")
    args = parser.parse_args(argv)

    import torch

    from kvlab.benchmarks.step_cost import TOKEN_COUNTS, fits, measure_passes
    from kvlab.model.loader import load_model

    model, _ = load_model(device="cpu")
    params = sum(p.numel() for p in model.parameters())
    print(f"embedded model: {params / 1e6:.1f} M parameters, {model.config.num_hidden_layers} layers, "
          f"torch {torch.__version__}, 1 thread (torch.set_num_threads(1)), median of {args.rounds} rounds")
    times = measure_passes(model, rounds=args.rounds, threads=1,
                           progress=lambda r, n: print(f"\r  round {r}/{n}", end="", flush=True))
    print()
    medians = {case: statistics.median(ts) for case, ts in times.items()}
    one_token = statistics.median([m for c, m in medians.items() if c.tokens == 1])

    rows: dict[tuple[str, int], dict[int, float]] = {}
    for case, seconds in medians.items():
        rows.setdefault((case.kind, case.context), {})[case.tokens] = seconds
    print("\nmilliseconds per forward pass, by tokens carried T (in brackets: against a one-token pass)")
    print("| pass | " + " | ".join(f"T={n}" for n in TOKEN_COUNTS) + " |")
    print("|---|" + "---:|" * len(TOKEN_COUNTS))
    for (kind, context), by_tokens in rows.items():
        cells = [f"{1e3 * by_tokens[n]:.2f} ({by_tokens[n] / one_token:.1f}x)" if n in by_tokens else ""
                 for n in TOKEN_COUNTS]
        print(f"| {row_label(kind, context)} | " + " | ".join(cells) + " |")

    fitted = fits(medians)
    print("\nfits (least squares over the medians): t = a + b*T (+ c*R, R = cached K/V positions read)")
    print("| fit over | a (ms per pass) | b (ms per token) | c (us per cached position read) | a / b (tokens) | R^2 "
          "| largest residual |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, f in fitted.items():
        print(f"| {name} | {1e3 * f.a:.2f} | {1e3 * f.b:.3f} | {1e6 * f.c:.2f} | {f.break_even_tokens:.0f} "
              f"| {f.r2:.3f} | {100 * f.max_relative_residual:.0f} % |")
    result = {
        "rounds": args.rounds, "threads": 1, "torch": torch.__version__,
        "cases": [{"kind": c.kind, "num_seqs": c.num_seqs, "new_tokens": c.new_tokens, "context": c.context,
                   "tokens": c.tokens, "kv_reads": c.kv_reads, "median_s": medians[c], "runs_s": times[c]}
                  for c in times],
        "fits": {name: {"a_s": f.a, "b_s_per_token": f.b, "c_s_per_kv_read": f.c, "r2": f.r2,
                        "max_relative_residual": f.max_relative_residual} for name, f in fitted.items()},
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"\nwritten to {args.json}")
    return result


if __name__ == "__main__":
    main()
