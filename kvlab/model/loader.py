"""Load the course's embedded model, or any Hugging Face Llama, Qwen2 or Mistral-family model."""

from pathlib import Path

import torch

from kvlab.paths import DEFAULT_MODEL_DIR

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def _looks_like_hub_id(name: str) -> bool:
    # "org/model" with no leading "." or "/" and no more than one slash: a hub id, not a local path.
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).exists()


def load_model(name_or_path=None, dtype: torch.dtype = torch.float32, device: str | None = None):
    """Return (model, tokenizer) in eval mode; None means the embedded model in assets/model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = str(name_or_path if name_or_path is not None else DEFAULT_MODEL_DIR)
    if not _looks_like_hub_id(source):
        path = Path(source).expanduser()
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"no model at {path}: expected a folder with config.json (and weights), "
                f"or a Hugging Face id such as 'Qwen/Qwen2.5-0.5B-Instruct'"
            )
        source = str(path)
    config = AutoConfig.from_pretrained(source)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{source} is a {config.model_type!r} model; kvlab runs the families {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    return model, tokenizer
