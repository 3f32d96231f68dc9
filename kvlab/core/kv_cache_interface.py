"""KV-cache specs of hybrid models: what one layer keeps per token, grouped so that one block pool serves them all.

A model's layers need different caches. A full-attention layer reads every earlier token; a sliding-window layer
(Gemma 2/3's local layers, gpt-oss's banded layers, Mistral v0.1) only the last `sliding_window` tokens; a chunked
local layer (Llama 4) only the tokens of its own chunk; a Mamba or linear-attention layer keeps one fixed-size
state per request. vLLM V1 names these FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec and
MambaSpec (vllm/v1/kv_cache_interface.py), puts layers of one spec into a KV-cache group that shares one block
table per request, and makes every group's page (the bytes of one block of one layer) the same size so that a
single block pool hands out blocks to every group (vllm/v1/core/kv_cache_utils.py,
docs/design/hybrid_kv_cache_manager.md). kvlab keeps the same shapes:

    specs = [FullAttentionSpec(16, 8, 128) if t == "full_attention" else SlidingWindowSpec(16, 8, 128, 1024)
             for t in layer_types]
    groups = group_layers(specs)          # [KVCacheGroupSpec(layer_ids, spec), ...] of equal sizes

Pages are unified by raising the block size of the groups with the smaller page (unify_page_sizes), which is
how vLLM fits a Mamba state into an attention page: the attention block grows until one page holds the state.
"""

from dataclasses import dataclass, replace

from kvlab.validation import check_positive_int


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """A layer that keeps the K and V of every token: block_size tokens of num_kv_heads x head_size per page."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int = 2

    def __post_init__(self):
        for name in ("block_size", "num_kv_heads", "head_size", "dtype_bytes"):
            check_positive_int(name, getattr(self, name))

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: K and V of block_size tokens."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens at the start that no query from position num_computed_tokens on will read: none for full attention."""
        return 0

    def max_blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """The most blocks one request of up to max_model_len tokens ever holds in this group (vLLM's
        max_memory_usage_bytes, in blocks), when a step brings at most max_num_batched_tokens of it."""
        full = -(-max_model_len // self.block_size)
        reach = self._tokens_reached_back()
        if reach is None:
            return full
        # After the skipped blocks go back, a step's n new tokens and the reach behind the first of them are held,
        # starting anywhere in a block: one block more than they fill.
        return min(full, -(-(reach + max_num_batched_tokens) // self.block_size) + 1)

    def _tokens_reached_back(self) -> int | None:
        """How far behind a query its keys can start (None: to the first token)."""
        return None


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(FullAttentionSpec):
    """A layer whose query at position p reads keys p - sliding_window + 1 .. p only."""

    sliding_window: int = 0

    def __post_init__(self):
        FullAttentionSpec.__post_init__(self)
        check_positive_int("sliding_window", self.sliding_window)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """The next query sits at num_computed_tokens and reads back sliding_window - 1 tokens: older ones are dead."""
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def _tokens_reached_back(self) -> int:
        return self.sliding_window - 1


@dataclass(frozen=True, slots=True)
class ChunkedLocalAttentionSpec(FullAttentionSpec):
    """A layer whose query reads only the keys of its own chunk of attention_chunk_size tokens (Llama 4's local
    layers): chunk i holds positions i * attention_chunk_size .. (i + 1) * attention_chunk_size - 1."""

    attention_chunk_size: int = 0

    def __post_init__(self):
        FullAttentionSpec.__post_init__(self)
        check_positive_int("attention_chunk_size", self.attention_chunk_size)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Every token before the chunk of the next query is dead."""
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size

    def _tokens_reached_back(self) -> int:
        return self.attention_chunk_size - 1


@dataclass(frozen=True, slots=True)
class MambaSpec:
    """A Mamba or linear-attention layer: one state of state_bytes per request, whatever its length.

    block_size is the attention block size its page must match; the state occupies one page."""

    block_size: int
    state_bytes: int

    def __post_init__(self):
        check_positive_int("block_size", self.block_size)
        check_positive_int("state_bytes", self.state_bytes)

    @property
    def page_size_bytes(self) -> int:
        return self.state_bytes


KVCacheSpec = FullAttentionSpec | MambaSpec


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """Layers that share one block table per request: their indices in the model and their common spec."""

    layer_ids: tuple[int, ...]
    kv_cache_spec: KVCacheSpec


def unify_page_sizes(specs: list[KVCacheSpec]) -> list[KVCacheSpec]:
    """The specs with one page size: each attention spec's block_size scaled up until its page equals the largest.

    A spec whose page does not divide the largest page, or a Mamba state larger than every attention page (vLLM
    raises the attention block size instead: give that block size), cannot be unified: ValueError.
    """
    if not specs:
        raise ValueError("no layers: a model needs at least one KV-cache spec")
    largest = max(s.page_size_bytes for s in specs)
    unified = []
    for i, spec in enumerate(specs):
        page = spec.page_size_bytes
        if page == largest:
            unified.append(spec)
        elif isinstance(spec, MambaSpec):
            raise ValueError(f"layer {i}: a Mamba state of {page} bytes is smaller than the largest page ({largest} "
                             f"bytes); pad the state or lower the attention block size")
        elif largest % page:
            raise ValueError(f"layer {i}: its page of {page} bytes does not divide the largest page of {largest} "
                             f"bytes, so no block size makes the pages equal; these groups cannot share one pool")
        else:
            unified.append(replace(spec, block_size=spec.block_size * (largest // page)))
    return unified


def group_layers(specs: list[KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Split the layers into KV-cache groups of one spec and equal size, as vLLM does for a uniform page size.

    Layers of one spec are split, in layer order, into groups of group_size layers, where group_size is the
    smallest number of layers of any one spec (a spec with more layers gets several groups; the last may be
    smaller). Equal groups let vLLM back the pool with group_size tensors, each shared by one layer of every
    group: a block id then means the same bytes in every group (vllm/v1/core/kv_cache_utils.py).
    """
    specs = unify_page_sizes(list(specs))
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(i)
    group_size = min(len(layers) for layers in by_spec.values())
    groups = []
    for spec, layers in by_spec.items():
        for start in range(0, len(layers), group_size):
            groups.append(KVCacheGroupSpec(tuple(layers[start:start + group_size]), spec))
    return groups


def specs_from_layer_types(layer_types: list[str], num_hidden_layers: int, block_size: int, num_kv_heads: int,
                           head_size: int, sliding_window: int | None = None, attention_chunk_size: int | None = None,
                           dtype_bytes: int = 2) -> list[KVCacheSpec]:
    """One spec per layer from a transformers-style layer_types list ("full_attention", "sliding_attention",
    "chunked_attention")."""
    check_positive_int("num_hidden_layers", num_hidden_layers)
    if len(layer_types) != num_hidden_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries but the model has {num_hidden_layers} layers "
                         f"(num_hidden_layers)")
    specs: list[KVCacheSpec] = []
    for i, kind in enumerate(layer_types):
        if kind == "full_attention":
            specs.append(FullAttentionSpec(block_size, num_kv_heads, head_size, dtype_bytes))
        elif kind == "sliding_attention":
            if sliding_window is None:
                raise ValueError(f"layer {i} is sliding_attention but the config gives no sliding_window")
            specs.append(SlidingWindowSpec(block_size, num_kv_heads, head_size, dtype_bytes, sliding_window))
        elif kind == "chunked_attention":
            if attention_chunk_size is None:
                raise ValueError(f"layer {i} is chunked_attention but the config gives no attention_chunk_size")
            specs.append(ChunkedLocalAttentionSpec(block_size, num_kv_heads, head_size, dtype_bytes,
                                                   attention_chunk_size))
        else:
            raise ValueError(f"layer_types[{i}] is {kind!r}: expected full_attention, sliding_attention or "
                             f"chunked_attention")
    return specs
