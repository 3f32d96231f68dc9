"""Block bookkeeping in plain Python, no tensors (vLLM's v1/core): block tables, the block pool, prefix hashing, fork.

Every chapter's block manager speaks one vocabulary, vLLM V1's (kvlab.core.paging.BaseBlockManager):
get_computed_blocks, num_blocks_to_allocate, allocate_slots and free, with the queries block_size,
num_blocks, num_free_blocks, block_tables and num_tokens. paging.BlockManager (Chapter 3) keeps a free
list; kv_cache_manager.KVCacheManager (Chapter 4) adds prefix caching on block_pool.BlockPool;
fork.CowBlockManager (Chapter 5) adds fork and copy-on-write.

Hybrid models (Chapter 11): kv_cache_interface describes each layer's KV cache (full attention, sliding window,
chunked local attention, a Mamba state) and groups the layers; single_type_kv_cache_manager keeps one group's
tables; kv_cache_coordinator.HybridKVCacheCoordinator runs one manager per group over one pool; and
hybrid_kv_cache_manager.HybridKVCacheManager answers the scheduler's calls through it, as vLLM V1's
KVCacheManager does through its coordinator.
"""
