"""The hash seed: what replicas must share for a router to compare their blocks (vLLM's PYTHONHASHSEED rule)."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from kvlab import SamplingParams
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_events import BlockStored
from kvlab.core.prefix_cache import block_hashes, hash_block_tokens, none_hash
from kvlab.engine.config import EngineConfig
from kvlab.engine.llm_engine import LLMEngine
from kvlab.router import KVBlockIndex


def test_the_seed_is_the_root_of_every_chain():
    tokens = list(range(12))
    assert none_hash(None) is None, "without a seed kvlab's chain starts from the fixed parent None"
    assert block_hashes(tokens, 4, hash_seed=None) == block_hashes(tokens, 4)
    seeded = block_hashes(tokens, 4, hash_seed="42")
    assert seeded[0] == hash_block_tokens(none_hash("42"), tokens[:4]), "the first block's parent is the seed's root"
    assert seeded[1] == hash_block_tokens(seeded[0], tokens[4:8]), "later blocks chain as before"
    assert not set(seeded) & set(block_hashes(tokens, 4)), "another seed renames every block, not only the first"
    assert block_hashes(tokens, 4, hash_seed=42) == seeded, "a seed given as an int is its decimal string"
    for bad in ("", 1.5, True, b"7"):
        with pytest.raises(ValueError, match="hash_seed"):
            none_hash(bad)


def test_a_pool_names_blocks_from_its_seed_and_its_events_keep_parent_none():
    tokens = list(range(9))
    for seed in (None, "1"):
        manager = KVCacheManager(8, 4, enable_kv_cache_events=True, hash_seed=seed)
        manager.allocate_slots("r", len(tokens), new_token_ids=tokens)
        _, hit_tokens = manager.get_computed_blocks("s", tokens + [0])
        assert hit_tokens == 8, f"hash_seed={seed!r}: a second request finds the two blocks the first cached"
        events = manager.take_events()
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert stored, "the filled blocks were cached and announced"
        assert stored[0].parent_block_hash is None, "an event names a first block's parent None, as vLLM's do"
        assert stored[0].block_hashes == block_hashes(tokens, 4, hash_seed=seed)[:len(stored[0].block_hashes)], \
            f"the pool with hash_seed={seed!r} names blocks as block_hashes(hash_seed=...) does"


def test_engines_with_different_seeds_are_told_apart_by_the_index(embedded):
    model, tokenizer = embedded
    prompt = [(7 * i) % 80 for i in range(33)]
    index = KVBlockIndex(8, hash_seed="7")
    for name, seed in (("same", "7"), ("other", "8"), ("unset", None)):
        engine = LLMEngine(model, tokenizer, block_size=8, num_blocks=16, hash_seed=seed,
                           kv_events_config={"enable_kv_cache_events": True, "publisher": "null"})
        batches = []
        engine.kv_event_publisher.publish = batches.append
        engine.add_request("q", prompt, SamplingParams(temperature=0, max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        for seq, batch in enumerate(batches):
            index.apply(name, batch, seq=seq)
    assert index.seed_mismatch == {"other", "unset"}, \
        "a replica whose seed differs from the router's names no block the router would look up: flag it"
    assert index.prompt_hits(prompt) == {"same": 4}, "only the replica sharing the seed is scored"


def test_the_engine_serves_the_same_tokens_under_any_seed(embedded):
    model, tokenizer = embedded
    prompt = [(7 * i) % 80 for i in range(33)]
    tokens = {}
    for seed in (None, "3"):
        engine = LLMEngine(model, tokenizer, block_size=8, num_blocks=16, hash_seed=seed)
        for rid in ("a", "b"):  # the second is a prefix hit under either seed
            engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=3))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        tokens[seed, rid] = list(out.outputs[0].token_ids)
        assert engine.kv_cache_manager.hits > 0, f"hash_seed={seed!r}: the repeated prompt hit the cache"
    assert tokens[None, "a"] == tokens[None, "b"] == tokens["3", "a"] == tokens["3", "b"], \
        "the seed renames blocks; it never changes what the model computes"


def test_kvlab_serve_takes_pythonhashseed_as_vllm_does(monkeypatch):
    parser = EngineConfig.add_cli_args(argparse.ArgumentParser())
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    assert EngineConfig.from_cli_args(parser.parse_args([])).cache_config.hash_seed == "123"
    assert EngineConfig.from_cli_args(parser.parse_args(["--hash-seed", "9"])).cache_config.hash_seed == "9", \
        "an explicit --hash-seed wins over the environment"
    monkeypatch.delenv("PYTHONHASHSEED")
    assert EngineConfig.from_cli_args(parser.parse_args([])).cache_config.hash_seed is None
    assert EngineConfig.from_kwargs().cache_config.hash_seed is None, \
        "in Python the seed is the hash_seed argument; the environment is read by the command line"
    with pytest.raises(ValueError, match="hash_seed"):
        EngineConfig.from_kwargs(hash_seed="")


def test_two_processes_with_the_same_seed_agree_and_with_another_do_not():
    tokens = list(range(40))
    code = ("import json, sys; from kvlab.core.prefix_cache import block_hashes; "
            "print(json.dumps([h.hex() for h in block_hashes(json.loads(sys.argv[1]), 8, "
            "hash_seed=sys.argv[2])]))")
    out = {}
    for process, seed in (("a", "5"), ("b", "5"), ("c", "6")):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        done = subprocess.run([sys.executable, "-c", code, json.dumps(tokens), seed], capture_output=True,
                              text=True, env=env, timeout=60, check=True)
        out[process] = json.loads(done.stdout)
    assert out["a"] == out["b"], "processes sharing the seed name every block alike"
    assert not set(out["a"]) & set(out["c"]), "another seed shares no block name"
