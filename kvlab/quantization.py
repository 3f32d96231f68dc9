"""Chapter 14's 8-bit KV formats in plain torch: int8 or fp8 e4m3 values, each with a float32 scale.

    stored = quantize(x / scale)        x ~ stored * scale

Two granularities of scale:

    "int8", "fp8_e4m3" ("fp8")                    one scale per (block, KV head): kvlab's own format
    "int8_per_token_head", "fp8_per_token_head"   one scale per (token, KV head), computed when the token
                                                  is written: vLLM's names for the same idea

Imports nothing but torch, so the kernels' reference and the caches share one definition.
"""

import torch

SUPPORTED_KV_CACHE_DTYPES = ("int8", "fp8", "fp8_e4m3", "int8_per_token_head", "fp8_per_token_head")
# vLLM's spellings (vllm/config/cache.py, CacheDType): a scale per token and KV head, found on write.
PER_TOKEN_HEAD_KV_CACHE_DTYPES = ("int8_per_token_head", "fp8_per_token_head")
INT8_MAX = 127            # symmetric int8: -127..127, so -x is always representable
FP8_E4M3_MAX = 448.0      # the largest finite float8_e4m3fn
SCALE_BYTES = 4           # one float32 scale per (block or token, KV head), for K and for V
# A block of zeros still gets a positive scale, so dequantising gives 0 rather than 0/0 = NaN.
SCALE_FLOOR = torch.finfo(torch.float32).tiny


def _fp8_dtype() -> torch.dtype:
    # Looked up at call time, so a torch without float8 fails here with a clear message.
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        raise RuntimeError(
            f"kv_cache_dtype='fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} does not have "
            f"(it arrived in torch 2.1); upgrade torch or use kv_cache_dtype='int8'"
        )
    return dtype


def storage_format(kv_cache_dtype: str) -> tuple[torch.dtype, float]:
    """The pool dtype and the largest stored magnitude for a kv_cache_dtype name."""
    if kv_cache_dtype in ("int8", "int8_per_token_head"):
        return torch.int8, float(INT8_MAX)
    if kv_cache_dtype in ("fp8", "fp8_e4m3", "fp8_per_token_head"):
        return _fp8_dtype(), FP8_E4M3_MAX
    raise ValueError(
        f"unsupported kv_cache_dtype {kv_cache_dtype!r}; supported: {', '.join(SUPPORTED_KV_CACHE_DTYPES)}"
    )


def scale_granularity(kv_cache_dtype: str) -> str:
    """'token' for a scale per (token, KV head), 'block' for one per (block, KV head); ValueError otherwise."""
    storage_format(kv_cache_dtype)
    return "token" if kv_cache_dtype in PER_TOKEN_HEAD_KV_CACHE_DTYPES else "block"


def quantize(x: torch.Tensor, scale: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """x [..., D] divided by scale [...] and rounded to the storage dtype (saturating at its range)."""
    storage, qmax = storage_format(kv_cache_dtype)
    y = (x.float() / scale.float()[..., None]).clamp(-qmax, qmax)
    # int8 rounds to nearest; the cast to fp8 rounds to the nearest fp8 value by itself.
    return (y.round() if storage == torch.int8 else y).to(storage)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored values q [..., D] times their scale [...], as `dtype`."""
    return (q.float() * scale.float()[..., None]).to(dtype)
