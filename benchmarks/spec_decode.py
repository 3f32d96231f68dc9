"""Speculative decoding's benchmark: kvlab's engine with and without speculation, beside transformers' own.

One run, every figure side by side, on the embedded model on this CPU. Two traces:

  repetitive   greedy continuations of text that already repeats itself: a character's name plus the
               model's own first 120 greedy tokens, which fall into a loop ("of the sea-hood of the
               sea-"), as greedy decoding of small models does; the continuation repeats its context,
               as when an answer quotes its prompt (the course's model is too small to copy a
               repeated passage of the plays, which a large model would)
  open-ended   sampled continuations (temperature 0.8, seeded) of short prompts (a character's name)

For each trace, at batch sizes 1, 4 and 16 (that many requests running at once, max_num_seqs = batch;
max(4, batch) requests in all), kvlab runs without speculation, with the n-gram proposer
(prompt_lookup_min 2, prompt_lookup_max 4: on a character-level model a 1-character match almost
always exists and proposes noise) and with the embedded draft model, for k = 1..6
(num_speculative_tokens). Reported per run: generated tokens per second, target forward passes
per generated token, vLLM's mean acceptance length (1 + accepted / drafts) and acceptance rate, the
speed-up over no speculation, and the ideal speed-up that mean acceptance length allows once the
proposer's cost is counted (ideal_speedup in kvlab.analysis.spec_decode: length / (1 + c k), where c is
one draft-model pass over one target pass, measured here by running the draft model alone on the same
trace; c = 0 for n-grams). Efficiency = speed-up / ideal. At batch 1 on the repetitive trace,
transformers' own assisted generation (generate(prompt_lookup_num_tokens=k) and
generate(assistant_model=draft)) runs beside kvlab, against transformers' plain greedy generate.

Each configuration runs REPEATS times and the median is reported (spread in the JSON). Run from the
repository root (about 10 minutes on a 2-core CPU)::

    OMP_NUM_THREADS=1 python benchmarks/spec_decode.py [--max-k 6] [--batches 1 4 16] [--repeats 3]
        [--json benchmarks/results/spec_decode.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

NEW_TOKENS = 96
BLOCK_SIZE = 16


LOOP_TOKENS = 120
_loops: dict[int, list[int]] = {}


def names_in_text() -> list[str]:
    from kvlab.paths import ASSETS_DIR

    text = (ASSETS_DIR / "text" / "shakespeare.txt").read_text(encoding="utf-8")
    return sorted({s.split("\n")[0] for s in text.split("\n\n") if s.split("\n")[0].isupper()
                   and 3 <= len(s.split("\n")[0]) <= 14})


def traces(model, tokenizer, count: int) -> dict:
    """Prompts (token ids) and sampling params per trace, `count` requests each."""
    from kvlab import SamplingParams
    from kvlab.baselines.transformers_generate import reference_generate

    names = names_in_text()
    starts = [tokenizer(names[(5 * i) % len(names)] + "\n")["input_ids"] for i in range(count)]
    for i, ids in enumerate(starts):
        if i not in _loops:  # the model's own greedy text, computed once per prompt
            _loops[i] = ids + reference_generate(model, ids, LOOP_TOKENS)
    repetitive = [_loops[i] for i in range(count)]
    open_ended = starts
    greedy = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)] * count
    sampled = [SamplingParams(temperature=0.8, max_tokens=NEW_TOKENS, ignore_eos=True, seed=i) for i in range(count)]
    return {"repetitive": (repetitive, greedy), "open-ended": (open_ended, sampled)}


def run_kvlab(model, tokenizer, prompts, params, batch: int, spec: dict | None) -> dict:
    """One engine run: wall time, tokens, target (and draft) forward passes, acceptance."""
    from kvlab import LLM

    llm = LLM(model, tokenizer, block_size=BLOCK_SIZE, num_blocks=batch * 24, max_num_seqs=batch,
              max_num_batched_tokens=1024, speculative_config=spec)
    llm.generate(prompts[:1], params[:1])  # warm-up: first-call costs are not the method's
    engine = llm.llm_engine
    passes_before = engine.model_runner.num_forward_passes
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = engine.spec_stats
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "target_passes_per_token": (engine.model_runner.num_forward_passes - passes_before) / tokens,
            "mean_acceptance_length": stats.mean_acceptance_length if stats else 1.0,
            "acceptance_rate": stats.acceptance_rate if stats else 0.0,
            "outputs": [o.outputs[0].token_ids for o in outputs]}


def run_hf(model, prompts, **extra) -> dict:
    """transformers' generate at batch 1, one prompt after another (assisted generation needs batch 1)."""
    from kvlab.baselines.transformers_generate import reference_generate, reference_speculative_generate

    def one(ids):
        if extra:
            return reference_speculative_generate(model, ids, NEW_TOKENS, **extra)
        return reference_generate(model, ids, NEW_TOKENS)

    one(prompts[0])  # warm-up
    start = time.perf_counter()
    outs = [one(ids) for ids in prompts]
    wall = time.perf_counter() - start
    tokens = sum(map(len, outs))
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "outputs": outs}


def pass_costs(model, query_lens=(1, 2, 3, 4, 5, 7), context: int = 200, rounds: int = 31) -> dict:
    """Seconds of one target pass carrying q new tokens (one sequence, `context` cached): what verifying costs.

    Measured by kvlab.benchmarks.step_cost (the course's one account of a step's cost), median of `rounds`.
    """
    from kvlab.benchmarks.step_cost import PassCase, measure_passes

    cases = {q: PassCase("verify", 1, q, context) for q in query_lens}
    times = measure_passes(model, list(cases.values()), rounds=rounds)
    return {q: statistics.median(times[case]) for q, case in cases.items()}


def median_of(runs: list[dict]) -> dict:
    out = dict(runs[0])
    out["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in runs)
    out["tokens_per_s_runs"] = [round(r["tokens_per_s"], 1) for r in runs]
    out.pop("outputs")
    return out


def main(argv=None) -> None:
    from tqdm.std import tqdm

    from kvlab import load_model
    from kvlab.analysis.spec_decode import ideal_speedup
    from kvlab.paths import DEFAULT_DRAFT_MODEL_DIR

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-k", type=int, default=6)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "spec_decode.json")
    args = parser.parse_args(argv)

    import torch
    torch.manual_seed(0)
    model, tokenizer = load_model()
    draft, _ = load_model(DEFAULT_DRAFT_MODEL_DIR)
    ks = list(range(1, args.max_k + 1))
    configs = [(trace, batch, method, k) for trace in ("repetitive", "open-ended") for batch in args.batches
               for method, kk in [("none", [0]), ("draft alone", [0]), ("ngram", ks), ("draft_model", ks)]
               for k in kk]
    results, base, mismatches = [], {}, 0
    bar = tqdm(total=len(configs) * args.repeats + 2 + len(ks), desc="runs", unit="run",
               file=sys.stdout, mininterval=1.0)
    for trace, batch, method, k in configs:
        prompts, params = traces(model, tokenizer, max(4, batch))[trace]
        spec = None
        if method == "ngram":
            spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        elif method == "draft_model":
            spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
        runs = []
        for _ in range(args.repeats):
            runs.append(run_kvlab(draft if method == "draft alone" else model, tokenizer, prompts, params, batch,
                                  spec))
            bar.update(1)
        row = median_of(runs)
        row.update(trace=trace, batch=batch, method=method, k=k)
        key = (trace, batch)
        if method == "none":
            base[key] = (row, runs[0]["outputs"])
        elif method != "draft alone" and trace == "repetitive":
            mismatches += sum(a != b for a, b in zip(runs[0]["outputs"], base[key][1]))  # greedy must be identical
        results.append(row)

    by = {(r["trace"], r["batch"], r["method"], r["k"]): r for r in results}
    for r in results:
        plain = by[(r["trace"], r["batch"], "none", 0)]
        r["speedup"] = r["tokens_per_s"] / plain["tokens_per_s"]
        if r["method"] in ("ngram", "draft_model"):
            cost = 0.0
            if r["method"] == "draft_model":
                cost = plain["tokens_per_s"] / by[(r["trace"], r["batch"], "draft alone", 0)]["tokens_per_s"]
            r["draft_cost"] = cost
            r["ideal_speedup"] = ideal_speedup(r["mean_acceptance_length"], r["k"], cost)
            r["efficiency"] = r["speedup"] / r["ideal_speedup"]

    # transformers at batch 1 on the repetitive trace, beside kvlab's batch-1 figures.
    prompts = traces(model, tokenizer, 4)["repetitive"][0]  # four prompts, one at a time
    costs = pass_costs(model)
    hf = {"generate": run_hf(model, prompts)}
    bar.update(1)
    for k in ks:
        hf[f"prompt lookup k={k}"] = run_hf(model, prompts, prompt_lookup_num_tokens=k)
        bar.update(1)
    hf["assistant (draft model)"] = run_hf(model, prompts, assistant_model=draft)
    bar.update(1)
    bar.close()
    for name, r in hf.items():
        if name != "generate":
            mismatches += sum(a != b for a, b in zip(r["outputs"], hf["generate"]["outputs"]))
    for r in hf.values():
        r.pop("outputs")

    print(f"\nkvlab engine, embedded model ({NEW_TOKENS} new tokens per request, median of {args.repeats} runs)")
    print(f"{'trace':<11} {'batch':>5} {'method':<12} {'k':>2} {'tok/s':>8} {'passes/tok':>10} {'accept len':>10} "
          f"{'accept %':>8} {'speed-up':>8} {'ideal':>6} {'effic.':>6}")
    for r in results:
        if r["method"] == "draft alone":
            continue
        ideal = f"{r['ideal_speedup']:6.2f} {r['efficiency']:6.0%}" if "ideal_speedup" in r else f"{'':>6} {'':>6}"
        print(f"{r['trace']:<11} {r['batch']:>5} {r['method']:<12} {r['k']:>2} {r['tokens_per_s']:8.0f} "
              f"{r['target_passes_per_token']:10.3f} {r['mean_acceptance_length']:10.2f} {r['acceptance_rate']:8.0%} "
              f"{r['speedup']:7.2f}x {ideal}")
    print("\ndraft model alone (for the cost ratio c = one draft pass / one target pass):")
    for r in results:
        if r["method"] == "draft alone":
            plain = by[(r["trace"], r["batch"], "none", 0)]
            print(f"  {r['trace']:<11} batch {r['batch']:>2}: {r['tokens_per_s']:7.0f} tok/s, "
                  f"c = {plain['tokens_per_s'] / r['tokens_per_s']:.2f}")
    print("\ntransformers at batch 1, repetitive trace (4 prompts one after another):")
    for name, r in hf.items():
        ratio = r["tokens_per_s"] / hf["generate"]["tokens_per_s"]
        print(f"  {name:<26} {r['tokens_per_s']:7.0f} tok/s  {ratio:5.2f}x")
    print("\none target forward pass carrying q new tokens (context 200), against q = 1: what verifying costs here")
    print("  " + "  ".join(f"q={q}: {c * 1e3:.2f} ms ({c / costs[1]:.2f}x)" for q, c in costs.items()))
    print("\ntargets, n-gram on the repetitive trace at batch 1 (speed-up >= 1.5x; >= 70% of the ideal that the mean "
          "acceptance length gives):")
    for r in results:
        if r["method"] == "ngram" and r["batch"] == 1 and r["trace"] == "repetitive":
            met = "both met" if r["speedup"] >= 1.5 and r["efficiency"] >= 0.7 else \
                "speed-up met" if r["speedup"] >= 1.5 else "not met"
            print(f"  k={r['k']}: {r['speedup']:.2f}x, {r['efficiency']:.0%} of {r['ideal_speedup']:.2f}x  ({met})")
    print(f"greedy outputs differing from the runs without speculation: {mismatches} (must be 0)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"kvlab": results, "transformers_batch1": hf, "new_tokens": NEW_TOKENS,
                                     "pass_cost_s": {str(q): c for q, c in costs.items()},
                                     "repeats": args.repeats, "mismatches": mismatches}, indent=1) + "\n")
    print(f"wrote {args.json.relative_to(ROOT) if args.json.is_relative_to(ROOT) else args.json}")


if __name__ == "__main__":
    main()
