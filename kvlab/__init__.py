"""kvlab: a hands-on course on how LLM serving systems manage the KV cache, the way vLLM does it.

The modules follow the chapters:
  Chapter 1  kv_size (bytes per token), attention (reference causal attention), runner (the hook
             that lets a transformers model run on kvlab's cache), naive_cache, generate
"""

__version__ = "0.1.0"

from .model import load_model  # noqa: E402

__all__ = ["load_model", "__version__"]
