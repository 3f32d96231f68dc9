"""The offloading tiers on a multi-turn chat workload (kvlab.benchmarks.multi_turn), on the embedded model.

Eight conversations of four turns, interleaved; each turn's prompt is the conversation so far plus 52 new user
tokens (the last turn's prompt and its 12-token answer fill max_model_len, 256). Three engines with the same GPU
pool of 40 blocks of 16 tokens (the eight full contexts would need 128):

    GPU only     the GPU prefix cache alone
    + CPU        an OffloadingConnector CPU tier of 48 blocks (3 MiB)
    + CPU + disk the same CPU tier and a disk tier of 512 blocks (32 MiB) in a fresh temporary directory

Reported side by side: prompt tokens served by each place (hit rates of all prompt tokens), prefill tokens
computed and saved, TTFT p50 and p90 (each the median over the runs), bytes loaded per tier; then what one block
costs here from the CPU tier, from a disk file, and recomputed.

Run from the repository root (about a minute)::

    OMP_NUM_THREADS=1 python benchmarks/offload_run.py [--runs 3] [--switch-interval 0.0005]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

import torch  # noqa: E402

from kvlab import LLM, SamplingParams  # noqa: E402
from kvlab.benchmarks.multi_turn import multi_turn_conversations, run_conversations  # noqa: E402
from kvlab.kv_offload.disk import DiskBlockStore  # noqa: E402
from kvlab.kv_offload.worker import make_host_pool, swap_in  # noqa: E402

GPU_BLOCKS, CPU_BLOCKS, DISK_BLOCKS = 40, 48, 512
CONVERSATIONS, TURNS, ANSWER = 8, 4, 12


def connector(block_bytes: int, disk_path: str | None) -> dict | None:
    extra = {"kv_offloading_size": CPU_BLOCKS * block_bytes}
    if disk_path is not None:
        extra.update(disk_path=disk_path, disk_size=DISK_BLOCKS * block_bytes)
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def block_load_costs(engine, num_blocks: int = 64, repeats: int = 5) -> dict[str, float]:
    """Seconds per block on this machine, the median of `repeats`: "cpu" a host-pool block copied into the engine's
    pools, "disk" a block file read, checked and copied (the page cache warm: just written), "recompute" a block's
    share of one prefill of max_model_len - 1 tokens."""
    cache = engine.cache
    k0 = cache.k_pools[0]
    n = min(num_blocks, k0.shape[0])
    num_layers, (_, block_size, num_kv_heads, head_dim) = len(cache.k_pools), k0.shape
    host = make_host_pool(n, num_layers, block_size, num_kv_heads, head_dim, k0.dtype)
    host.normal_()
    ids = list(range(n))
    cpu = []
    for _ in range(repeats):
        t = time.perf_counter()
        swap_in(host, ids, cache.k_pools, cache.v_pools, ids)
        cpu.append((time.perf_counter() - t) / n)
    disk = []
    with tempfile.TemporaryDirectory() as directory:
        store = DiskBlockStore(directory)
        hashes = [i.to_bytes(32, "big") for i in ids]
        store.save_blocks(host, ids, hashes)
        for _ in range(repeats):
            t = time.perf_counter()
            for block_hash, gpu in zip(hashes, ids):
                block = store.load(block_hash)
                for layer, (k_pool, v_pool) in enumerate(zip(cache.k_pools, cache.v_pools)):
                    k_pool[gpu] = block[layer, 0]
                    v_pool[gpu] = block[layer, 1]
            disk.append((time.perf_counter() - t) / n)
    prompt_len = engine.max_model_len - 1
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompt = [int(x) for x in torch.randint(3, 60, (prompt_len,), generator=torch.Generator().manual_seed(0))]
    recompute = []
    for r in range(repeats + 1):
        engine.add_request(f"prefill{r}", prompt[r:] + prompt[:r], params)  # rotated: no prefix-cache hit
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if r:  # the first is a warm-up
            recompute.append((time.perf_counter() - t) / (prompt_len / block_size))
    return {"cpu": median(cpu), "disk": median(disk), "recompute": median(recompute)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per set-up; TTFT percentiles are their medians")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval in seconds (Python's default 0.005): how long the engine's thread "
                             "may wait for the GIL while the disk tier's reader or writer thread runs Python code")
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    probe = LLM("default", num_blocks=GPU_BLOCKS)
    model, tokenizer, engine = probe.model, probe.tokenizer, probe.llm_engine
    max_model_len, block_bytes = engine.max_model_len, engine.block_bytes
    conversations = multi_turn_conversations(tokenizer, CONVERSATIONS, max_model_len, TURNS, ANSWER)
    setups = ["GPU only", "+ CPU", "+ CPU + disk"]
    results = {name: [] for name in setups}
    for _ in range(args.runs):
        for name in setups:
            with tempfile.TemporaryDirectory() as directory:
                config = None if name == "GPU only" else connector(block_bytes, directory if "disk" in name else None)
                llm = LLM(model, tokenizer, num_blocks=GPU_BLOCKS, kv_transfer_config=config)
                results[name].append(run_conversations(llm.llm_engine, conversations, ANSWER))
                llm.llm_engine.shutdown()
    first = {name: runs[0] for name, runs in results.items()}
    total = first["GPU only"].prompt_tokens
    rows = [
        ("prompt tokens", lambda r: f"{r.prompt_tokens}"),
        ("GPU prefix-cache hits", lambda r: f"{r.gpu_hit_tokens} ({r.gpu_hit_tokens / total:.0%})"),
        ("CPU tier hits", lambda r: f"{r.cpu_hit_tokens} ({r.cpu_hit_tokens / total:.0%})"),
        ("disk tier hits", lambda r: f"{r.disk_hit_tokens} ({r.disk_hit_tokens / total:.0%})"),
        ("prefill tokens computed", lambda r: f"{r.prefill_tokens_computed}"),
        ("prefill tokens saved", lambda r: f"{r.prefill_tokens_saved} ({r.prefill_tokens_saved / total:.0%})"),
        ("bytes loaded, CPU tier", lambda r: f"{r.cpu_bytes_loaded / 2**20:.2f} MiB"),
        ("bytes loaded, disk tier", lambda r: f"{r.disk_bytes_loaded / 2**20:.2f} MiB"),
        ("preemptions", lambda r: f"{r.num_preemptions}"),
    ]
    print(f"{CONVERSATIONS} conversations x {TURNS} turns, GPU pool {GPU_BLOCKS} blocks of {engine.block_size} "
          f"tokens, CPU tier {CPU_BLOCKS} blocks, disk tier {DISK_BLOCKS} blocks; {args.runs} runs each; "
          f"GIL switch interval {sys.getswitchinterval() * 1000:g} ms")
    print(f"{'':26}" + "".join(f"{name:>18}" for name in setups))
    for label, cell in rows:
        print(f"{label:26}" + "".join(f"{cell(first[name]):>18}" for name in setups))
    for q, label in ((0.5, "TTFT p50 (ms)"), (0.9, "TTFT p90 (ms)")):
        cells = [f"{1000 * median(r.percentile_ttft(q) for r in results[name]):.1f}" for name in setups]
        print(f"{label:26}" + "".join(f"{c:>18}" for c in cells))
    wall = [f"{median(r.wall_s for r in results[name]):.2f}" for name in setups]
    print(f"{'wall time (s)':26}" + "".join(f"{c:>18}" for c in wall))
    same = all(r.prefill_tokens_computed == runs[0].prefill_tokens_computed for runs in results.values() for r in runs)
    print(f"token counts identical across runs: {same}")

    costs = block_load_costs(LLM(model, tokenizer).llm_engine)
    print(f"\none block of {engine.block_size} tokens ({block_bytes // 1024} KiB), median seconds per block:")
    for name in ("cpu", "disk", "recompute"):
        print(f"  {name:10} {1e6 * costs[name]:9.1f} us")
    for tier in ("cpu", "disk"):
        ratio = costs["recompute"] / costs[tier]
        verdict = "cheaper than recomputing" if ratio > 1 else "dearer than recomputing"
        print(f"  {tier} load is {verdict}: recompute / load = {ratio:.1f}")


if __name__ == "__main__":
    main()
