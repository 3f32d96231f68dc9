"""Train the course's small character-level Llama on assets/text/shakespeare.txt and save it with save_pretrained.

`--arch qwen2-window` trains its hybrid sibling instead: a Qwen2 of the same sizes whose layers from
`--max-window-layers` on attend only to the last `--sliding-window` positions (the query's own included),
in training as in serving.

Usage:
    python tools/train_model.py --steps 3 --out /tmp/tiny          # smoke test, seconds
    OMP_NUM_THREADS=1 python tools/train_model.py --out assets/model --bf16   # the shipped model, ~20 min
    OMP_NUM_THREADS=1 python tools/train_model.py --out assets/model_window --bf16 \
        --arch qwen2-window --sliding-window 32 --max-window-layers 2   # the windowed sibling, ~20 min
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tqdm.auto import tqdm
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = REPO / "assets" / "text" / "shakespeare.txt"
SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]  # ids 0, 1, 2; characters follow
PAD_ID, EOS_ID = 0, 1
ARCHS = ("llama", "qwen2-window")
WINDOW_ARGS = ("arch", "sliding_window", "max_window_layers")  # absent from a llama run's summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Read the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    p.add_argument("--out", type=Path, required=True, help="directory for save_pretrained")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of --lr")
    p.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--arch", choices=ARCHS, default="llama",
                   help="llama: all layers full attention; qwen2-window: later layers sliding-window")
    p.add_argument("--sliding-window", type=int, default=32,
                   help="qwen2-window only: keys a windowed layer sees, the query's own included")
    p.add_argument("--max-window-layers", type=int, default=2,
                   help="qwen2-window only: layers 0..K-1 attend fully, layers K.. through the window")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast for matmuls (weights stay float32)")
    p.add_argument("--sample-prompt", default="OTHELLO.\n")
    p.add_argument("--sample-chars", type=int, default=240,
                   help="capped so prompt plus sample fits in --seq-len")
    args = p.parse_args(argv)
    if args.arch == "qwen2-window":
        if not 1 <= args.sliding_window:
            p.error(f"--sliding-window must be at least 1, got {args.sliding_window}")
        if not 0 <= args.max_window_layers < args.layers:
            p.error(f"--max-window-layers must be in [0, {args.layers}) so some layer is windowed, "
                    f"got {args.max_window_layers}")
    return args


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch so a run can be repeated."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_tokenizer(text: str, max_length: int) -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per distinct character of `text`, specials first."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + sorted(set(text)))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # An empty split pattern cuts between every pair of characters, so spaces
    # and newlines become tokens of their own instead of being dropped.
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    # No post-processor: tokenizer(text) adds no BOS/EOS, so prompts are just characters.
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,  # would glue " ." and " 's" together
    )


def shared_sizes(args: argparse.Namespace, vocab_size: int) -> dict:
    """The config fields both architectures take: sizes, context, norm, tied embeddings, special ids."""
    return dict(vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.ffn,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                head_dim=64, max_position_embeddings=args.seq_len, rms_norm_eps=1e-5, tie_word_embeddings=True,
                bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID)


def build_model(args: argparse.Namespace, vocab_size: int) -> LlamaForCausalLM | Qwen2ForCausalLM:
    """A small Llama (or, with --arch qwen2-window, a Qwen2) with grouped-query attention and head_dim 64."""
    if args.arch == "qwen2-window":
        return build_window_model(args, vocab_size)
    config = LlamaConfig(**shared_sizes(args, vocab_size))
    config.dtype = torch.float32
    return LlamaForCausalLM(config)


def build_window_model(args: argparse.Namespace, vocab_size: int) -> Qwen2ForCausalLM:
    """The Llama's sizes as a Qwen2 whose layers --max-window-layers.. attend through --sliding-window."""
    config = Qwen2Config(
        **shared_sizes(args, vocab_size),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        # Qwen2Config derives layer_types from these: layer i is "sliding_attention" when i >= K.
        use_sliding_window=True,
        sliding_window=args.sliding_window,
        max_window_layers=args.max_window_layers,
    )
    config.dtype = torch.float32
    return Qwen2ForCausalLM(config)


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW that decays matrices but not norms (decaying a gain towards 0 only hurts)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def lr_factor(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay from 1 to --min-lr-ratio at the last step."""
    warmup = min(args.warmup, max(args.steps // 10, 1))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(args.steps - warmup, 1)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cosine


def random_windows(data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """Random contiguous windows of `data`: (batch_size, seq_len) token ids."""
    starts = torch.randint(0, len(data) - seq_len + 1, (batch_size,), generator=gen)
    return torch.stack([data[s : s + seq_len] for s in starts.tolist()])


@torch.no_grad()
def estimate_loss(model, data: torch.Tensor, args: argparse.Namespace, autocast) -> float:
    """Mean next-character loss (nats) over --eval-batches windows drawn with a fixed seed."""
    model.eval()
    # The same windows at every evaluation, so the curve shows the model changing, not the sample.
    gen = torch.Generator().manual_seed(args.seed + 1)
    losses = []
    for _ in range(args.eval_batches):
        batch = random_windows(data, args.batch_size, args.seq_len, gen)
        with autocast():
            losses.append(model(input_ids=batch, labels=batch).loss.item())
    model.train()
    return float(np.mean(losses))


def sample_text(model, tokenizer, prompt: str, n_chars: int, seed: int, temperature: float = 0.8) -> str:
    """Prompt plus `n_chars` sampled characters, reproducible for a given seed."""
    torch.manual_seed(seed)
    inputs = tokenizer(prompt, return_tensors="pt")
    # Past the trained context length RoPE positions are unseen and the text falls apart.
    n_chars = min(n_chars, model.config.max_position_embeddings - inputs["input_ids"].shape[1])
    out = model.generate(**inputs, do_sample=True, temperature=temperature, top_k=0,
                         max_new_tokens=n_chars, pad_token_id=PAD_ID)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def _portable(value):
    """Paths inside the repository relative to it, so the summary holds no machine-specific paths."""
    if not isinstance(value, Path):
        return value
    try:
        return str(value.resolve().relative_to(REPO))
    except ValueError:
        return str(value)


def save(model, tokenizer, out: Path, summary: dict) -> None:
    """Write weights (safetensors, float32), config, tokenizer, generation config and a run summary."""
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=None)
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Train, evaluate, save and print a sample."""
    args = parse_args(argv)
    seed_everything(args.seed)
    started = time.time()

    text = args.text.read_text(encoding="utf-8")
    tokenizer = build_tokenizer(text, max_length=args.seq_len)
    # The backend encodes the whole corpus without the over-length warning.
    data = torch.tensor(tokenizer.backend_tokenizer.encode(text).ids, dtype=torch.long)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]

    model = build_model(args, vocab_size=len(tokenizer))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params:,} parameters; {len(train_data):,} train / {len(val_data):,} val characters; "
          f"vocab {len(tokenizer)}; torch threads {torch.get_num_threads()}")

    optimizer = make_optimizer(model, args)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, args))
    if args.bf16:
        autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    else:
        autocast = contextlib.nullcontext
    batch_gen = torch.Generator().manual_seed(args.seed)
    history = []

    model.train()
    bar = tqdm(range(1, args.steps + 1), desc="train", unit="step", mininterval=2.0)
    for step in bar:
        batch = random_windows(train_data, args.batch_size, args.seq_len, batch_gen)
        with autocast():
            loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")

        if step % args.eval_every == 0 or step == args.steps:
            train_loss = estimate_loss(model, train_data, args, autocast)
            val_loss = estimate_loss(model, val_data, args, autocast)
            history.append({"step": step, "train_loss": train_loss, "val_loss": val_loss,
                            "elapsed_s": round(time.time() - started, 1)})
            tqdm.write(f"step {step:5d}  train {train_loss:.4f}  val {val_loss:.4f}  "
                       f"({time.time() - started:.0f} s)")
    bar.close()

    wall = time.time() - started
    model.eval()
    sample = sample_text(model, tokenizer, args.sample_prompt, args.sample_chars, args.seed)
    summary = {
        # A llama run's summary keeps the keys it had before the window options existed.
        "args": {k: _portable(v) for k, v in vars(args).items()
                 if args.arch != "llama" or k not in WINDOW_ARGS},
        "parameters": n_params,
        "train_characters": len(train_data),
        "val_characters": len(val_data),
        "final_train_loss": history[-1]["train_loss"],
        "final_val_loss": history[-1]["val_loss"],
        "train_wall_time_s": round(wall, 1),
        "torch_threads": torch.get_num_threads(),
        "history": history,
        "sample": sample,
    }
    save(model, tokenizer, args.out, summary)
    print(f"saved to {args.out} after {wall:.0f} s; sample (temperature 0.8, seed {args.seed}):")
    print(sample)


if __name__ == "__main__":
    main()
