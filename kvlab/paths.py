"""Where the course's shipped files live: the repository's assets/ folder, or $KVLAB_ASSETS."""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
ASSETS_DIR = Path(os.environ.get("KVLAB_ASSETS", REPO_ROOT / "assets"))
DEFAULT_MODEL_DIR = ASSETS_DIR / "model"
MODEL_CONFIGS_DIR = ASSETS_DIR / "configs"
DEFAULT_DRAFT_MODEL_DIR = ASSETS_DIR / "draft_model"  # the embedded model's speculative-decoding draft
WINDOW_MODEL_DIR = ASSETS_DIR / "model_window"  # the embedded model's hybrid sibling: layers 2-3 sliding-window
# The names load_model accepts for the shipped models, besides paths and hub ids.
SHIPPED_MODELS = {"default": DEFAULT_MODEL_DIR, "window": WINDOW_MODEL_DIR, "draft": DEFAULT_DRAFT_MODEL_DIR}
