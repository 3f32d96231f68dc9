"""Chapter 3's multi-sequence greedy decoding on Chapter 4's KV cache manager, with optional prefix caching.

With enable_prefix_caching=True a joining request first looks up its prompt's cached full blocks and
feeds the model only the uncached suffix, at positions starting after the hit; the paged cache then
attends over the shared blocks plus the new ones. Outputs are the same either way, only the prefill
work shrinks.

Two requests joining in the same step may share blocks: the second one's lookup already sees the
first one's blocks, cached as soon as they were allocated. That is safe because PagedKVCache writes
every token's K/V of a layer before any sequence attends in that layer, so a shared block is filled
before the second request reads it.
"""


from kvlab.core.block_views import counters_for
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.decoding.paged_generate import PagedGenerator


class PrefixCachingGenerator(PagedGenerator):
    """PagedGenerator whose blocks come from a reference-counted pool that can share cached prompt prefixes.

    The decoding loop is PagedGenerator.step, unchanged: it asks the manager for each joining
    prompt's cached blocks, which Chapter 4's KVCacheManager finds by prefix hash. Only the manager
    and the block map's snapshot differ.
    """

    # The pre-step count assumes no hits, so it is an upper bound of what the step takes.
    block_need_is_upper_bound = True

    def __init__(self, model, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = False):
        self.enable_prefix_caching = enable_prefix_caching
        super().__init__(model, num_blocks, block_size,
                         block_manager=KVCacheManager(num_blocks, block_size, enable_prefix_caching))

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        """The block manager, a KVCacheManager (vLLM's name for it)."""
        return self.block_manager

    def snapshot(self) -> dict:
        """The pool and block tables as the block-map widget's plain data (see kvlab.widgets.block_map).

        Shared blocks list every request holding them, free blocks that keep a hash are `cached`, and
        blocks hit by a request admitted in the last step carry `hit`. O(blocks + block-table entries).
        """
        manager = self.block_manager
        pool = manager.block_pool
        size = self.block_size
        blocks = manager.block_views(self.last_hit_blocks)
        sequences = self.sequence_views(manager.block_tables, manager.num_tokens)
        for view in sequences:
            view["num_cached_tokens"] = self.num_cached_tokens.get(view["id"])  # None until admitted
        # Cached blocks count as free: they can be handed out.

        counters = counters_for(blocks, size, self.step_count)
        counters.update({
            "extra": {
                "prefix hits (tokens)": manager.hits,
                "hit rate": f"{manager.hit_rate:.0%}",
                "prefill tokens saved": manager.prefill_tokens_saved,
                "cached free blocks": sum(b["cached"] for b in blocks),
                "evictions": pool.num_evictions,
            },
        })
        return {
            "block_size": size,
            "num_blocks": len(blocks),
            "step": self.step_count,
            "done": not self.has_unfinished(),
            "blocks": blocks,
            "sequences": sequences,
            "counters": counters,
        }
