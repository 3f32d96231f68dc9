"""One colocated `kvlab serve` against a prefill/decode pair behind `kvlab proxy`, under long prompts arriving among
running decodes (DistServe's setting): TTFT and ITL percentiles, throughput, and the bytes each request moves.

    OMP_NUM_THREADS=1 python benchmarks/disagg_run.py                       # 3 runs each, medians side by side
    python benchmarks/disagg_run.py --runs 5 --num-blocks 128 --json benchmarks/results/disagg.json

The load, the same for both set-ups: --num-decoders short prompts that each decode --decode-tokens tokens start
first; while they run, --num-long long prompts (--long-len tokens, --long-output tokens each) arrive every
--long-gap-s seconds. Every request streams; TTFT and ITL are taken on the client's clock per chunk, as
`vllm bench serve` takes them (benchmarks/bench_serve.py, whose request code this reuses). Both set-ups serve
the embedded model ("default") with the same engine settings and the same --num-blocks each: the pair has
twice the KV pool in all.

Bytes per request: a prompt of --long-len tokens is pulled between two engines in this process over the same
SocketConnector, and the bytes that crossed the socket are set against Chapter 1's arithmetic
(kvlab.analysis.kv_size.kv_transfer_bytes): the connector moves whole blocks, all but the prompt's last token.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_serve import RequestResult, send  # noqa: E402 (the load generator's request code)


def percentile(values, q):
    values = sorted(values)
    if not values:
        return None
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


@functools.cache
def _text_ids(tokenizer_dir) -> tuple:
    from transformers import AutoTokenizer

    from kvlab.paths import ASSETS_DIR

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = (ASSETS_DIR / "text" / "shakespeare.txt").read_text(encoding="utf-8")
    return tokenizer, tokenizer(text, verbose=False)["input_ids"]


def prompts(tokenizer_dir, num: int, length: int, offset: int) -> list[str]:
    """num prompts of exactly length tokens (the embedded tokenizer is one token per character), each different."""
    tokenizer, ids = _text_ids(tokenizer_dir)
    step = max(length, 997)
    if offset + num * step > len(ids):
        raise ValueError(f"the shipped text holds {len(ids)} tokens, too few for {num} prompts from token {offset}")
    return [tokenizer.decode(ids[offset + i * step: offset + i * step + length]) for i in range(num)]


async def one_run(url: str, args, decoders: list[str], longs: list[str]) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        endpoint = url + "/v1/completions"
        dec = [RequestResult(len(p), args.decode_tokens) for p in decoders]
        lng = [RequestResult(len(p), args.long_output) for p in longs]
        start = time.perf_counter()
        tasks = [asyncio.create_task(send(http, endpoint, "default", p, r, True)) for p, r in zip(decoders, dec)]
        await asyncio.sleep(args.warmup_s)  # the decodes are running when the first long prompt arrives
        for i, (p, r) in enumerate(zip(longs, lng)):
            if i:
                await asyncio.sleep(args.long_gap_s)
            r.scheduled = time.perf_counter()
            tasks.append(asyncio.create_task(send(http, endpoint, "default", p, r, True)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    failed = [r.error for r in dec + lng if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    tokens = sum(r.completion_tokens or len(r.chunks) for r in dec + lng)
    out = {"output_tok_s": tokens / duration, "duration_s": duration}
    for name, values in (("ttft_long_ms", [r.ttft for r in lng]), ("itl_decode_ms", [x for r in dec for x in r.itls]),
                         ("itl_all_ms", [x for r in dec + lng for x in r.itls])):
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = percentile([v * 1e3 for v in values], q / 100)
    return out


def serve_colocated(serve_args, env):
    """One `kvlab serve` on a free port: (process, url)."""
    from kvlab.entrypoints.launch import free_port, healthy

    port = free_port()
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / "kvlab-colocated.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "kvlab.entrypoints.cli", "serve", "default", "--port", str(port),
                             "--served-model-name", "default", *serve_args], stdout=log, stderr=subprocess.STDOUT,
                            env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while not healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the colocated server did not start; see kvlab-colocated.log")
        time.sleep(0.1)
    return proc, url, log


def bytes_per_request(prompt_text: str, block_size: int) -> dict:
    """Pull one prompt between two in-process engines; the bytes that crossed the socket against Chapter 1's."""
    from kvlab import SamplingParams, load_model
    from kvlab.analysis.kv_size import kv_transfer_bytes
    from kvlab.engine.llm_engine import LLMEngine

    model, tokenizer = load_model("default")
    knobs = dict(block_size=block_size, num_blocks=64)
    producer = LLMEngine(model, tokenizer, kv_transfer_config={"kv_connector": "SocketConnector",
                                                               "kv_role": "kv_producer"}, **knobs)
    consumer = LLMEngine(model, tokenizer, kv_transfer_config={"kv_connector": "SocketConnector",
                                                               "kv_role": "kv_consumer"}, **knobs)
    try:
        prompt = tokenizer(prompt_text)["input_ids"]
        long_len = len(prompt)

        def params(n, kv):
            return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, extra_args={"kv_transfer_params": kv})

        producer.add_request("r", prompt, params(1, {"do_remote_decode": True}))
        kv = None
        while producer.has_unfinished_requests():
            for out in producer.step():
                kv = out.kv_transfer_params or kv
        consumer.add_request("r", prompt, params(2, kv))
        while any(e.has_unfinished_requests() or e.has_pending_kv_transfers() for e in (producer, consumer)):
            producer.step()
            consumer.step()
            time.sleep(0.001)
        sent = producer.model_runner.kv_connector.bytes_sent
        return {"prompt_tokens": long_len, "bytes_moved": sent, "bytes_arithmetic": kv_transfer_bytes(
            model.config, long_len, "float32"), "blocks": consumer.kv_connector.num_pulled_blocks,
            "block_size": block_size}
    finally:
        producer.shutdown()
        consumer.shutdown()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-decoders", type=int, default=6)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--num-long", type=int, default=12)
    parser.add_argument("--long-len", type=int, default=224)
    parser.add_argument("--long-output", type=int, default=16)
    parser.add_argument("--long-gap-s", type=float, default=0.15)
    parser.add_argument("--warmup-s", type=float, default=0.5)
    parser.add_argument("--num-blocks", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from kvlab.entrypoints.disagg import DisaggregatedServers
    from kvlab.paths import DEFAULT_MODEL_DIR

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    serve_args = ["--block-size", str(args.block_size), "--num-blocks", str(args.num_blocks), "--max-num-seqs", "16",
                  "--max-num-batched-tokens", "256"]
    # Each run gets prompts of its own, so no run finds the last one's in a prefix cache.
    stride = 1000 * (args.num_decoders + args.num_long + 2)
    per_run = [(prompts(DEFAULT_MODEL_DIR, args.num_decoders, 16, stride * r),
                prompts(DEFAULT_MODEL_DIR, args.num_long, args.long_len, stride * r + 1000 * (args.num_decoders + 1)))
               for r in range(args.runs + 1)]
    results = {"colocated": [], "disaggregated": []}
    proc, url, log = serve_colocated(serve_args, env)
    try:
        asyncio.run(one_run(url, args, *per_run[-1]))  # warm-up, not counted
        for r in range(args.runs):
            results["colocated"].append(asyncio.run(one_run(url, args, *per_run[r])))
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
    with DisaggregatedServers("default", serve_args=serve_args, env=env) as servers:
        asyncio.run(one_run(servers.proxy_url, args, *per_run[-1]))
        for r in range(args.runs):
            results["disaggregated"].append(asyncio.run(one_run(servers.proxy_url, args, *per_run[r])))
    medians = {name: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
               for name, runs in results.items()}
    moved = bytes_per_request(per_run[0][1][0], args.block_size)
    print(f"{args.num_decoders} decodes of {args.decode_tokens} tokens; {args.num_long} prompts of {args.long_len} "
          f"tokens ({args.long_output} out) every {args.long_gap_s} s among them; median of {args.runs} runs; "
          f"{args.num_blocks} blocks of {args.block_size} per server")
    print(f"{'metric':<22}{'colocated':>12}{'P/D + proxy':>14}")
    for key in medians["colocated"]:
        print(f"{key:<22}{medians['colocated'][key]:>12.1f}{medians['disaggregated'][key]:>14.1f}")
    print(f"bytes moved per {moved['prompt_tokens']}-token prompt: {moved['bytes_moved']:,} "
          f"({moved['blocks']} blocks of {moved['block_size']}); Chapter 1's arithmetic for {moved['prompt_tokens']} "
          f"tokens: {moved['bytes_arithmetic']:,}")
    report = {"args": vars(args) | {"json": str(args.json) if args.json else None}, "runs": results,
              "medians": medians, "bytes": moved, "cpu_count": os.cpu_count()}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
