"""The training script runs end to end, learns, is reproducible from its seed, and its output loads with
from_pretrained."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "train_model.py"
CORPUS = REPO / "assets" / "text" / "shakespeare.txt"


def test_three_training_steps_save_a_loadable_model(tmp_path):
    out = tmp_path / "model"
    # A slice of the corpus is enough to exercise the pipeline and skips encoding 1.3 MB.
    text = tmp_path / "slice.txt"
    text.write_text(CORPUS.read_text(encoding="utf-8")[:100_000], encoding="utf-8")
    # One thread: on a busy 2-core machine, two OpenMP threads wait on each other for seconds.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), "--steps", "3", "--batch-size", "4", "--eval-batches", "1",
           "--sample-chars", "20", "--text", str(text), "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "val" in result.stdout

    for name in ["model.safetensors", "config.json", "generation_config.json", "tokenizer.json"]:
        assert (out / name).is_file(), name

    model = LlamaForCausalLM.from_pretrained(out, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert next(model.parameters()).dtype == torch.float32
    assert model.generation_config.do_sample is False

    inputs = tokenizer("MACBETH.\n", return_tensors="pt")
    prompt_len = inputs["input_ids"].shape[1]
    generated = model.generate(**inputs, max_new_tokens=10, do_sample=False)
    assert prompt_len < generated.shape[1] <= prompt_len + 10  # an early <eos> may stop it
    assert isinstance(tokenizer.decode(generated[0]), str)


def _train(tmp_path, name, *extra):
    """Run tools/train_model.py on a corpus slice with a tiny configuration; returns its output folder."""
    out = tmp_path / name
    text = tmp_path / "slice.txt"
    if not text.exists():
        text.write_text(CORPUS.read_text(encoding="utf-8")[:50_000], encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), "--steps", "30", "--batch-size", "8", "--seq-len", "64", "--warmup", "3",
           "--lr", "3e-3", "--eval-every", "30", "--eval-batches", "2", "--layers", "1", "--hidden", "64",
           "--heads", "2", "--kv-heads", "1", "--ffn", "128", "--sample-chars", "10", "--text", str(text),
           "--out", str(out), *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_training_learns_follows_its_arguments_and_is_reproducible(tmp_path):
    """Same seed, same weights bit for bit; another seed, other weights; the loss falls well below chance."""
    first, again, other = _train(tmp_path, "a"), _train(tmp_path, "b"), _train(tmp_path, "c", "--seed", "7")
    weights = [load_file(str(out / "model.safetensors")) for out in (first, again, other)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]), \
        "two runs with the same seed must write identical weights (the model card's training is reproducible)"
    assert any(not torch.equal(weights[0][k], weights[2][k]) for k in weights[0]), "a different seed changed nothing"

    summary = json.loads((first / "training_summary.json").read_text())
    config = json.loads((first / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"]) == (1, 64, 2, 1, 128), \
        "the saved config must be the architecture the command line asked for"
    chance = math.log(config["vocab_size"])  # the loss of a uniform guess over the vocabulary
    assert math.isfinite(summary["final_val_loss"]) and math.isfinite(summary["final_train_loss"])
    assert summary["final_train_loss"] < 0.85 * chance, (
        f"after 30 steps the training loss {summary['final_train_loss']:.3f} should be well below "
        f"chance ({chance:.3f}): the model is not learning")
    assert summary["parameters"] == sum(w.numel() for k, w in weights[0].items() if "lm_head" not in k)
    assert "arch" not in summary["args"], "a llama run's summary keeps the keys it had before --arch existed"


def test_qwen2_window_arch_saves_the_windowed_layers_it_was_asked_for(tmp_path):
    """--arch qwen2-window: layers from --max-window-layers on are windowed, in the saved config and the summary."""
    from kvlab.model.loader import load_model

    # Two steps: a smoke run of the Qwen2 path (learning is tested on the llama path above).
    out = _train(tmp_path, "window", "--steps", "2", "--layers", "3", "--arch", "qwen2-window",
                 "--sliding-window", "8", "--max-window-layers", "1")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["sliding_window"] == 8
    assert config["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"], \
        "Qwen2 windows the layers from max_window_layers on"
    summary = json.loads((out / "training_summary.json").read_text())
    assert (summary["args"]["arch"], summary["args"]["sliding_window"], summary["args"]["max_window_layers"]) == \
        ("qwen2-window", 8, 1), "the summary records the window it was trained with"
    model, tokenizer = load_model(out, device="cpu")
    assert model.config.layer_types[1] == "sliding_attention"
    ids = tokenizer("MACBETH.\n")["input_ids"]
    assert [tokenizer.decode([i]) for i in ids] == list("MACBETH.\n"), \
        f"load_model must give the character-level tokenizer, not Qwen2's own byte-level one: {ids}"


def test_window_options_are_checked(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_model", SCRIPT)
    train_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_model)
    for bad, field in [(["--max-window-layers", "4"], "--max-window-layers"), (["--sliding-window", "0"],
                                                                              "--sliding-window")]:
        try:
            train_model.parse_args(["--out", "x", "--arch", "qwen2-window", *bad])
        except SystemExit as exit_:
            assert exit_.code == 2
        else:
            raise AssertionError(f"{bad} was accepted")
        assert field in capsys.readouterr().err, f"the error must name {field}"
