"""load_model: the embedded model offline, local Llama/Qwen2/Mistral folders, and clear errors."""

import pytest

from kvlab import load_model
from kvlab.baselines.transformers_generate import reference_generate
from kvlab.decoding.generate import greedy_generate


def test_missing_model_path_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_model(missing)


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_local_models_of_each_family_load_and_match_generate(family, tiny_model_dirs, monkeypatch):
    from transformers import AutoTokenizer

    # These folders hold no tokenizer; borrow the embedded model's to exercise the full loader.
    from kvlab.paths import DEFAULT_MODEL_DIR

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    tokenizer.save_pretrained(tiny_model_dirs[family])
    model, _ = load_model(tiny_model_dirs[family])
    assert model.config.model_type == family
    prompt = [4, 9, 2, 7]
    assert greedy_generate(model, prompt, 20) == reference_generate(model, prompt, 20)


def test_unsupported_family_is_rejected(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="gpt2"):
        load_model(tmp_path)
