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


from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.cache.paged_cache import PagedKVCache
from kvlab.cache.ragged_batch import SequenceChunk, forward_batch, last_token_logits
from kvlab.decoding.paged_generate import PagedGenerator
from kvlab.core.paging import num_blocks_needed
from kvlab.core.block_views import counters_for


class PrefixCachingGenerator(PagedGenerator):
    """PagedGenerator whose blocks come from a reference-counted pool that can share cached prompt prefixes."""

    def __init__(self, model, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = False):
        self.model = model
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.cache = PagedKVCache.for_model(model, num_blocks, block_size)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sequences = {}
        self.running = []
        self.finished = []
        self.step_count = 0
        self.prefill_tokens_fed = 0  # prompt tokens that actually went through the model
        self.num_cached_tokens: dict[int, int] = {}  # seq id -> prompt tokens served from the cache at admission
        self.last_hit_blocks: set[int] = set()  # block ids that were prefix-cache hits in the last step

    def step(self) -> list[int]:
        """One forward pass for every running sequence; returns the ids of sequences that finished."""
        manager = self.kv_cache_manager
        joining = [s for s in self.waiting if s.arrival_step <= self.step_count]
        batch = self.running + joining
        self.step_count += 1
        self.last_hit_blocks = set()
        if not batch:
            return []
        # An upper bound that ignores hits: a joining request never takes more blocks from the free queue
        # than its whole prompt needs, so once this passes no allocation below can fail halfway.
        needed = sum(manager.num_blocks_to_allocate(s.seq_id, 1) for s in self.running)
        needed += sum(num_blocks_needed(len(s.prompt_ids), self.block_size) for s in joining)
        if needed > manager.num_free_blocks:
            raise MemoryError(f"this step needs up to {needed} new blocks but only {manager.num_free_blocks} are free")
        chunks = []
        for s in batch:
            if s in joining:
                hits, num_cached = manager.get_computed_blocks(s.seq_id, s.prompt_ids)
                self.num_cached_tokens[s.seq_id] = num_cached
                self.last_hit_blocks.update(b.block_id for b in hits)
                new_ids = s.prompt_ids[num_cached:]
                start = num_cached
                slots = manager.allocate_slots(s.seq_id, len(new_ids), hits, new_token_ids=new_ids)
                self.prefill_tokens_fed += len(new_ids)
            else:
                new_ids, start = [s.output_ids[-1]], s.num_tokens - 1
                slots = manager.allocate_slots(s.seq_id, 1, new_token_ids=new_ids)
            chunks.append(SequenceChunk(new_ids, start, manager.block_tables[s.seq_id], slots))
        logits, layout = forward_batch(self.model, self.cache, chunks)
        done = []
        for seq, token in zip(batch, last_token_logits(logits, layout.query_lens).argmax(-1).tolist()):
            seq.output_ids.append(token)
            if seq.finished:
                manager.free(seq.seq_id)
                self.finished.append(seq)
                done.append(seq.seq_id)
        self.running = [s for s in batch if not s.finished]
        return done

    def snapshot(self) -> dict:
        """The pool and block tables as the block-map widget's plain data (see kvlab.widgets.block_map).

        Shared blocks list every request holding them, free blocks that keep a hash are `cached`, and
        blocks hit by a request admitted in the last step carry `hit`. O(blocks + block-table entries).
        """
        manager = self.kv_cache_manager
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
