"""Shared fixtures: the embedded model, and tiny random models of each supported family saved locally."""

import importlib.util
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never fetch from a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

# The course's models are tiny: a second thread buys nothing, and two threads that spin-wait
# while another process holds a core make a decode step 30-40x slower on a 2-core machine.
torch.set_num_threads(1)

from kvlab.paths import DEFAULT_MODEL_DIR  # noqa: E402  (kvlab comes after the setup above: offline hub, one thread)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # Qwen2 has biases on q/k/v: a different code path
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
}


def make_tiny_model(family: str, num_kv_heads: int = 2, seed: int = 0):
    """A randomly initialised model of `family` with 4 query heads and `num_kv_heads` KV heads."""
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=num_kv_heads, head_dim=16, max_position_embeddings=96, pad_token_id=0,
        eos_token_id=None, bos_token_id=None, **extra,
    )
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config).eval()


def make_tiny_hybrid_model(family: str, window: int, seed: int = 0):
    """A randomly initialised 4-layer model with sliding-window layers: "mistral" windows every layer, "qwen2"
    layers 2-3 (use_sliding_window from max_window_layers on) and keeps 0-1 full."""
    import transformers

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    if family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=window,
                                                                           head_dim=16))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, use_sliding_window=True,
                                                                       sliding_window=window, max_window_layers=2))
    else:
        raise ValueError(f"family is 'mistral' or 'qwen2', got {family!r}")
    return model.eval()


@pytest.fixture(scope="session")
def embedded():
    """The course's embedded model and tokenizer, loaded once per test session."""
    from kvlab import load_model

    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        pytest.fail(f"the embedded model is missing from {DEFAULT_MODEL_DIR}; train it with tools/train_model.py")
    return load_model()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """Tiny random Llama, Qwen2 and Mistral models saved with a tokenizer-free config, by family."""
    dirs = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        make_tiny_model(family).save_pretrained(path)
        dirs[family] = path
    return dirs


def load_release_tool():
    """tools/release.py as a module (it is a script, not part of the kvlab package)."""
    spec = importlib.util.spec_from_file_location("kvlab_release_tool",
                                                  Path(__file__).resolve().parents[1] / "tools" / "release.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """With pytest-xdist's --dist loadgroup (scripts/test.sh runs two workers), keep each test file on one worker,
    so its module fixtures (a loaded model, a server) are built once, and split the grader's tests by assignment,
    so the chapters' nbgrader runs spread over both workers."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        group = item.nodeid.split("::")[0]
        params = getattr(getattr(item, "callspec", None), "params", {})
        if group.endswith("test_grading.py") and "name" in params:
            group = f"grading-{params['name']}"
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """On a pytest-xdist worker with --dist loadgroup, every grouped test's id must carry its group (test@group):
    xdist schedules by that suffix, and without it a chapter is graded once on each worker, doubling the run."""
    config = session.config
    if not (hasattr(config, "workerinput") and config.getvalue("loadgroup")):
        return
    lost = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(f"pytest-xdist did not group {len(lost)} tests (e.g. {lost[0]}): this pytest keeps "
                                f"node ids xdist cannot suffix; install the versions in requirements/constraints.txt")
