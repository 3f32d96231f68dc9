"""The chunked-prefill trade-off measured: time to first token against inter-token latency, by token budget.

SARATHI (Agrawal et al. 2023) splits long prompts into chunks that share steps with running decodes;
vLLM V1 always does, with max_num_batched_tokens as the step's budget. A small budget keeps every step
short, so the decodes' inter-token latency (ITL) stays low, but a long prompt needs more steps before
its first token (TTFT); a budget as large as the whole prompt prefills it in one step and stalls every
decode sharing that step. Workload: --decodes short prompts generating --decode-tokens tokens each,
and among them --long long prompts (--long-len tokens from the shipped text) asking for 8 tokens, all
arriving as one Poisson process at --rate per second; greedy; the same engine and KV memory for every
budget; the virtual clock of kvlab.benchmarks.replay (each step's measured CPU time). Reported per budget:
TTFT of the long prompts (mean, p99), ITL of the decodes (median, p99), steps. About a minute::

    OMP_NUM_THREADS=1 python benchmarks/chunked_prefill.py [--budgets 32 64 128 256] [--rate 200]
        [--json benchmarks/saved/chunked_prefill.json]   (the saved run Chapter 9 plots)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab


def workload(tokenizer, decodes: int, decode_tokens: int, long: int, long_len: int, seed: int):
    from kvlab.paths import ASSETS_DIR

    text = (ASSETS_DIR / "text" / "shakespeare.txt").read_text(encoding="utf-8")
    rng = random.Random(seed)
    kinds = ["decode"] * decodes + ["long"] * long
    rng.shuffle(kinds)
    kinds[0] = "decode"  # decodes are running when the first long prompt comes
    prompts, lens = [], []
    for kind in kinds:
        start = rng.randrange(len(text) - long_len)
        if kind == "long":
            prompts.append(tokenizer(text[start:start + long_len])["input_ids"][:long_len])
            lens.append(8)
        else:
            prompts.append(tokenizer(text[start:start + 8])["input_ids"])
            lens.append(decode_tokens)
    return prompts, lens, kinds


def main(argv=None) -> dict:
    from tqdm.std import tqdm

    from kvlab import load_model
    from kvlab.benchmarks.latency import percentile
    from kvlab.benchmarks.replay import replay
    from kvlab.engine.llm_engine import LLMEngine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--decodes", type=int, default=24)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--long", type=int, default=8)
    parser.add_argument("--long-len", type=int, default=224)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "saved" / "chunked_prefill.json")
    args = parser.parse_args(argv)

    model, tokenizer = load_model()
    prompts, lens, kinds = workload(tokenizer, args.decodes, args.decode_tokens, args.long, args.long_len, args.seed)
    rows = []
    for budget in tqdm(args.budgets, desc="budgets", file=sys.stdout):
        timings = replay(lambda b=budget: LLMEngine(model, tokenizer, block_size=16, num_blocks=256, max_num_seqs=64,
                                                    max_num_batched_tokens=b), prompts, lens, args.rate, args.seed)
        ttft = [t.ttft for t, k in zip(timings, kinds) if k == "long"]
        itl = [x for t, k in zip(timings, kinds) if k == "decode" for x in t.itls]
        rows.append({"max_num_batched_tokens": budget, "ttft_long_mean_ms": statistics.fmean(ttft) * 1e3,
                     "ttft_long_p99_ms": percentile(ttft, 0.99) * 1e3,
                     "itl_decode_median_ms": statistics.median(itl) * 1e3,
                     "itl_decode_p99_ms": percentile(itl, 0.99) * 1e3})
    print(f"\n{args.decodes} decodes of {args.decode_tokens} tokens and {args.long} prompts of {args.long_len} tokens "
          f"at {args.rate:g} req/s (virtual clock of measured steps)")
    print(f"{'budget':>7} {'TTFT long mean':>15} {'TTFT long p99':>14} {'ITL median':>11} {'ITL p99':>9}")
    for r in rows:
        print(f"{r['max_num_batched_tokens']:>7} {r['ttft_long_mean_ms']:13.1f}ms {r['ttft_long_p99_ms']:12.1f}ms "
              f"{r['itl_decode_median_ms']:9.2f}ms {r['itl_decode_p99_ms']:7.2f}ms")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": rows, **{k: v for k, v in vars(args).items() if k != "json"}},
                                    indent=1) + "\n")
    print(f"wrote {args.json}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
