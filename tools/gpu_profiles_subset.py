"""Cut the subset of Vidur's GPU profiles that the course ships (assets/gpu_profiles/) from the full files.

Vidur (Agrawal et al., MLSys 2024, MIT licence) publishes per-operator times measured on A100 and H100 GPUs.
The course keeps, per model, GPU and tensor-parallel degree, the median time of each operator at a ladder of
token counts (powers of two and the points between them), and the intra-node all-reduce times at message
sizes near powers of two: a few tens of KB instead of 5 MB. Run from the repository root::

    python tools/gpu_profiles_subset.py /path/to/vidur/data/profiling   # or a folder holding the same CSVs
"""

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "assets" / "gpu_profiles"

OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
       "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
SHAPE = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp")
TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
          8192, 16384, 32768)
COMPUTE = {  # file in the full data -> (gpu, model)
    "compute_a100_Llama-2-7b-hf_mlp.csv": ("a100", "Llama-2-7b-hf"),
    "compute_a100_Llama-2-70b-hf_mlp.csv": ("a100", "Llama-2-70b-hf"),
    "compute_a100_Meta-Llama-3-8B_mlp.csv": ("a100", "Meta-Llama-3-8B"),
    "compute_h100_Llama-2-7b-hf_mlp.csv": ("h100", "Llama-2-7b-hf"),
    "compute_h100_Llama-2-70b-hf_mlp.csv": ("h100", "Llama-2-70b-hf"),
}
NETWORK = {"network_a100_dgx_all_reduce.csv": "a100", "network_h100_dgx_all_reduce.csv": "h100"}


def compute_rows(source: Path) -> list[dict]:
    rows = []
    for name, (gpu, model) in COMPUTE.items():
        seen = set()
        for r in csv.DictReader(open(source / name)):
            key = (int(r["num_tokens"]), int(r["num_tensor_parallel_workers"]))
            if key[0] not in TOKENS or key in seen:  # the full files repeat a few points; keep the first
                continue
            seen.add(key)
            row = {"gpu": gpu, "model": model, "num_tokens": key[0], "tensor_parallel_size": key[1]}
            row.update({f: r[f] for f in SHAPE})
            row.update({f"{op}_ms": r[f"time_stats.{op}.median"] for op in OPS})
            rows.append(row)
    return sorted(rows, key=lambda r: (r["gpu"], r["model"], r["tensor_parallel_size"], r["num_tokens"]))


def network_rows(source: Path) -> list[dict]:
    rows = []
    for name, gpu in NETWORK.items():
        data = [r for r in csv.DictReader(open(source / name)) if r["num_workers"] == r["devices_per_node"]]
        for workers in sorted({r["num_workers"] for r in data}, key=int):
            mine = [r for r in data if r["num_workers"] == workers]
            sizes = sorted({int(r["size"]) for r in mine})
            wanted = {min(sizes, key=lambda s, t=2 ** k: abs(s - t)) for k in range(11, 27)}
            for r in sorted(mine, key=lambda r: int(r["size"])):
                if int(r["size"]) in wanted:
                    wanted.discard(int(r["size"]))
                    rows.append({"gpu": gpu, "num_workers": int(workers), "size_bytes": int(r["size"]),
                                 "all_reduce_ms": r["time_stats.all_reduce.median"]})
    return rows


def write(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{path.relative_to(ROOT)}: {len(rows)} rows, {path.stat().st_size / 1024:.0f} KiB")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="folder holding Vidur's compute_*.csv and network_*.csv")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    write(OUT / "operators.csv", compute_rows(args.source))
    write(OUT / "all_reduce.csv", network_rows(args.source))


if __name__ == "__main__":
    sys.exit(main())
