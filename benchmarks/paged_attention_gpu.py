"""Chapter 7 on a GPU: how close does the Triton paged decode kernel come to the memory's peak bandwidth?

Decode attention reads every cached key and value once per step and does little arithmetic on them,
so its speed is best measured as bandwidth: bytes of Q, K and V read and of the output written,
divided by the kernel's time, and compared with the GPU's peak (facts.md: T4 320 GB/s ... H200 4,800).
For each batch size, context length and block size this script
  1. checks the one-pass and split-KV kernels against the plain-torch reference at a small size,
  2. times the one-pass kernel and split-KV (num_splits chosen automatically) with
     triton.testing.do_bench, and keeps the faster,
  3. times torch's scaled_dot_product_attention on the same keys and values stored contiguously
     ([batch, kv_heads, context, head_dim], GQA through enable_gqa=True), and checks both agree,
then prints a table and writes results.csv, bandwidth.png and vs_sdpa.png to --out.

Shapes follow Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128); every sequence in a
batch has the full context, its blocks scattered over the pool in random order. Configurations whose
keys and values do not fit in 80% of free GPU memory (twice: pool and contiguous copy) are skipped.

Run from the repository root (the full grid is 100 configurations, each timed three ways; --quick is 12)::

    python benchmarks/paged_attention_gpu.py [--quick] [--dtype bf16] [--out benchmarks/results]

Without CUDA it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

# Peak memory bandwidth in GB/s (facts.md), matched against torch.cuda.get_device_name().
PEAK_GBPS = [
    (r"H200", 4800),
    (r"H100.*(HBM3|SXM)", 3352),   # "NVIDIA H100 80GB HBM3" is the SXM part; PCIe and NVL differ
    (r"A100.*SXM.*80GB", 2039),
    (r"A100.*40GB", 1555),
    (r"\bL4\b", 300),              # not L40/L40S
    (r"\bT4\b", 320),
]
FULL_GRID = {"batch": (1, 4, 16, 64, 256), "context": (512, 2048, 8192, 32768), "block_size": (8, 16, 32, 64, 128)}
QUICK_GRID = {"batch": (1, 16, 64), "context": (512, 4096), "block_size": (16, 64)}
COLUMNS = ["dtype", "batch", "context", "block_size", "num_splits", "one_pass_us", "split_kv_us", "best",
           "best_us", "sdpa_us", "mbytes", "best_gbps", "sdpa_gbps", "pct_of_peak", "sdpa_over_paged", "max_diff"]


def peak_bandwidth_gbps(device_name: str) -> float | None:
    """The GPU's peak memory bandwidth from facts.md's table, or None for a GPU it does not list."""
    for pattern, gbps in PEAK_GBPS:
        if re.search(pattern, device_name):
            return gbps
    return None


def bytes_moved(batch, context, num_heads, num_kv_heads, head_dim, element_size) -> int:
    """Bytes a decode step must move at least: read q, K and V once, write the output."""
    q_and_out = 2 * batch * num_heads * head_dim
    k_and_v = 2 * batch * context * num_kv_heads * head_dim
    return (q_and_out + k_and_v) * element_size


def make_inputs(batch, context, block_size, num_heads, num_kv_heads, head_dim, dtype, device, k=None, v=None, seed=0):
    """Contiguous K, V [batch, kv_heads, context, head_dim] (random unless given) and the same values in a
    shuffled pool.

    Returns q [batch, heads, head_dim], k, v, k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim],
    block_tables int32 [batch, context // block_size] and seq_lens int32 [batch].
    """
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    if k is None:
        k = torch.randn(batch, num_kv_heads, context, head_dim, generator=gen, device=device, dtype=dtype)
        v = torch.randn(batch, num_kv_heads, context, head_dim, generator=gen, device=device, dtype=dtype)
    q = torch.randn(batch, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    placement = torch.randperm(num_blocks, generator=gen, device=device)   # logical block i -> physical block
    pools = []
    for x in (k, v):
        pad = blocks_per_seq * block_size - context  # the last block's unused slots
        padded = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
        blocks = padded.transpose(1, 2).reshape(num_blocks, block_size, num_kv_heads, head_dim)
        pools.append(torch.empty_like(blocks).index_copy_(0, placement, blocks))
    block_tables = placement.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, k, v, pools[0], pools[1], block_tables, seq_lens


def sdpa_decode(q, k, v, scale):
    """torch's attention of one query per sequence over contiguous k, v [batch, kv_heads, context, head_dim]."""
    import torch.nn.functional as F

    out = F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out[:, :, 0]


def check_small(block_size, num_heads, num_kv_heads, head_dim, dtype, device) -> float:
    """Both kernels against the reference on three short sequences (1, 333 and 1,000 tokens); returns the max error."""
    import torch

    from kvlab.kernels import paged_attention_decode, paged_attention_decode_reference, paged_attention_decode_split_kv

    q, _, _, k_cache, v_cache, tables, _ = make_inputs(3, 1000, block_size, num_heads, num_kv_heads, head_dim,
                                                       dtype, device)
    lens = torch.tensor([1, 333, 1000], dtype=torch.int32, device=device)
    spec = paged_attention_decode_reference(q, k_cache, v_cache, tables, lens).float()
    worst = 0.0
    for out in (paged_attention_decode(q, k_cache, v_cache, tables, lens),
                paged_attention_decode_split_kv(q, k_cache, v_cache, tables, lens),
                paged_attention_decode_split_kv(q, k_cache, v_cache, tables, lens, num_splits=3)):
        worst = max(worst, (out.float() - spec).abs().max().item())
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2e-3
    if not worst <= tolerance:
        raise SystemExit(f"block_size {block_size}: kernel differs from the reference by {worst:.3g} "
                         f"(> {tolerance}); not timing a wrong kernel")
    return worst


def time_config(batch, context, block_size, args, dtype, device, contiguous, sdpa_us):
    """One row of the table: latencies, bandwidths and the agreement with SDPA for one configuration."""
    import torch
    from triton.testing import do_bench

    from kvlab.kernels import (
        allocate_split_workspace,
        choose_num_splits,
        launch_paged_decode,
        launch_paged_decode_split_kv,
        validate_paged_decode_inputs,
    )
    from kvlab.kernels.paged_decode import split_plan

    k, v = contiguous
    q, _, _, k_cache, v_cache, tables, lens = make_inputs(batch, context, block_size, args.num_heads, args.num_kv_heads,
                                                          args.head_dim, dtype, device, k=k, v=v)
    # Validate once, then time the launches alone: validation reads seq_lens and tables back to the host.
    shape = validate_paged_decode_inputs(q, k_cache, v_cache, tables, lens)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    _, num_splits = split_plan(context, choose_num_splits(batch, args.num_heads, context, num_sms))
    workspace = allocate_split_workspace(batch, args.num_heads, num_splits, args.head_dim, device)
    out_one, out_split = torch.empty_like(q), torch.empty_like(q)
    inputs = (q, k_cache, v_cache, tables, lens)
    one_pass_ms = do_bench(lambda: launch_paged_decode(shape, *inputs, out_one))
    split_ms = do_bench(lambda: launch_paged_decode_split_kv(shape, *inputs, out_split, num_splits,
                                                             workspace=workspace))
    best, best_ms = ("one-pass", one_pass_ms) if one_pass_ms <= split_ms else ("split-KV", split_ms)
    reference = sdpa_decode(q, k, v, shape.scale).float()
    max_diff = max((out_one.float() - reference).abs().max().item(), (out_split.float() - reference).abs().max().item())
    moved = bytes_moved(batch, context, args.num_heads, args.num_kv_heads, args.head_dim, q.element_size())
    if sdpa_us is None:
        sdpa_us = do_bench(lambda: sdpa_decode(q, k, v, shape.scale)) * 1e3
    best_gbps = moved / (best_ms * 1e-3) / 1e9
    return {
        "dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": context, "block_size": block_size,
        "num_splits": num_splits, "one_pass_us": one_pass_ms * 1e3, "split_kv_us": split_ms * 1e3, "best": best,
        "best_us": best_ms * 1e3, "sdpa_us": sdpa_us, "mbytes": moved / 1e6, "best_gbps": best_gbps,
        "sdpa_gbps": moved / (sdpa_us * 1e-6) / 1e9,
        "pct_of_peak": 100 * best_gbps / args.peak if args.peak else float("nan"),
        "sdpa_over_paged": sdpa_us / (best_ms * 1e3), "max_diff": max_diff,
    }


def print_table(rows, peak):
    """The results as an aligned text table (bandwidth in GB/s, times in microseconds)."""
    header = (f"{'batch':>5} {'context':>7} {'block':>5} {'splits':>6} {'1-pass us':>9} {'split us':>9} "
              f"{'SDPA us':>9} {'GB/s':>7} {'% peak':>6} {'SDPA/paged':>10} {'max diff':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        pct = f"{r['pct_of_peak']:6.1f}" if peak else f"{'-':>6}"
        print(f"{r['batch']:5d} {r['context']:7d} {r['block_size']:5d} {r['num_splits']:6d} {r['one_pass_us']:9.1f} "
              f"{r['split_kv_us']:9.1f} {r['sdpa_us']:9.1f} {r['best_gbps']:7.0f} {pct} {r['sdpa_over_paged']:10.2f} "
              f"{r['max_diff']:8.1e}")


def write_outputs(rows, out_dir: Path, title: str, peak) -> list[Path]:
    """results.csv, and two plots: bandwidth against context per block size, and SDPA time over paged time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "results.csv"]
    with open(written[0], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({key: (f"{value:.4g}" if isinstance(value, float) else value) for key, value in r.items()}
                         for r in rows)

    block_sizes = sorted({r["block_size"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    colors = dict(zip(batches, plt.cm.viridis([i / max(1, len(batches) - 1) for i in range(len(batches))])))
    fig, axes = plt.subplots(1, len(block_sizes), figsize=(4 * len(block_sizes), 3.6), sharey=True, squeeze=False)
    for ax, block_size in zip(axes[0], block_sizes):
        for batch in batches:
            pts = sorted((r["context"], r["best_gbps"], r["sdpa_gbps"]) for r in rows
                         if r["block_size"] == block_size and r["batch"] == batch)
            if pts:
                ctx, paged, sdpa = zip(*pts)
                ax.plot(ctx, paged, "o-", color=colors[batch], label=f"batch {batch}")
                ax.plot(ctx, sdpa, "x--", color=colors[batch], alpha=0.5)
        if peak:
            ax.axhline(peak, color="gray", lw=1, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_title(f"block size {block_size}")
        ax.set_xlabel("context (tokens)")
    axes[0][0].set_ylabel("GB/s (o paged, x SDPA)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title + (f"; peak {peak} GB/s dotted" if peak else ""), fontsize=9)
    fig.tight_layout()
    written.append(out_dir / "bandwidth.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.6))
    longest = max(r["context"] for r in rows)
    for batch in batches:
        pts = sorted((r["block_size"], r["sdpa_over_paged"]) for r in rows
                     if r["batch"] == batch and r["context"] == longest)
        if pts:
            ax.plot(*zip(*pts), "o-", color=colors[batch], label=f"batch {batch}")
    ax.axhline(1.0, color="gray", lw=1, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("SDPA time / paged time")
    ax.set_title(f"{title}; context {longest} (above 1: paged faster)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out_dir / "vs_sdpa.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a small grid: batch 1/16/64, context 512/4096, block 16/64")
    parser.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--peak-gbps", type=float, help="the GPU's peak bandwidth, if the built-in table lacks it")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)

    try:
        import torch
    except ImportError:
        print("skipped: torch is not installed")
        return 0
    if not torch.cuda.is_available():
        print("skipped: no CUDA GPU here. This benchmark times compiled Triton kernels; on a CPU the kernels run "
              "in Triton's interpreter, which says nothing about speed "
              "(python -m pytest tests/kernels/test_paged_attention_kernel.py "
              "checks them there, and python -m kvlab.kernels.aot compiles them for sm_75/80/90).")
        return 0
    try:
        import triton  # noqa: F401
        from tqdm import tqdm
    except ImportError as e:
        print(f"skipped: {e.name} is not installed")
        return 0

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    if dtype == torch.bfloat16 and major < 8:
        print(f"skipped: {name} (sm_{major}{minor}) has no bf16; run with --dtype fp16")
        return 0
    import kvlab.kernels as kernels

    if kernels.RUNS_IN_INTERPRETER:
        print("TRITON_INTERPRET=1 is set: unset it to time compiled kernels")
        return 1
    args.peak = args.peak_gbps or peak_bandwidth_gbps(name)
    grid = QUICK_GRID if args.quick else FULL_GRID
    title = (f"{name}, {args.dtype}, {args.num_heads} heads / {args.num_kv_heads} KV heads, head_dim {args.head_dim}")
    print(title + (f", peak {args.peak:.0f} GB/s" if args.peak
                   else ", peak unknown (pass --peak-gbps): bandwidth only"))

    for block_size in tqdm(grid["block_size"], desc="correctness vs reference", unit="block size"):
        check_small(block_size, args.num_heads, args.num_kv_heads, args.head_dim, dtype, device)

    rows, skipped = [], []
    configs = [(b, c) for c in grid["context"] for b in grid["batch"]]
    progress = tqdm(total=len(configs) * len(grid["block_size"]), desc="timing", unit="config")
    for batch, context in configs:
        kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * dtype.itemsize
        if 2.6 * kv_bytes > 0.8 * torch.cuda.mem_get_info(device)[0]:  # contiguous copy + pool + one transient copy
            skipped.append(f"batch {batch} x context {context} ({kv_bytes / 2**30:.1f} GiB of K and V)")
            progress.update(len(grid["block_size"]))
            continue
        gen = torch.Generator(device=device).manual_seed(batch * 100_003 + context)
        shape = (batch, args.num_kv_heads, context, args.head_dim)
        contiguous = (torch.randn(shape, generator=gen, device=device, dtype=dtype),
                      torch.randn(shape, generator=gen, device=device, dtype=dtype))
        sdpa_us = None  # SDPA does not depend on the block size: time it once per batch and context
        for block_size in grid["block_size"]:
            progress.set_postfix(batch=batch, context=context, block=block_size)
            row = time_config(batch, context, block_size, args, dtype, device, contiguous, sdpa_us)
            sdpa_us = row["sdpa_us"]
            if row["max_diff"] > (2e-2 if dtype == torch.bfloat16 else 5e-3):
                tqdm.write(f"warning: batch {batch} context {context} block {block_size}: "
                           f"paged and SDPA differ by {row['max_diff']:.3g}")
            rows.append(row)
            progress.update(1)
        del contiguous
        torch.cuda.empty_cache()
    progress.close()

    print()
    print_table(rows, args.peak)
    for line in skipped:
        print(f"skipped (memory): {line}")
    if rows:
        for path in write_outputs(rows, args.out, title, args.peak):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
