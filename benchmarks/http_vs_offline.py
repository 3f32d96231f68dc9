"""What the HTTP server costs: output tokens/s through `kvlab serve` at saturation against offline `LLM.generate`.

The same engine settings, the same requests (the chat workload of benchmarks/serving.py: the shipped trace's
lengths fitted to the embedded model's 256-token context, prompts cut from the shipped text, sent over HTTP
as the same token ids), greedy, each request's own max_tokens with EOS ignored, prefix caching off (every
run does the same work), torch on one thread (OMP_NUM_THREADS=1) in both:

  offline   kvlab.LLM(...).generate(prompts, params) in this process, one engine built once and warmed up
  http      `python -m kvlab.serve` in a process of its own, every request sent at once (saturation) as a
            streaming POST /v1/completions from this process (httpx), as `vllm bench serve
            --request-rate inf` sends them; tokens counted from each stream's usage chunk

--breakdown adds two steps between them, to show where the server's time goes:

  engine delta        the same engine loop as offline, but every step returns every running request's
                      new text (RequestOutputKind.DELTA, what the server asks for a stream; detokenised
                      incrementally) instead of only finished requests: the cost of detokenising along
                      the way
  async (no http)     kvlab's AsyncLLM in this process, every request consumed as a stream: adds the
                      engine thread's busy loop, the hand-off of every step's outputs to the event loop and
                      a single-slot collector per request

Output tokens/s is the generated tokens over the wall time from the first request sent to the last one
done. Over the timed HTTP runs the server process's CPU time is also read per thread (Linux's
/proc/<pid>/task): its main thread runs the event loop (HTTP, JSON, streams), the others are the engine
thread; printed per output token beside the wall time per token, it shows how much of the one GIL the
HTTP work takes. The client's CPU time (this process, which runs nothing else meanwhile) is printed too:
the HTTP side needs the server's core and part of another. The systems alternate, --repeats rounds after
one warm-up each (the order flips every round), so a slow moment of the machine falls on all alike;
printed side by side: each run, the medians, and the ratio http / offline (medians, and the median of
the per-round ratios). The greedy texts of all are compared: they must be equal, or the comparison
would be of different work.

Run from the repository root (a few minutes on a 2-core CPU with --breakdown)::

    OMP_NUM_THREADS=1 python benchmarks/http_vs_offline.py [--requests 64] [--max-num-seqs 32] [--repeats 5]
        [--breakdown]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

MAX_TOKENS = 240  # the workload's longest request, as in benchmarks/serving.py


def engine_flags(args) -> dict:
    """The engine knobs both sides run with (LLM keyword arguments; `kvlab serve` gets them as flags)."""
    return {"block_size": 16, "num_blocks": args.num_blocks, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "enable_prefix_caching": False}


def as_cli(knobs: dict) -> list[str]:
    out = []
    for name, value in knobs.items():
        flag = "--" + name.replace("_", "-")
        out += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)]
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(knobs: dict, port: int, switch_interval_ms: float | None = None,
                 timeout_s: float = 120.0) -> subprocess.Popen:
    """`python -m kvlab.serve` on 127.0.0.1:port, torch on one thread; returns once /health answers.

    switch_interval_ms sets the server's sys.setswitchinterval: how long a thread that holds the GIL may keep
    it while another (the engine thread, back from a torch call) waits for it (Python's default: 5 ms).
    """
    import httpx

    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    argv = ["serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "error", *as_cli(knobs)]
    code = (f"import sys; sys.setswitchinterval({(switch_interval_ms or 5.0) / 1000!r}); "
            f"from kvlab.entrypoints.cli import main; main({argv!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvlab serve exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError(f"kvlab serve did not answer on port {port} within {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU time (user + system) of every thread of a process so far, by thread id ({} where /proc is missing)."""
    tick = os.sysconf("SC_CLK_TCK")
    times = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        times[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return times


def run_offline(llm, prompts, params) -> tuple[float, int, list[str]]:
    """(seconds, output tokens, texts) of one LLM.generate over every request."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs), [o.outputs[0].text for o in outs]


def run_engine_delta(llm, prompts, params) -> tuple[float, int, list[str]]:
    """LLM.generate's loop with every step's new text detokenised, as the server asks the engine for a stream."""
    import dataclasses

    from kvlab.engine.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    start = time.perf_counter()
    ids = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        ids.append(f"delta-{time.monotonic_ns()}-{i}")
        engine.add_request(ids[-1], prompt, dataclasses.replace(p, output_kind=RequestOutputKind.DELTA))
    texts = {i: [] for i in ids}
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id].append(out.outputs[0].text)
            tokens += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    return seconds, tokens, ["".join(texts[i]) for i in ids]


def run_async(llm, prompts, params) -> tuple[float, int, list[str]]:
    """Every request as a stream from kvlab's AsyncLLM in this process: the server without HTTP."""
    from kvlab.engine.async_llm import AsyncLLM

    run = time.monotonic_ns()  # the engine keeps finished requests' ids: each run names its own

    async def go():
        async_llm = AsyncLLM(llm.llm_engine)

        async def one(i, prompt, p):
            last = None
            async for last in async_llm.generate(prompt, p, request_id=f"async-{run}-{i}"):
                pass
            return last

        start = time.perf_counter()
        outs = await asyncio.gather(*(one(i, prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params))))
        seconds = time.perf_counter() - start
        await async_llm.shutdown()
        return seconds, outs

    seconds, outs = asyncio.run(go())
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs), [o.outputs[0].text for o in outs]


async def _run_http(base: str, prompts, lengths) -> tuple[float, int, list[str]]:
    import httpx

    async def one(http, prompt, n):
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        text, tokens = [], 0
        async with http.stream("POST", base + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                text += [c["text"] for c in event["choices"]]
        return "".join(text), tokens

    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(http, p, n) for p, n in zip(prompts, lengths)))
        seconds = time.perf_counter() - start
    return seconds, sum(t for _, t in results), [text for text, _ in results]


def run_http(base: str, prompts, lengths) -> tuple[float, int, list[str]]:
    """(seconds, output tokens, texts) of every request sent at once to the server."""
    return asyncio.run(_run_http(base, prompts, lengths))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--breakdown", action="store_true",
                        help="also the engine with streaming (DELTA) outputs, and AsyncLLM without HTTP")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="also a second server whose GIL switch interval is this (Python's default is 5 ms)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.repeats < 1:
        parser.error("--requests and --repeats must be >= 1")

    import torch

    from kvlab import LLM, SamplingParams, load_model
    from kvlab.benchmarks.datasets import chat_workload

    torch.set_num_threads(1)  # the offline side as OMP_NUM_THREADS=1 makes the server
    model, tokenizer = load_model()
    prompts, lengths = chat_workload(args.requests, tokenizer, MAX_TOKENS)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    knobs = engine_flags(args)
    llm = LLM(model, tokenizer, **knobs)
    port = free_port()
    server = start_server(knobs, port)
    base = f"http://127.0.0.1:{port}"
    systems = {"offline": lambda: run_offline(llm, prompts, params)}
    if args.breakdown:
        systems["engine delta"] = lambda: run_engine_delta(llm, prompts, params)
        systems["async (no http)"] = lambda: run_async(llm, prompts, params)
    systems["http"] = lambda: run_http(base, prompts, lengths)
    servers = [server]
    if args.switch_interval_ms is not None:
        other_port = free_port()
        servers.append(start_server(knobs, other_port, args.switch_interval_ms))
        systems[f"http, switch {args.switch_interval_ms:g} ms"] = lambda: run_http(
            f"http://127.0.0.1:{other_port}", prompts, lengths)
    runs = {side: [] for side in systems}
    server_cpu = {"event loop": 0.0, "engine and other threads": 0.0}
    client_cpu = 0.0
    try:
        want = None
        for side, run in systems.items():  # a warm-up each, and the texts every side must give
            _, _, got = run()
            want = want or got
            if got != want:
                bad = sum(a != b for a, b in zip(got, want))
                raise AssertionError(f"{bad} of {len(want)} greedy texts differ between {side} and LLM.generate")
        for r in range(args.repeats):
            for side in (list(systems) if r % 2 == 0 else list(systems)[::-1]):
                before = thread_cpu_seconds(server.pid) if side == "http" else {}
                client_before = time.process_time()
                seconds, tokens, _ = systems[side]()
                if side == "http":
                    client_cpu += time.process_time() - client_before
                for tid, cpu in thread_cpu_seconds(server.pid).items() if side == "http" else ():
                    where = "event loop" if tid == server.pid else "engine and other threads"
                    server_cpu[where] += cpu - before.get(tid, 0.0)
                runs[side].append({"seconds": seconds, "tokens": tokens, "tok_per_s": tokens / seconds})
                print(f"round {r + 1} {side:<18} {tokens} tokens in {seconds:6.2f} s: {tokens / seconds:7.0f} tok/s",
                      flush=True)
    finally:
        for proc in servers:
            stop_server(proc)

    med = {side: statistics.median(x["tok_per_s"] for x in rs) for side, rs in runs.items()}
    ratios = [h["tok_per_s"] / o["tok_per_s"] for h, o in zip(runs["http"], runs["offline"])]
    report = {"requests": args.requests, "output_tokens": sum(lengths), "engine": knobs, "repeats": args.repeats,
              "median_tok_per_s": med, "ratio_of_medians": med["http"] / med["offline"],
              "median_round_ratio": statistics.median(ratios), "round_ratios": ratios, "runs": runs,
              "server_cpu_seconds": server_cpu, "client_cpu_seconds": client_cpu}
    print(f"\n{args.requests} requests, {sum(lengths)} output tokens, greedy, max_num_seqs {args.max_num_seqs}, "
          f"OMP_NUM_THREADS=1, median of {args.repeats} alternated runs:")
    names = {"offline": "offline LLM.generate", "http": "kvlab serve over HTTP"}
    for side in systems:
        spread = [x["tok_per_s"] for x in runs[side]]
        print(f"  {names.get(side, side):<24} {med[side]:7.0f} tok/s  ({med[side] / med['offline']:.2f}x offline; "
              f"runs {min(spread):.0f}-{max(spread):.0f})")
    print(f"  http / offline            {report['ratio_of_medians']:.2f} (per round: "
          f"{', '.join(f'{x:.2f}' for x in ratios)}; median {report['median_round_ratio']:.2f})")
    http_tokens = sum(x["tokens"] for x in runs["http"])
    if http_tokens and sum(server_cpu.values()) > 0:
        per_token = {k: v / http_tokens * 1e3 for k, v in server_cpu.items()}
        wall = sum(x["seconds"] for x in runs["http"]) / http_tokens * 1e3
        print(f"  server CPU per output token over the timed http runs: event loop {per_token['event loop']:.3f} ms, "
              f"engine thread (and any other) {per_token['engine and other threads']:.3f} ms; wall {wall:.3f} ms; "
              f"the client (this process) {client_cpu / http_tokens * 1e3:.3f} ms")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
