"""Hybrid models by arithmetic: which layers slide, the blocks a request holds, what Mamba state does to blocks.

vLLM V1's hybrid KV cache manager (docs/design/hybrid_kv_cache_manager.md) gives each attention type its
own KV-cache group: full attention, sliding window (with its window), Mamba or linear attention (a
fixed-size state per request). All groups draw from one block pool, so every group's page (the bytes of
one block of one layer) must be the same size:

    attention page = block_size x 2 (K and V) x kv_heads x head_dim x dtype bytes      (AttentionSpec)
    Mamba page     = sum over the state tensors of prod(shape) x dtype bytes          (MambaSpec)

(vllm/v1/kv_cache_interface.py: AttentionSpec.real_page_size_bytes, MambaSpec.page_size_bytes.) Attention
groups of different page sizes are unified by raising the smaller pages' block size by a whole factor
(vllm/v1/core/kv_cache_utils.py unify_kv_cache_spec_page_size; a factor that is not whole is refused). A
Mamba page does not depend on the block size, so vLLM instead raises the *attention* block size until
one attention page holds the state, then pads the state up to the page (vllm/platforms/interface.py
Platform._align_hybrid_block_size; earlier HybridAttentionMambaModelConfig.verify_and_update_config in
vllm/model_executor/models/config.py):

    block_size = a x ceil(mamba_page / (a x attention page of one token))      (mamba_cache_mode none, align)
    block_size = c x ceil(ceil(mamba_page / attention page of one token) / c)  (mamba_cache_mode all)

where a is the attention kernel's block alignment (16) and c = lcm(Mamba chunk size, a). Prefix caching
only caches full blocks, so prompts shorter than that block (hundreds of tokens) never hit.

Layers of one type are split into groups of group_size layers, group_size being the fewest layers of
any type (or the most, when the types are within 25% of each other); a type whose count is not a
multiple gets padding layers (kv_cache_utils.py _get_kv_cache_groups_uniform_page_size). One block id
then stands for one page in each of group_size layers, and a request holds block ids in every group: all
of its tokens' blocks in a full-attention group, only those its window still reaches in a
sliding-window group (kvlab.analysis.vllm_bridge.vllm_sliding_window_blocks), one state in a Mamba group.

Which layers slide is read from the model config as transformers reads it
(transformers/models/{gemma2,gemma3,gpt_oss,qwen2,mistral,qwen3_next}/configuration_*.py, __post_init__).
"""

import math
from dataclasses import dataclass

from kvlab.analysis.kv_size import config_dict, dtype_bytes, kv_shape
from kvlab.analysis.vllm_bridge import vllm_sliding_window_blocks
from kvlab.core.paging import num_blocks_needed
from kvlab.validation import check_block_size, check_int, check_number, check_positive_int, is_integer

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
LAYER_TYPES = (FULL, SLIDING, LINEAR)
# transformers' older name for a linear-attention (Mamba) layer (configuration_utils._LEGACY_LAYER_TYPE_REMAP).
_LEGACY_NAMES = {"mamba": LINEAR, "attention": FULL}
KERNEL_BLOCK_ALIGNMENT = 16  # FlashAttention's block sizes are multiples of 16 (vLLM's MultipleOf(16))
MAMBA_CACHE_MODES = ("none", "all", "align")


# ---------------------------------------------------------------------------------------------
# Layer patterns.

@dataclass(frozen=True, slots=True)
class LayerPattern:
    """Each layer's attention type, in order, and the window of the sliding ones."""

    layer_types: tuple[str, ...]   # one of LAYER_TYPES per layer
    sliding_window: int | None     # tokens each sliding layer sees (None when no layer slides)

    def count(self, layer_type: str) -> int:
        """How many layers are of layer_type."""
        return self.layer_types.count(layer_type)


def _text_config(config) -> dict:
    cfg = config_dict(config)
    # Multimodal configs (Gemma 3) keep the decoder's fields in text_config.
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def _window(cfg: dict) -> int:
    window = cfg.get("sliding_window")
    if not is_integer(window) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer (tokens each sliding layer sees), got {window!r}")
    return int(window)


def layer_pattern(config) -> LayerPattern:
    """Each layer of `config` as full, sliding-window or linear attention (Mamba), read as transformers reads it.

    An explicit `layer_types` wins; otherwise each family's default: Gemma 2 and gpt-oss alternate
    sliding and full from layer 0; Gemma 3 makes every sliding_window_pattern-th layer full (default 6);
    Qwen2 slides layers from max_window_layers on when use_sliding_window; Mistral slides every layer when
    sliding_window is set; Qwen3-Next makes every full_attention_interval-th layer full (default 4), the
    others linear attention.
    """
    cfg = _text_config(config)
    num_layers = check_positive_int("num_hidden_layers", cfg.get("num_hidden_layers"))
    model_type = cfg.get("model_type")
    explicit = cfg.get("layer_types")
    if explicit is not None:
        if not isinstance(explicit, (list, tuple)) or len(explicit) != num_layers:
            raise ValueError(f"layer_types must list one type per layer (num_hidden_layers = {num_layers}), "
                             f"got {len(explicit) if isinstance(explicit, (list, tuple)) else explicit!r} entries")
        types = []
        for i, t in enumerate(explicit):
            t = _LEGACY_NAMES.get(t, t)
            if t not in LAYER_TYPES:
                raise ValueError(f"layer_types[{i}] is {t!r}; this arithmetic knows {', '.join(LAYER_TYPES)}")
            types.append(t)
    elif model_type in ("gemma2", "gpt_oss"):
        types = [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
    elif model_type in ("gemma3_text", "gemma3"):
        every = check_positive_int("sliding_window_pattern", cfg.get("sliding_window_pattern", 6))
        types = [SLIDING if (i + 1) % every else FULL for i in range(num_layers)]
    elif model_type == "qwen2":
        first = check_int("max_window_layers", cfg.get("max_window_layers", 28), 0)
        slides = bool(cfg.get("use_sliding_window")) and cfg.get("sliding_window") is not None
        types = [SLIDING if slides and i >= first else FULL for i in range(num_layers)]
    elif model_type == "mistral":
        types = [SLIDING if cfg.get("sliding_window") is not None else FULL] * num_layers
    elif model_type == "qwen3_next":
        every = check_positive_int("full_attention_interval", cfg.get("full_attention_interval", 4))
        types = [LINEAR if (i + 1) % every else FULL for i in range(num_layers)]
    else:
        types = [FULL] * num_layers
    window = _window(cfg) if SLIDING in types else None
    return LayerPattern(tuple(types), window)


# ---------------------------------------------------------------------------------------------
# Mamba / linear-attention state.

@dataclass(frozen=True, slots=True)
class MambaStateSpec:
    """One linear-attention layer's state per request: its tensors' shapes and element bytes (vLLM's MambaSpec)."""

    shapes: tuple[tuple[int, ...], ...]   # conv state, then SSM / recurrent state
    element_bytes: tuple[int, ...]        # bytes per element of each tensor

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one layer's state: what one Mamba page must hold."""
        return sum(math.prod(s) * b for s, b in zip(self.shapes, self.element_bytes))


def mamba_state_spec(config, dtype: str | None = None, ssm_dtype: str | None = None) -> MambaStateSpec:
    """The per-layer state of a Gated DeltaNet model (Qwen3-Next), as vLLM's MambaStateShapeCalculator computes it.

    conv state: (linear_conv_kernel_dim - 1) x conv_dim, conv_dim = 2 x key heads x key dim + value heads x
    value dim; recurrent state: value heads x value dim x key dim (vllm/model_executor/layers/mamba/
    mamba_utils.py gated_delta_net_state_shape). Both in the model's dtype unless mamba_cache_dtype /
    mamba_ssm_cache_dtype say otherwise (dtype, ssm_dtype here).
    """
    cfg = _text_config(config)
    fields = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
              "linear_conv_kernel_dim")
    if any(f not in cfg for f in fields):
        raise ValueError(f"a Gated DeltaNet state needs {', '.join(fields)} in the config; "
                         f"missing {', '.join(f for f in fields if f not in cfg)}")
    k_heads, v_heads, k_dim, v_dim, kernel = (check_positive_int(f, cfg[f]) for f in fields)
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    conv_bytes = dtype_bytes(cfg, dtype)
    ssm_bytes = dtype_bytes(cfg, ssm_dtype or dtype)
    return MambaStateSpec(((kernel - 1, conv_dim), (v_heads, v_dim, k_dim)), (conv_bytes, ssm_bytes))


def attention_page_bytes_per_token(config, dtype: str | None = None) -> int:
    """K and V bytes of one token in one attention layer: the attention page of a block of one token."""
    shape = kv_shape(_text_config(config))
    return 2 * shape["num_kv_heads"] * shape["head_dim"] * dtype_bytes(_text_config(config), dtype)


def mamba_attention_block_size(attention_bytes_per_token: int, mamba_page_bytes: int, mamba_cache_mode: str = "none",
                               block_size: int = 16, alignment: int = KERNEL_BLOCK_ALIGNMENT,
                               mamba_chunk_size: int = 64) -> int:
    """The attention block size vLLM raises to so one attention page holds a Mamba state (module docstring).

    block_size is the one asked for: vLLM only ever raises it. mamba_chunk_size is the Mamba kernel's chunk
    (64 for Gated DeltaNet), used only by mamba_cache_mode "all".
    """
    per_token = check_positive_int("attention_bytes_per_token", attention_bytes_per_token)
    state = check_positive_int("mamba_page_bytes", mamba_page_bytes)
    if mamba_cache_mode not in MAMBA_CACHE_MODES:
        raise ValueError(f"mamba_cache_mode must be one of {', '.join(MAMBA_CACHE_MODES)}, got {mamba_cache_mode!r}")
    block_size = check_block_size(block_size)
    align = max(check_positive_int("alignment", alignment), block_size)
    if mamba_cache_mode == "all":
        chunk = math.lcm(check_positive_int("mamba_chunk_size", mamba_chunk_size), align)
        needed = chunk * -(-(-(-state // per_token)) // chunk)
    else:
        needed = align * -(-state // (align * per_token))
    return max(block_size, needed)


# ---------------------------------------------------------------------------------------------
# Page-size unification and groups.

def unify_page_sizes(page_sizes: dict[str, tuple[int, int]]) -> dict[str, int]:
    """New block sizes that give every attention spec the largest page, as unify_kv_cache_spec_page_size does.

    page_sizes maps a spec name to (block_size, page bytes); a smaller page must divide the largest
    (vLLM raises NotImplementedError otherwise: here a ValueError naming the spec).
    """
    if not page_sizes:
        raise ValueError("page_sizes is empty: give at least one spec as name -> (block_size, page bytes)")
    for name, (block, page) in page_sizes.items():
        check_positive_int(f"page_sizes[{name!r}] block_size", block)
        check_positive_int(f"page_sizes[{name!r}] page bytes", page)
    largest = max(page for _, page in page_sizes.values())
    out = {}
    for name, (block, page) in page_sizes.items():
        if largest % page:
            raise ValueError(f"page_sizes[{name!r}]: a page of {page} bytes does not divide the largest page "
                             f"({largest} bytes), so no whole block size makes them equal")
        out[name] = block * (largest // page)
    return out


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """One KV-cache group: layers of one type that share a block table."""

    layer_type: str      # one of LAYER_TYPES
    num_layers: int      # real layers in it (group_size minus its padding layers)


def kv_cache_groups(pattern: LayerPattern) -> tuple[int, list[KVCacheGroup]]:
    """group_size and the KV-cache groups vLLM makes of the pattern's layers (see the module docstring)."""
    counts = {t: pattern.count(t) for t in LAYER_TYPES if pattern.count(t)}
    if len(counts) == 1:
        (t, n), = counts.items()
        return n, [KVCacheGroup(t, n)]
    fewest, most = min(counts.values()), max(counts.values())
    group_size = most if most < fewest * 1.25 else fewest
    groups = []
    for t, n in counts.items():
        for start in range(0, n, group_size):
            groups.append(KVCacheGroup(t, min(group_size, n - start)))
    return group_size, groups


# ---------------------------------------------------------------------------------------------
# What a request holds, and how many fit.

@dataclass(frozen=True, slots=True)
class RequestFootprint:
    """Blocks and bytes one request of context_len tokens holds, with the hybrid manager and with every layer full."""

    context_len: int
    block_size: int            # attention block size (raised for a Mamba model)
    group_size: int            # layers each block id spans
    hybrid_blocks: int         # block ids held across all groups
    hybrid_bytes: int          # hybrid_blocks x group_size x page bytes
    full_blocks: int           # block ids if every layer were full attention (one group of all layers)
    full_bytes: int            # attention layers only, every token, every layer


def request_footprint(config, context_len: int, block_size: int = 16, dtype: str | None = None,
                      mamba_page_bytes: int | None = None) -> RequestFootprint:
    """What a request that has computed context_len tokens holds: hybrid groups against all-full attention.

    Sliding groups keep only the blocks their window reaches, a Mamba group one block (its state);
    mamba_page_bytes defaults to mamba_state_spec(config) for a model with linear-attention layers.
    The all-full side counts the attention layers only (a Mamba layer never grows with the context).
    """
    context_len = check_positive_int("context_len", context_len)
    block_size = check_block_size(block_size)
    pattern = layer_pattern(config)
    page = block_size * attention_page_bytes_per_token(config, dtype)
    if pattern.count(LINEAR) and mamba_page_bytes is None:
        mamba_page_bytes = mamba_state_spec(config, dtype).page_size_bytes
    if mamba_page_bytes is not None and mamba_page_bytes > page:
        raise ValueError(f"a Mamba state of {mamba_page_bytes} bytes does not fit an attention page of {page} bytes "
                         f"at block_size {block_size}; raise it with mamba_attention_block_size first")
    group_size, groups = kv_cache_groups(pattern)
    full = num_blocks_needed(context_len, block_size)
    held = {FULL: full, LINEAR: 1,
            SLIDING: vllm_sliding_window_blocks(context_len, pattern.sliding_window or 1, block_size)}
    hybrid_blocks = sum(held[g.layer_type] for g in groups)
    attention_layers = pattern.count(FULL) + pattern.count(SLIDING)
    return RequestFootprint(context_len, block_size, group_size, hybrid_blocks, hybrid_blocks * group_size * page,
                            full, full * attention_layers * page)


def requests_that_fit(footprint: RequestFootprint, kv_budget_bytes: int, config, dtype: str | None = None
                      ) -> tuple[int, int]:
    """Concurrent requests of footprint's size that kv_budget_bytes holds: (hybrid, all-full attention)."""
    budget = int(check_number("kv_budget_bytes", kv_budget_bytes, what="number of bytes"))
    pattern = layer_pattern(config)
    page = footprint.block_size * attention_page_bytes_per_token(config, dtype)
    hybrid_pool = budget // (footprint.group_size * page)    # block ids, each spanning group_size layers
    attention_layers = pattern.count(FULL) + pattern.count(SLIDING)
    full_pool = budget // (attention_layers * page)
    return hybrid_pool // footprint.hybrid_blocks, full_pool // footprint.full_blocks


# ---------------------------------------------------------------------------------------------
# Prefix-cache hits when the block is a Mamba page: a measured simulation on kvlab's own manager.

def shared_prefix_prompts(num_requests: int, prefix_len: int, suffix_lens: tuple[int, int], seed: int = 0,
                          vocab: int = 32000) -> list[list[int]]:
    """num_requests prompts that share their first prefix_len tokens, each with a unique suffix of a random length."""
    import random
    rng = random.Random(seed)
    num_requests = check_positive_int("num_requests", num_requests)
    prefix_len = check_int("prefix_len", prefix_len, 0)
    low, high = (check_positive_int("suffix_lens", n) for n in suffix_lens)
    if low > high:
        raise ValueError(f"suffix_lens must be (shortest, longest), got {suffix_lens!r}")
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(num_requests)]


def simulate_prefix_hit_rate(prompts: list[list[int]], block_size: int, mamba_cache_mode: str | None = None) -> float:
    """Share of prompt tokens served from the cache when prompts arrive one after another (each freed before the next).

    The attention side is kvlab.core's KVCacheManager (full blocks only, the last prompt token always
    recomputed). With mamba_cache_mode the model also has Mamba layers, and a hit must end where a
    state was kept (vLLM's MambaManager.find_longest_cache_hit takes the last cached state within the
    attention hit): "none" keeps no state (prefix caching is off), "all" keeps one at every block
    boundary a prompt fills, "align" only where a scheduler step ends on a boundary: with the prompt
    prefilled in one step, its last full block (vllm/config/cache.py mamba_cache_mode).
    """
    from kvlab.core.kv_cache_manager import KVCacheManager
    block_size = check_block_size(block_size)
    if mamba_cache_mode is not None and mamba_cache_mode not in MAMBA_CACHE_MODES:
        raise ValueError(f"mamba_cache_mode must be None (no Mamba layers) or one of {', '.join(MAMBA_CACHE_MODES)}, "
                         f"got {mamba_cache_mode!r}")
    total = sum(len(p) for p in prompts)
    manager = KVCacheManager(num_blocks=sum(num_blocks_needed(len(p), block_size) for p in prompts) + 1,
                             block_size=block_size, prefix_caching_hash_algo="builtin")
    states: set[tuple[int, ...]] = set()  # token prefixes whose Mamba state is kept
    hits = 0
    for i, prompt in enumerate(prompts):
        blocks, cached = manager.get_computed_blocks(i, prompt)
        if mamba_cache_mode is not None:
            # The hit shrinks to the longest block boundary within it where a state was kept.
            n = len(blocks)
            while n and tuple(prompt[:n * block_size]) not in states:
                n -= 1
            blocks, cached = blocks[:n], n * block_size
        manager.allocate_slots(i, len(prompt) - cached, computed_blocks=blocks, new_token_ids=prompt[cached:])
        hits += cached
        full = len(prompt) // block_size
        if mamba_cache_mode == "all":
            states.update(tuple(prompt[:k * block_size]) for k in range(1, full + 1))
        elif mamba_cache_mode == "align" and full:
            states.add(tuple(prompt[:full * block_size]))
        manager.free(i)
    return hits / total if total else 0.0
