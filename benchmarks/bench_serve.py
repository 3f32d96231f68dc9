"""A load generator like `vllm bench serve`: the shipped chat trace, Poisson arrivals, any OpenAI-compatible server.

Requests come from assets/traces/chat.csv (ShareGPT-like lengths), scaled so that 95 % of them fit the
served model's context (read from GET /v1/models' max_model_len, or --max-context), with prompts cut
from the shipped text by a tokenizer (--tokenizer: a hub id or folder; default the course's embedded
model, one token per character). They arrive as a Poisson process at --request-rate per second
(inf: all at once), each a streaming POST /v1/completions with max_tokens = its output length,
temperature 0 and ignore_eos (vLLM's extension; --no-ignore-eos for servers without it); with
--endpoint /v1/chat/completions each is a chat request whose one user message holds the prompt as a
list of text parts, the shape `vllm bench serve --backend openai-chat` sends. Measured per request on
the client's clock, as vllm bench serve measures (vllm/benchmarks/lib/endpoint_request_func.py):

  TTFT  from the moment the request is sent (not the moment the Poisson schedule meant it to leave) to
        the first chunk that carries a choice
  ITL   between chunks that carry choices; TPOT (end - first chunk) / (tokens - 1); E2E from sent to end
  send lag  sent - scheduled: how late the client itself was; large values mean the client, not the
        server, was the bottleneck, and TTFT then hides that wait (vLLM reports it as client queue time)

Reported: request throughput, output tokens/s, mean / median / p99 of each latency, and goodput
(requests per second that met every SLO given). It speaks plain OpenAI HTTP, so the same command
measures a real `vllm serve`:

    kvlab serve --port 8000 &                           # or: vllm serve Qwen/Qwen2.5-0.5B-Instruct
    python benchmarks/bench_serve.py --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 8 \\
        --slo-ttft-ms 500 --slo-tpot-ms 50 --json benchmarks/results/bench_serve.json
    # a vLLM server on a GPU machine: add --tokenizer Qwen/Qwen2.5-0.5B-Instruct (its tokenizer cuts the prompts)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab
CHAT_TEMPLATE_ROOM = 32  # tokens a chat template may add (the embedded model's adds "USER.\n...ASSISTANT.\n": 20)


@dataclass
class RequestResult:
    """One request as the client saw it (seconds on the client's monotonic clock)."""

    prompt_len: int
    output_len: int
    scheduled: float = 0.0  # when the Poisson schedule meant the request to leave
    sent: float = 0.0       # when it left: TTFT and E2E start here, as vllm bench serve's do
    first_token: float | None = None
    chunks: list[float] = field(default_factory=list)
    done: float | None = None
    completion_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done is not None and self.first_token is not None

    @property
    def ttft(self) -> float:
        return self.first_token - self.sent

    @property
    def send_lag(self) -> float:
        return self.sent - self.scheduled

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def tpot(self) -> float | None:
        n = self.completion_tokens or len(self.chunks)
        return (self.done - self.first_token) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


def build_requests(num_prompts: int, max_context: int, tokenizer_name: str | None, seed: int):
    """(prompt text, prompt tokens, output tokens) per request, from the shipped trace and text."""
    from transformers import AutoTokenizer

    from kvlab.analysis.traces import load_trace
    from kvlab.benchmarks.datasets import prompts_from_text, scale_to_context
    from kvlab.paths import ASSETS_DIR, DEFAULT_MODEL_DIR

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name or str(DEFAULT_MODEL_DIR))
    trace = load_trace(ASSETS_DIR / "traces" / "chat.csv")
    rng = random.Random(seed)
    picked = [trace[rng.randrange(len(trace))] for _ in range(num_prompts)]
    fitted = scale_to_context(picked, max_context)
    text = (ASSETS_DIR / "text" / "shakespeare.txt").read_text(encoding="utf-8")
    ids = prompts_from_text(fitted, text, lambda s: tokenizer(s, verbose=False)["input_ids"])
    return [(tokenizer.decode(p), len(p), r.output_len) for p, r in zip(ids, fitted)]


async def send(http, url: str, model: str, prompt: str, result: RequestResult, ignore_eos: bool) -> None:
    """One streaming request, timed as vllm bench serve times it: from just before it is sent, per chunk."""
    if url.endswith("/chat/completions"):
        body = {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
                "max_completion_tokens": result.output_len}
    else:
        body = {"model": model, "prompt": prompt, "max_tokens": result.output_len}
    body.update(temperature=0, stream=True, stream_options={"include_usage": True})
    if ignore_eos:
        body["ignore_eos"] = True
    result.sent = time.perf_counter()
    try:
        async with http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("choices"):  # a chunk with a choice is a token's arrival, even with empty text
                    now = time.perf_counter()
                    result.first_token = result.first_token or now
                    result.chunks.append(now)
                elif event.get("usage"):
                    result.completion_tokens = event["usage"]["completion_tokens"]
                elif event.get("error"):
                    result.error = str(event["error"].get("message"))[:200]
                    return
        result.done = result.chunks[-1] if result.chunks else time.perf_counter()
    except Exception as err:  # a refused or broken connection is reported, not fatal for the run
        result.error = repr(err)


def summarize(results: list[RequestResult], duration: float, slo: dict) -> dict:
    ok = [r for r in results if r.ok]

    def stats(values):
        values = sorted(v * 1e3 for v in values if v is not None)
        if not values:
            return {"mean": None, "median": None, "p99": None}
        p99 = values[min(len(values) - 1, int(round(0.99 * (len(values) - 1))))]
        return {"mean": statistics.fmean(values), "median": statistics.median(values), "p99": p99}

    out_tokens = sum(r.completion_tokens or len(r.chunks) for r in ok)

    from kvlab.benchmarks.latency import LatencyMetrics, meets_slos

    # vllm bench serve --goodput's metric names, in seconds
    slos = {name: slo[key] / 1e3 for key, name in (("ttft_ms", "ttft"), ("tpot_ms", "tpot"), ("e2e_ms", "e2el"))
            if slo.get(key) is not None}

    def meets(r):
        return meets_slos(LatencyMetrics(r.ttft, r.tpot, (), r.e2e), slos)

    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_len for r in ok)) / duration,
        "ttft_ms": stats(r.ttft for r in ok), "tpot_ms": stats(r.tpot for r in ok),
        "send_lag_ms": stats(r.send_lag for r in results if r.sent),
        "itl_ms": stats(x for r in ok for x in r.itls), "e2e_ms": stats(r.e2e for r in ok),
        "goodput": sum(meets(r) for r in ok) / duration if slo else None, "slo": slo,
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


async def run(args) -> dict:
    import httpx
    from tqdm.std import tqdm

    base = args.base_url.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout)) as http:
        models = (await http.get(base + "/v1/models")).json()["data"]
        model = args.model or models[0]["id"]
        max_context = args.max_context or models[0].get("max_model_len") or 2048
        # A chat request's template adds tokens around the prompt; leave them room (CHAT_TEMPLATE_ROOM).
        room = CHAT_TEMPLATE_ROOM if args.endpoint.endswith("/chat/completions") else 0
        requests = build_requests(args.num_prompts, max_context - room, args.tokenizer, args.seed)
        rng = random.Random(args.seed)
        results = [RequestResult(p_len, o_len) for _, p_len, o_len in requests]
        bar = tqdm(total=len(requests), desc=f"rate {args.request_rate}/s", unit="req", file=sys.stdout,
                   mininterval=0.5)

        async def one(i, delay):
            results[i].scheduled = start + delay
            await asyncio.sleep(max(0.0, results[i].scheduled - time.perf_counter()))
            await send(http, base + args.endpoint, model, requests[i][0], results[i], not args.no_ignore_eos)
            bar.update(1)

        delays, t = [], 0.0
        for _ in requests:
            delays.append(t)
            if args.request_rate != float("inf"):
                t += rng.expovariate(args.request_rate)
        start = time.perf_counter()
        await asyncio.gather(*(one(i, d) for i, d in enumerate(delays)))
        duration = time.perf_counter() - start
        bar.close()
    slo = {k: v for k, v in (("ttft_ms", args.slo_ttft_ms), ("tpot_ms", args.slo_tpot_ms),
                             ("e2e_ms", args.slo_e2e_ms)) if v is not None}
    report = summarize(results, duration, slo)
    report.update(base_url=base, model=model, request_rate=args.request_rate, num_prompts=args.num_prompts,
                  max_context=max_context, seed=args.seed)
    if args.save_requests:
        report["requests"] = [asdict(r) for r in results]
    return report


def print_report(report: dict) -> None:
    print(f"\n{report['model']} at {report['base_url']}: {report['completed']} requests done, "
          f"{report['failed']} failed, rate {report['request_rate']}/s, {report['duration_s']:.1f} s")
    print(f"request throughput {report['request_throughput']:.2f} req/s, output {report['output_token_throughput']:.0f}"
          f" tok/s, total {report['total_token_throughput']:.0f} tok/s")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "send_lag_ms"):
        s = report[key]
        if s["mean"] is not None:
            print(f"  {key[:-3].upper().replace('_', ' '):<9} mean {s['mean']:8.1f} ms  median {s['median']:8.1f} ms"
                  f"  p99 {s['p99']:8.1f} ms")
    print("  (TTFT and E2E from when each request was sent, as vllm bench serve measures them; SEND LAG is how "
          "late the client sent it against its Poisson schedule)")
    if report["goodput"] is not None:
        print(f"goodput {report['goodput']:.2f} req/s under {report['slo']}")
    for err in report["errors"]:
        print("error:", err)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="the model name to send (default: the server's first)")
    parser.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"],
                        help="chat sends the prompt as one user message of text parts, as vllm bench serve does")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (Poisson)")
    parser.add_argument("--max-context", type=int, default=None, help="default: the server's max_model_len")
    parser.add_argument("--tokenizer", default=None, help="cuts the prompts (default: the embedded model's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-tpot-ms", type=float, default=None)
    parser.add_argument("--slo-e2e-ms", type=float, default=None)
    parser.add_argument("--no-ignore-eos", action="store_true", help="for servers without vLLM's ignore_eos")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--save-requests", action="store_true", help="keep every request's timestamps in the JSON")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.num_prompts < 1 or args.request_rate <= 0:
        parser.error("--num-prompts must be >= 1 and --request-rate > 0")
    report = asyncio.run(run(args))
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
