"""The training script runs end to end and its output loads with from_pretrained."""

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it

import torch  # noqa: E402
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
