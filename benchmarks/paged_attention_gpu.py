"""Chapter 7 on a GPU: how close do the Triton paged-attention kernels come to the memory's bandwidth?

Decode attention reads every cached key and value once per step and does little arithmetic on them,
so its speed is best measured as bandwidth: the K/V bytes the sequences hold plus q and the output,
divided by the kernel's time. The roofline is measured, not taken from a datasheet: a device-to-device
copy of 1 GiB on the same GPU (bytes read + written over its time). For each batch size, context,
block size and GQA ratio this script
  1. checks the kernels against the plain-torch reference at a small size (it refuses to time a wrong one),
  2. times, with triton.testing.do_bench (which flushes the L2 cache before every launch), the one-pass
     decode (the unified kernel's one-token case) and split-KV with kvlab's choice of splits, on a pool
     whose blocks are shuffled, and keeps the faster,
  3. times the same kernels on the same K/V stored contiguously (block table 0, 1, 2, ...) at their best
     split count: what paging itself costs,
  4. times torch's scaled_dot_product_attention (flash backend where it takes the shapes) on the K/V stored
     contiguously, [batch, kv_heads, context, head_dim],
then mixed steps (decodes plus one prefill chunk, through the unified kernel in one launch, against SDPA on
the same tokens), and a small autotune of the unified kernel over tile size, warps and pipeline stages.
It prints tables and writes results.csv, mixed.csv, autotune.csv, bandwidth.png and vs_sdpa.png to --out.

Shapes follow Llama-3-8B's attention (32 query heads, head_dim 128) with 8 KV heads (GQA 4:1) and 4 (8:1).
Configurations whose K/V do not fit beside their contiguous copy in free memory are skipped.

    python benchmarks/paged_attention_gpu.py [--quick] [--dtype bf16] [--out benchmarks/results]

--quick (12 shapes x 2 GQA ratios, 2 mixed steps, 1 autotuned shape) takes about a minute on an H100-class
GPU; the full grid (batch 1-256, context 512-32k, block sizes 16/32/64) a few minutes. Without CUDA it says
so and exits 0.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kvlab

FULL_GRID = {"batch": (1, 4, 16, 64, 256), "context": (512, 2048, 8192, 32768), "block_size": (16, 32, 64),
             "gqa": (4, 8)}
QUICK_GRID = {"batch": (1, 16, 64), "context": (512, 4096), "block_size": (16, 64), "gqa": (4, 8)}
MIXED = {"full": [(16, 4096, 512), (64, 2048, 1024), (4, 8192, 2048)], "quick": [(16, 4096, 512), (64, 2048, 1024)]}
AUTOTUNE = {"tile": (32, 64, 128), "num_warps": (4, 8), "num_stages": (1, 2, 3)}
COLUMNS = ["dtype", "gqa", "batch", "context", "block_size", "num_splits", "one_pass_us", "split_kv_us", "best",
           "best_us", "contiguous_us", "sdpa_us", "sdpa_backend", "mbytes", "best_gbps", "sdpa_gbps", "pct_of_copy",
           "sdpa_over_paged", "contiguous_over_paged", "max_diff"]
MIXED_COLUMNS = ["dtype", "gqa", "decodes", "context", "prefill", "block_size", "unified_us", "sdpa_us",
                 "sdpa_backend", "unified_over_sdpa", "max_diff"]


def bytes_moved(batch, context, num_heads, num_kv_heads, head_dim, element_size) -> int:
    """Bytes a decode step must move at least: the K/V the sequences hold, read once; q read, the output written."""
    q_and_out = 2 * batch * num_heads * head_dim
    k_and_v = 2 * batch * context * num_kv_heads * head_dim
    return (q_and_out + k_and_v) * element_size


def measured_copy_gbps(device, bench, nbytes: int = 2**30) -> float:
    """The roofline: GB/s of a device-to-device copy of nbytes on this GPU, bytes read plus bytes written."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def make_inputs(batch, context, block_size, num_heads, num_kv_heads, head_dim, dtype, device, k=None, v=None, seed=0,
                shuffle=True):
    """Contiguous K, V [batch, kv_heads, context, head_dim] (random unless given) and the same values in a pool.

    shuffle: blocks placed in random order (as a long-running server's pool is); False: block i of sequence s
    at s * blocks_per_seq + i, the contiguous layout. Returns q [batch, heads, head_dim], k, v, k_cache,
    v_cache [num_blocks, block_size, kv_heads, head_dim], block_tables int32 and seq_lens int32 [batch].
    """
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    if k is None:
        k = torch.randn(batch, num_kv_heads, context, head_dim, generator=gen, device=device, dtype=dtype)
        v = torch.randn(batch, num_kv_heads, context, head_dim, generator=gen, device=device, dtype=dtype)
    q = torch.randn(batch, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    placement = (torch.randperm(num_blocks, generator=gen, device=device) if shuffle
                 else torch.arange(num_blocks, device=device))   # logical block i -> physical block
    pools = []
    for x in (k, v):
        pad = blocks_per_seq * block_size - context  # the last block's unused slots
        padded = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
        blocks = padded.transpose(1, 2).reshape(num_blocks, block_size, num_kv_heads, head_dim)
        pools.append(torch.empty_like(blocks).index_copy_(0, placement, blocks))
    block_tables = placement.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, k, v, pools[0], pools[1], block_tables, seq_lens


def sdpa(q, k, v, scale, causal=False):
    """torch's attention, flash backend where it takes the shapes: q [B, H, T, D], k, v [B, Hkv, L, D].

    Returns (out [B, H, T, D], the backend that ran).
    """
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = k.shape[1] != q.shape[1]
    for backend in (SDPBackend.FLASH_ATTENTION, None):
        try:
            if backend is None:
                return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal, enable_gqa=gqa), "default"
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal, enable_gqa=gqa), "flash"
        except RuntimeError:
            continue
    raise AssertionError("unreachable: the default backend takes every shape")


def check_small(block_size, num_heads, num_kv_heads, head_dim, dtype, device) -> float:
    """The kernels against the reference on three short sequences (1, 333 and 1,000 tokens); returns the max error."""
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


def _decode_launchers(batch, context, q, k_cache, v_cache, tables, lens, num_sms):
    """(one-pass, split-KV) callables on validated inputs, with kvlab's split count, and that count."""
    import torch

    from kvlab.kernels import (
        allocate_split_workspace,
        choose_num_splits,
        launch_paged_decode,
        launch_paged_decode_split_kv,
        split_plan,
        validate_paged_decode_inputs,
    )

    # Validate once, then time the launches alone: validation reads seq_lens and tables back to the host.
    shape = validate_paged_decode_inputs(q, k_cache, v_cache, tables, lens)
    _, num_splits = split_plan(context, choose_num_splits(batch, shape.num_kv_heads, context, num_sms))
    workspace = allocate_split_workspace(batch, shape.num_heads, num_splits, shape.head_dim, q.device)
    out_one, out_split = torch.empty_like(q), torch.empty_like(q)
    inputs = (q, k_cache, v_cache, tables, lens)
    return (lambda: launch_paged_decode(shape, *inputs, out_one),
            lambda: launch_paged_decode_split_kv(shape, *inputs, out_split, num_splits, workspace=workspace),
            num_splits, shape.scale, out_one, out_split)


def time_config(batch, context, block_size, num_kv_heads, args, dtype, device, contiguous, sdpa_result, bench,
                num_sms, copy_gbps):
    """One row of the table: latencies, bandwidths and the agreement with SDPA for one configuration.

    sdpa_result: (microseconds, backend) already measured for this batch and context, or None.
    """
    k, v = contiguous
    q, _, _, k_cache, v_cache, tables, lens = make_inputs(batch, context, block_size, args.num_heads, num_kv_heads,
                                                          args.head_dim, dtype, device, k=k, v=v)
    one_pass, split, num_splits, scale, out_one, out_split = _decode_launchers(batch, context, q, k_cache, v_cache,
                                                                               tables, lens, num_sms)
    one_pass_ms, split_ms = bench(one_pass), bench(split)
    best, best_ms = ("one-pass", one_pass_ms) if one_pass_ms <= split_ms else ("split-KV", split_ms)
    # The same kernels on the same values stored in order: what the shuffled blocks cost.
    _, _, _, k_flat, v_flat, flat_tables, _ = make_inputs(batch, context, block_size, args.num_heads, num_kv_heads,
                                                          args.head_dim, dtype, device, k=k, v=v, shuffle=False)
    flat_one, flat_split, *_ = _decode_launchers(batch, context, q, k_flat, v_flat, flat_tables, lens, num_sms)
    contiguous_ms = min(bench(flat_one), bench(flat_split))
    reference, backend = sdpa(q[:, :, None], k, v, scale)
    reference = reference[:, :, 0].float()
    one_pass()
    split()
    max_diff = max((out_one.float() - reference).abs().max().item(), (out_split.float() - reference).abs().max().item())
    moved = bytes_moved(batch, context, args.num_heads, num_kv_heads, args.head_dim, q.element_size())
    if sdpa_result is None:
        sdpa_result = (bench(lambda: sdpa(q[:, :, None], k, v, scale)) * 1e3, backend)
    sdpa_us, sdpa_backend = sdpa_result
    best_gbps = moved / (best_ms * 1e-3) / 1e9
    return {
        "dtype": str(dtype).removeprefix("torch."), "gqa": args.num_heads // num_kv_heads, "batch": batch,
        "context": context, "block_size": block_size, "num_splits": num_splits, "one_pass_us": one_pass_ms * 1e3,
        "split_kv_us": split_ms * 1e3, "best": best, "best_us": best_ms * 1e3, "contiguous_us": contiguous_ms * 1e3,
        "sdpa_us": sdpa_us, "sdpa_backend": sdpa_backend, "mbytes": moved / 1e6, "best_gbps": best_gbps,
        "sdpa_gbps": moved / (sdpa_us * 1e-6) / 1e9, "pct_of_copy": 100 * best_gbps / copy_gbps,
        "sdpa_over_paged": sdpa_us / (best_ms * 1e3), "contiguous_over_paged": contiguous_ms / best_ms,
        "max_diff": max_diff,
    }


def mixed_step(decodes, context, prefill, block_size, num_heads, num_kv_heads, head_dim, dtype, device, seed=0):
    """A step of `decodes` decodes at `context` and one `prefill`-token prompt, on a shuffled pool.

    Returns the unified kernel's inputs (q [decodes + prefill, H, D], pools, tables, seq_lens, query_start_loc)
    and the same values contiguously for SDPA: (q_decode [decodes, H, 1, D], k, v [decodes, Hkv, context, D],
    q_prefill [1, H, prefill, D], k_p, v_p [1, Hkv, prefill, D]).
    """
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    lens = [context] * decodes + [prefill]
    blocks_per_seq = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(blocks_per_seq)
    k_pool = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, device=device, dtype=dtype)
    v_pool = torch.zeros_like(k_pool)
    placement = torch.randperm(num_blocks, generator=gen, device=device)
    tables = torch.zeros(len(lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    contiguous, first = [], 0
    for i, (n, blocks) in enumerate(zip(lens, blocks_per_seq)):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
        ids = placement[first:first + blocks]
        first += blocks
        tables[i, :blocks] = ids.to(torch.int32)
        pad = blocks * block_size - n
        for pool, x in ((k_pool, k), (v_pool, v)):
            padded = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x
            pool[ids] = padded.view(blocks, block_size, num_kv_heads, head_dim)
        contiguous.append((k.transpose(0, 1), v.transpose(0, 1)))   # [Hkv, n, D]
    q = torch.randn(decodes + prefill, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    starts = torch.tensor([*range(decodes + 1), decodes + prefill], dtype=torch.int32, device=device)
    k_dec = torch.stack([kc for kc, _ in contiguous[:decodes]]) if decodes else None
    v_dec = torch.stack([vc for _, vc in contiguous[:decodes]]) if decodes else None
    q_dec = q[:decodes, :, None]                                   # [decodes, H, 1, D]
    q_pre = q[decodes:].transpose(0, 1)[None]                      # [1, H, prefill, D]
    k_pre, v_pre = (x[None] for x in contiguous[-1])
    return (q, k_pool, v_pool, tables, seq_lens, starts), (q_dec, k_dec, v_dec, q_pre, k_pre, v_pre)


def time_mixed(decodes, context, prefill, block_size, num_kv_heads, args, dtype, device, bench):
    """One mixed step through the unified kernel against SDPA on the same tokens (decodes, then a causal prefill)."""
    import torch

    from kvlab.kernels import launch_unified_attention, validate_paged_attention_inputs

    unified_inputs, (q_dec, k_dec, v_dec, q_pre, k_pre, v_pre) = mixed_step(
        decodes, context, prefill, block_size, args.num_heads, num_kv_heads, args.head_dim, dtype, device)
    shape = validate_paged_attention_inputs(*unified_inputs)
    out = torch.empty_like(unified_inputs[0])
    unified_ms = bench(lambda: launch_unified_attention(shape, *unified_inputs, out))

    def torch_step():
        dec, backend = sdpa(q_dec, k_dec, v_dec, shape.scale)
        pre, _ = sdpa(q_pre, k_pre, v_pre, shape.scale, causal=True)
        return dec, pre, backend

    sdpa_ms = bench(torch_step)
    launch_unified_attention(shape, *unified_inputs, out)
    dec, pre, backend = torch_step()
    reference = torch.cat([dec[:, :, 0], pre[0].transpose(0, 1)]).float()
    return {"dtype": str(dtype).removeprefix("torch."), "gqa": args.num_heads // num_kv_heads, "decodes": decodes,
            "context": context, "prefill": prefill, "block_size": block_size, "unified_us": unified_ms * 1e3,
            "sdpa_us": sdpa_ms * 1e3, "sdpa_backend": backend, "unified_over_sdpa": unified_ms / sdpa_ms,
            "max_diff": (out.float() - reference).abs().max().item()}


def autotune(batch, context, block_size, num_kv_heads, args, dtype, device, bench) -> list[dict]:
    """The unified decode over tile x num_warps x num_stages on one shape; rows sorted fastest first."""
    import torch

    from kvlab.kernels import launch_unified_attention, validate_paged_attention_inputs

    q, _, _, k_cache, v_cache, tables, lens = make_inputs(batch, context, block_size, args.num_heads, num_kv_heads,
                                                          args.head_dim, dtype, device)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    shape = validate_paged_attention_inputs(q, k_cache, v_cache, tables, lens, starts)
    out = torch.empty_like(q)
    rows = []
    for tile in AUTOTUNE["tile"]:
        for num_warps in AUTOTUNE["num_warps"]:
            for num_stages in AUTOTUNE["num_stages"]:
                def run(tile=tile, num_warps=num_warps, num_stages=num_stages):
                    return launch_unified_attention(shape, q, k_cache, v_cache, tables, lens, starts, out, tile=tile,
                                                  num_warps=num_warps, num_stages=num_stages)
                try:
                    us = bench(run) * 1e3
                except Exception as err:  # e.g. out of shared memory for a large tile with many stages
                    rows.append({"tile": tile, "num_warps": num_warps, "num_stages": num_stages, "us": float("nan"),
                                 "note": f"{type(err).__name__}"})
                    continue
                rows.append({"tile": tile, "num_warps": num_warps, "num_stages": num_stages, "us": us, "note": ""})
    return sorted(rows, key=lambda r: (math.isnan(r["us"]), r["us"]))


def print_table(rows):
    """The decode results as an aligned text table (bandwidth in GB/s, times in microseconds)."""
    header = (f"{'gqa':>3} {'batch':>5} {'context':>7} {'block':>5} {'splits':>6} {'1-pass us':>9} {'split us':>9} "
              f"{'contig us':>9} {'SDPA us':>9} {'GB/s':>7} {'% copy':>6} {'SDPA/paged':>10} {'max diff':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['gqa']:3d} {r['batch']:5d} {r['context']:7d} {r['block_size']:5d} {r['num_splits']:6d} "
              f"{r['one_pass_us']:9.1f} {r['split_kv_us']:9.1f} {r['contiguous_us']:9.1f} {r['sdpa_us']:9.1f} "
              f"{r['best_gbps']:7.0f} {r['pct_of_copy']:6.1f} {r['sdpa_over_paged']:10.2f} {r['max_diff']:8.1e}")


def _write_csv(path: Path, columns, rows) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows({key: (f"{value:.4g}" if isinstance(value, float) else value) for key, value in r.items()}
                         for r in rows)
    return path


def write_outputs(rows, mixed, tuned, out_dir: Path, title: str, copy_gbps: float) -> list[Path]:
    """results.csv, mixed.csv, autotune.csv, and two plots: bandwidth against context, SDPA time over paged time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = [_write_csv(out_dir / "results.csv", COLUMNS, rows)]
    if mixed:
        written.append(_write_csv(out_dir / "mixed.csv", MIXED_COLUMNS, mixed))
    if tuned:
        written.append(_write_csv(out_dir / "autotune.csv", list(tuned[0]), tuned))
    if not rows:
        return written
    block_sizes = sorted({r["block_size"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    colors = dict(zip(batches, plt.cm.viridis([i / max(1, len(batches) - 1) for i in range(len(batches))])))
    fig, axes = plt.subplots(1, len(block_sizes), figsize=(4 * len(block_sizes), 3.6), sharey=True, squeeze=False)
    gqa = max(r["gqa"] for r in rows)
    for ax, block_size in zip(axes[0], block_sizes):
        for batch in batches:
            pts = sorted((r["context"], r["best_gbps"], r["sdpa_gbps"]) for r in rows
                         if r["block_size"] == block_size and r["batch"] == batch and r["gqa"] == gqa)
            if pts:
                ctx, paged, torch_sdpa = zip(*pts)
                ax.plot(ctx, paged, "o-", color=colors[batch], label=f"batch {batch}")
                ax.plot(ctx, torch_sdpa, "x--", color=colors[batch], alpha=0.5)
        ax.axhline(copy_gbps, color="gray", lw=1, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_title(f"block size {block_size}, GQA {gqa}:1")
        ax.set_xlabel("context (tokens)")
    axes[0][0].set_ylabel("GB/s (o paged, x SDPA)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"{title}; measured copy {copy_gbps:.0f} GB/s dotted", fontsize=9)
    fig.tight_layout()
    written.append(out_dir / "bandwidth.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.6))
    longest = max(r["context"] for r in rows)
    for batch in batches:
        pts = sorted((r["block_size"], r["sdpa_over_paged"]) for r in rows
                     if r["batch"] == batch and r["context"] == longest and r["gqa"] == gqa)
        if pts:
            ax.plot(*zip(*pts), "o-", color=colors[batch], label=f"batch {batch}")
    ax.axhline(1.0, color="gray", lw=1, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("SDPA time / paged time")
    ax.set_title(f"{title}; context {longest}, GQA {gqa}:1 (above 1: paged faster)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out_dir / "vs_sdpa.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written


def run(args, device, bench, num_sms, log=print) -> dict:
    """Every measurement of one run (device and timer given, so a CPU smoke test can drive it): the rows."""
    import torch

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    grid = args.grid
    copy_gbps = measured_copy_gbps(device, bench, args.copy_bytes)
    log(f"roofline: a device-to-device copy moves {copy_gbps:.0f} GB/s on this device")
    for block_size in grid["block_size"]:
        for gqa in grid["gqa"]:
            check_small(block_size, args.num_heads, args.num_heads // gqa, args.head_dim, dtype, device)
    rows, skipped = [], []
    configs = [(g, b, c) for g in grid["gqa"] for c in grid["context"] for b in grid["batch"]]
    progress = args.progress(total=len(configs) * len(grid["block_size"]), desc="timing decode", unit="config")
    for gqa, batch, context in configs:
        num_kv_heads = args.num_heads // gqa
        kv_bytes = 2 * batch * context * num_kv_heads * args.head_dim * dtype.itemsize
        if device.type == "cuda" and 3.2 * kv_bytes > 0.8 * torch.cuda.mem_get_info(device)[0]:
            skipped.append(f"GQA {gqa}:1 batch {batch} x context {context} ({kv_bytes / 2**30:.1f} GiB of K and V)")
            progress.update(len(grid["block_size"]))
            continue
        gen = torch.Generator(device=device).manual_seed(batch * 100_003 + context)
        shape = (batch, num_kv_heads, context, args.head_dim)
        contiguous = (torch.randn(shape, generator=gen, device=device, dtype=dtype),
                      torch.randn(shape, generator=gen, device=device, dtype=dtype))
        sdpa_result = None  # SDPA does not depend on the block size: time it once per batch and context
        for block_size in grid["block_size"]:
            row = time_config(batch, context, block_size, num_kv_heads, args, dtype, device, contiguous, sdpa_result,
                              bench, num_sms, copy_gbps)
            sdpa_result = (row["sdpa_us"], row["sdpa_backend"])
            rows.append(row)
            progress.update(1)
        del contiguous
        if device.type == "cuda":
            torch.cuda.empty_cache()
    progress.close()
    mixed = [time_mixed(decodes, context, prefill, block_size, args.num_heads // gqa, args, dtype, device, bench)
             for decodes, context, prefill in args.mixed for gqa in grid["gqa"][:1] for block_size in (16,)]
    batch, context = args.autotune_shape
    tuned = autotune(batch, context, 16, args.num_heads // grid["gqa"][0], args, dtype, device, bench)
    return {"rows": rows, "mixed": mixed, "tuned": tuned, "skipped": skipped, "copy_gbps": copy_gbps}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 1/16/64, context 512/4096, block 16/64")
    parser.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)

    try:
        import torch
    except ImportError:
        print("skipped: torch is not installed")
        return 0
    if not torch.cuda.is_available():
        print("skipped: no CUDA GPU here. This benchmark times compiled Triton kernels; on a CPU the kernels run "
              "in Triton's interpreter, which says nothing about speed (tests/kernels checks them there, "
              "python -m kvlab.kernels.aot compiles them for sm_75/80/90 and reports registers and spills).")
        return 0
    try:
        import triton  # noqa: F401
        from tqdm import tqdm
        from triton.testing import do_bench
    except ImportError as e:
        print(f"skipped: {e.name} is not installed")
        return 0

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    if args.dtype == "bf16" and major < 8:
        print(f"skipped: {name} (sm_{major}{minor}) has no bf16; run with --dtype fp16")
        return 0
    import kvlab.kernels as kernels

    if kernels.RUNS_IN_INTERPRETER:
        print("TRITON_INTERPRET=1 is set: unset it to time compiled kernels")
        return 1
    args.grid = QUICK_GRID if args.quick else FULL_GRID
    args.mixed = MIXED["quick" if args.quick else "full"]
    args.autotune_shape = (16, 4096)
    args.copy_bytes = 2**30
    args.progress = tqdm
    title = f"{name}, {args.dtype}, {args.num_heads} heads, head_dim {args.head_dim}"
    print(title)
    results = run(args, device, do_bench, kernels.num_sms(device),
                  log=tqdm.write)
    print()
    print_table(results["rows"])
    print("\nmixed steps (decodes + one prefill chunk, one unified launch) against SDPA on the same tokens:")
    for r in results["mixed"]:
        print(f"  {r['decodes']:3d} decodes at {r['context']:5d} + a {r['prefill']:4d}-token prefill, "
              f"GQA {r['gqa']}:1: "
              f"unified {r['unified_us']:8.1f} us, SDPA {r['sdpa_us']:8.1f} us ({r['sdpa_backend']}), "
              f"ratio {r['unified_over_sdpa']:.2f}, max diff {r['max_diff']:.1e}")
    best = results["tuned"][0]
    print(f"\nautotune (batch {args.autotune_shape[0]}, context {args.autotune_shape[1]}): "
          f"fastest tile {best['tile']}, {best['num_warps']} warps, {best['num_stages']} stages: {best['us']:.1f} us")
    for line in results["skipped"]:
        print(f"skipped (memory): {line}")
    for path in write_outputs(results["rows"], results["mixed"], results["tuned"], args.out, title,
                              results["copy_gbps"]):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
