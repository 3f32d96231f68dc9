"""Chapter 12's break-even: when loading a prefix's K/V over a link beats recomputing it on the GPU.

A request whose first n tokens are held in a slower tier (host memory over PCIe, a local NVMe disk) can load
their K/V or recompute them. Loading costs the bytes over the link:

    load_time(n)      = n * bytes_per_token / link_bytes_per_s

Recomputing costs what the n tokens add to the forward pass that computes the prompt's last token anyway (its
logits are needed, so that pass runs in both cases). On Chapter 10's roofline a pass of t tokens takes
max(weight_bytes / memory_bytes_per_s, 2 * num_params * t / flops_per_s): the weights are read once whatever
t is, so below the ridge point extra tokens ride along for free.

    recompute_time(n) = pass(n + 1) - pass(1)

Loading pays from the smallest n with load_time(n) < recompute_time(n):

    n > (weight_bytes / memory_bytes_per_s - 2 * num_params / flops_per_s)
        / (2 * num_params / flops_per_s - bytes_per_token / link_bytes_per_s)

and never when a token crosses the link slower than the GPU computes it (the denominator is not positive).
Attention's FLOPs (quadratic in the context) are left out: they make recomputing dearer, so the break-even
found here is an upper bound. The rates are achieved ones; kvlab.simulation.break_even.offload_case fills them in
for a model config on a datasheet GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvlab.analysis.kv_size import kv_cache_bytes_per_token
from kvlab.validation import check_block_size, check_int, check_number, check_positive_int


def _positive(name: str, value) -> float:
    return float(check_number(name, value, allow_zero=False))


def bytes_per_block(config, block_size: int = 16, dtype: str | None = None) -> int:
    """Bytes of K and V, every layer, of one block of block_size tokens (Chapter 1's bytes per token times B)."""
    return check_block_size(block_size) * kv_cache_bytes_per_token(config, dtype)


def load_time_s(num_tokens: int, bytes_per_token: int, link_bytes_per_s: float) -> float:
    """Seconds to copy num_tokens tokens' K/V over a link of link_bytes_per_s (one direction)."""
    n = check_int("num_tokens", num_tokens, 0)
    return n * check_positive_int("bytes_per_token", bytes_per_token) / _positive("link_bytes_per_s",
                                                                                  link_bytes_per_s)


def pass_time_s(num_tokens: int, num_params: float, weight_bytes: float, flops_per_s: float,
                memory_bytes_per_s: float) -> float:
    """Roofline seconds of one forward pass over num_tokens tokens: weights read once, 2 FLOPs per weight and token."""
    t = check_positive_int("num_tokens", num_tokens)
    return max(_positive("weight_bytes", weight_bytes) / _positive("memory_bytes_per_s", memory_bytes_per_s),
               2 * _positive("num_params", num_params) * t / _positive("flops_per_s", flops_per_s))


def recompute_time_s(num_tokens: int, num_params: float, weight_bytes: float, flops_per_s: float,
                     memory_bytes_per_s: float) -> float:
    """Seconds num_tokens recomputed tokens add to the pass that computes the prompt's last token."""
    n = check_int("num_tokens", num_tokens, 0)
    args = (num_params, weight_bytes, flops_per_s, memory_bytes_per_s)
    return pass_time_s(n + 1, *args) - pass_time_s(1, *args)


def break_even_tokens(bytes_per_token: int, link_bytes_per_s: float, num_params: float, weight_bytes: float,
                      flops_per_s: float, memory_bytes_per_s: float) -> int | None:
    """The fewest tokens whose load is faster than their recompute; None if loading never wins."""
    per_token_load = check_positive_int("bytes_per_token", bytes_per_token) / _positive("link_bytes_per_s",
                                                                                        link_bytes_per_s)
    per_token_compute = 2 * _positive("num_params", num_params) / _positive("flops_per_s", flops_per_s)
    floor = _positive("weight_bytes", weight_bytes) / _positive("memory_bytes_per_s", memory_bytes_per_s)
    if per_token_compute <= per_token_load:
        return None
    # Past the ridge recompute grows by per_token_compute a token from a head start of floor - per_token_compute
    # (the last token's own share); before it recompute is zero and loading cannot win.
    n = max(1, math.floor((floor - per_token_compute) / (per_token_compute - per_token_load)) + 1)
    args = (num_params, weight_bytes, flops_per_s, memory_bytes_per_s)
    # The closed form, checked against the definition: floating point may put it one token off either way.
    while n > 1 and load_time_s(n - 1, bytes_per_token, link_bytes_per_s) < recompute_time_s(n - 1, *args):
        n -= 1
    while not load_time_s(n, bytes_per_token, link_bytes_per_s) < recompute_time_s(n, *args):
        n += 1
    return n


@dataclass(frozen=True)
class OffloadCase:
    """One model on one GPU behind one link: the achieved rates and what they give."""

    bytes_per_token: int
    num_params: float            # weights that take part in a token's matmuls (embedding lookup excluded)
    weight_bytes: float
    flops_per_s: float           # achieved: datasheet times the matmul efficiency
    memory_bytes_per_s: float    # achieved: datasheet times the matmul efficiency
    link_bytes_per_s: float

    @property
    def break_even_tokens(self) -> int | None:
        return break_even_tokens(self.bytes_per_token, self.link_bytes_per_s, self.num_params, self.weight_bytes,
                                 self.flops_per_s, self.memory_bytes_per_s)

    def load_time_s(self, num_tokens: int) -> float:
        return load_time_s(num_tokens, self.bytes_per_token, self.link_bytes_per_s)

    def recompute_time_s(self, num_tokens: int) -> float:
        return recompute_time_s(num_tokens, self.num_params, self.weight_bytes, self.flops_per_s,
                                self.memory_bytes_per_s)
