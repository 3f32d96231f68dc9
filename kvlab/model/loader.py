"""Load the course's embedded model, or any Hugging Face Llama, Qwen2 or Mistral-family model.

The shipped models also answer to a name (kvlab.paths.SHIPPED_MODELS): load_model("window") is the embedded
model's hybrid sibling, a Qwen2 whose layers 2-3 attend through a 32-token sliding window.
"""

import json
import os
from pathlib import Path

import torch

from kvlab.paths import DEFAULT_MODEL_DIR, SHIPPED_MODELS

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def _looks_like_hub_id(name: str) -> bool:
    # "org/model" with no leading "." or "/" and no more than one slash: a hub id, not a local path.
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).exists()


def _is_bare_word(source) -> bool:
    # "window", not "./window", "~/m" or "org/model": a name, unless something of that name is on disk.
    return (isinstance(source, str) and not any(sep in source for sep in ("/", os.sep))
            and not source.startswith((".", "~")) and not Path(source).exists())


def model_dir(name: str) -> Path:
    """The folder of the shipped model called `name` (a key of kvlab.paths.SHIPPED_MODELS)."""
    if name not in SHIPPED_MODELS:
        raise ValueError(f"model name {name!r} is not a shipped model; the names are "
                         f"{', '.join(repr(k) for k in SHIPPED_MODELS)} (or pass a folder or a Hugging Face id)")
    return SHIPPED_MODELS[name]


def _source(name_or_path) -> str:
    """The folder or hub id load_model reads for a name, a path or None (the embedded model)."""
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL_DIR
    elif name_or_path in SHIPPED_MODELS or _is_bare_word(name_or_path):
        name_or_path = model_dir(name_or_path)
    source = str(name_or_path)
    if not _looks_like_hub_id(source):
        path = Path(source).expanduser()
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"no model at {path}: expected a folder with config.json (and weights), "
                f"or a Hugging Face id such as 'Qwen/Qwen2.5-0.5B-Instruct'"
            )
        source = str(path)
    return source


def load_tokenizer(name_or_path=None):
    """The tokenizer load_model(name_or_path) returns, without the weights (a router tokenizes as its replicas do)."""
    return _load_tokenizer(_source(name_or_path))


def load_model(name_or_path=None, dtype: torch.dtype = torch.float32, device: str | None = None):
    """Return (model, tokenizer) in eval mode; None means the embedded model in assets/model, a shipped model's
    name ("default", "window", "draft") its folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = _source(name_or_path)
    config = AutoConfig.from_pretrained(source)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{source} is a {config.model_type!r} model; kvlab runs the families {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    return model, _load_tokenizer(source)


def _load_tokenizer(source: str):
    """The folder's tokenizer.json as written, when its tokenizer_config.json asks for that (the course's models)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config_file = Path(source) / "tokenizer_config.json"
    declared = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.exists() else None
    if declared in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        # AutoTokenizer swaps in the family's own class for some families whatever the folder declares: a Qwen2
        # folder gets Qwen2Tokenizer, which rebuilds a byte-level pipeline and would split "OTHELLO.\n" into
        # other ids than the character-level tokenizer the course's window model was trained with.
        return PreTrainedTokenizerFast.from_pretrained(source)
    return AutoTokenizer.from_pretrained(source)
