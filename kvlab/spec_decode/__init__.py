"""Speculative decoding's proposers, as in vLLM's v1/spec_decode: the config, an n-gram and a draft-model proposer.

The engine verifies what they propose with kvlab.engine.rejection_sampler; the KV cache side (draft
slots, lookahead, rollback) is kvlab.core.draft_tokens and KVCacheManager.
"""
