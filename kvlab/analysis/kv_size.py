"""KV-cache size arithmetic from a model config: bytes per token and per sequence."""

import json
from pathlib import Path

from kvlab.paths import MODEL_CONFIGS_DIR
from kvlab.validation import check_int, check_positive_int

# Bytes per element of the dtype names that appear in Hugging Face configs.
DTYPE_BYTES = {
    "float32": 4, "fp32": 4,
    "float16": 2, "fp16": 2, "half": 2,
    "bfloat16": 2, "bf16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "int8": 1,
}


def _field(config: dict, name: str):
    if name not in config or config[name] is None:
        raise KeyError(
            f"the model config has no {name!r} field, which the KV-size arithmetic needs "
            f"(fields present: {', '.join(sorted(config)) or 'none'})"
        )
    return config[name]


def config_dict(config) -> dict:
    """A plain dict from a dict, a transformers config, or a path to a config.json."""
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no model config at {path}")
        return json.loads(path.read_text())
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"expected a config dict, a transformers config or a path, got {type(config).__name__}")


def kv_shape(config) -> dict:
    """Layers, KV heads and head dim of a config, with the defaults transformers applies."""
    config = config_dict(config)
    num_layers = _field(config, "num_hidden_layers")
    num_heads = _field(config, "num_attention_heads")
    # Models without grouped-query attention omit num_key_value_heads: every head has its own K and V.
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    head_dim = config.get("head_dim") or _field(config, "hidden_size") // num_heads
    return {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim}


def dtype_bytes(config, dtype: str | None = None) -> int:
    """Bytes per element: `dtype` if given, else the config's own dtype field."""
    if dtype is None:
        config = config_dict(config)
        dtype = config.get("torch_dtype") or config.get("dtype")
        if dtype is None:
            raise KeyError("the model config has no 'torch_dtype' (or 'dtype') field; pass dtype='float16' or similar")
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[name]


def kv_cache_bytes_per_token(config, dtype: str | None = None) -> int:
    """Bytes of K and V that one token occupies across all layers."""
    shape = kv_shape(config)
    return 2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"] * dtype_bytes(config, dtype)


def load_model_config(name: str) -> dict:
    """One of the real model configs shipped in assets/configs, by file stem (e.g. 'llama-2-7b')."""
    path = MODEL_CONFIGS_DIR / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in MODEL_CONFIGS_DIR.glob("*.json"))
        raise FileNotFoundError(f"no shipped config {name!r} in {MODEL_CONFIGS_DIR}; known: {', '.join(known)}")
    return json.loads(path.read_text())


def shipped_model_configs() -> list[str]:
    """Names of the real model configs shipped in assets/configs."""
    return sorted(p.stem for p in MODEL_CONFIGS_DIR.glob("*.json"))


# ---------------------------------------------------------------------------------------------
# Chapter 14's follow-ups: tensor parallelism, a prompt's K/V in transit, and MLA's latent cache.

def kv_heads_per_gpu(config, tensor_parallel_size: int) -> int:
    """KV heads each tensor-parallel rank stores: the heads split across ranks, or one replicated head per rank."""
    tp = check_positive_int("tensor_parallel_size", tensor_parallel_size)
    kv_heads = kv_shape(config)["num_kv_heads"]
    # vLLM's QKVParallelLinear divides exactly: kv_heads by tp, or (fewer heads than ranks) tp by kv_heads.
    if tp >= kv_heads:
        if tp % kv_heads:
            raise ValueError(
                f"tensor_parallel_size {tp} must be a multiple of the {kv_heads} KV heads to replicate them"
            )
        return 1
    if kv_heads % tp:
        raise ValueError(f"the {kv_heads} KV heads do not split evenly over tensor_parallel_size {tp}")
    return kv_heads // tp


def kv_head_replicas(config, tensor_parallel_size: int) -> int:
    """How many tensor-parallel ranks hold a copy of each KV head (1 unless there are more ranks than heads)."""
    kv_heads_per_gpu(config, tensor_parallel_size)  # validates the split
    kv_heads = kv_shape(config)["num_kv_heads"]
    return tensor_parallel_size // kv_heads if tensor_parallel_size >= kv_heads else 1


def kv_bytes_per_gpu(config, tensor_parallel_size: int, dtype: str | None = None) -> int:
    """Bytes of K and V that one token occupies on each tensor-parallel GPU, replicated heads included."""
    shape = kv_shape(config)
    heads = kv_heads_per_gpu(config, tensor_parallel_size)
    return 2 * shape["num_layers"] * heads * shape["head_dim"] * dtype_bytes(config, dtype)


def kv_transfer_bytes(config, num_tokens: int, dtype: str | None = None) -> int:
    """Bytes of K and V a prefill instance hands to a decode instance for a prompt of num_tokens."""
    return check_int("num_tokens", num_tokens, 0) * kv_cache_bytes_per_token(config, dtype)


def mla_kv_bytes_per_token(config, dtype: str | None = None) -> int:
    """Bytes of one token in an MLA cache (DeepSeek-V2/V3): a kv_lora_rank latent plus the rope key, per layer."""
    config = config_dict(config)
    layers = check_positive_int("num_hidden_layers", _field(config, "num_hidden_layers"))
    rank = check_positive_int("kv_lora_rank", _field(config, "kv_lora_rank"))
    rope = check_positive_int("qk_rope_head_dim", _field(config, "qk_rope_head_dim"))
    # No separate K and V: the latent serves as both, so there is no factor 2.
    return layers * (rank + rope) * dtype_bytes(config, dtype)
