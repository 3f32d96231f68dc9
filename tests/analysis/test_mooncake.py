"""Tests for the Mooncake trace: loading and validation, prompt tokens that keep its prefix sharing, cache hits."""

import gzip
import itertools
import json

import numpy as np
import pytest

from kvlab.analysis.mooncake import (
    MOONCAKE_TRACES,
    MooncakeRequest,
    PromptSynthesizer,
    block_keys,
    infinite_cache_hits,
    load_mooncake_trace,
    parse_mooncake_lines,
    prefix_cache_hits,
    prefix_cache_hits_from_tokens,
)
from kvlab.core.prefix_cache import block_hashes


def _line(timestamp=0, input_length=600, output_length=10, hash_ids=(0, 1)):
    return json.dumps({"timestamp": timestamp, "input_length": input_length, "output_length": output_length,
                       "hash_ids": list(hash_ids)})


def _req(rid, ids, length):
    return MooncakeRequest(rid, float(rid), length, 1, tuple(ids))


def _shared_blocks(a, b):
    """How many leading block hashes two prompts have in common."""
    return sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(a, b)))


def test_shipped_conversation_trace_is_whole_and_matches_the_paper_table():
    requests = load_mooncake_trace("conversation")
    assert len(requests) == 12_031, "the whole one-hour conversation trace ships, not a sample"
    assert round(np.mean([r.input_length for r in requests])) == 12_035  # FAST'25 Table 2
    assert round(np.mean([r.output_length for r in requests])) == 343
    assert requests[0] == MooncakeRequest(0, 0.0, 6758, 500, tuple(range(14))), "first line, ms turned into s"
    assert 3500 < requests[-1].arrival_s <= 3600, "one hour of arrivals, in seconds"


def test_limit_reads_a_slice_and_gzip_or_plain_files_load_alike(tmp_path):
    head = load_mooncake_trace(MOONCAKE_TRACES["conversation"], limit=20)
    assert len(head) == 20 and [r.request_id for r in head] == list(range(20))
    lines = [_line(0, 600, 5, (7, 8)), _line(1500, 512, 3, (7,))]
    plain = tmp_path / "t.jsonl"
    plain.write_text("\n".join(lines) + "\n\n")  # blank lines are skipped
    packed = tmp_path / "t.jsonl.gz"
    with gzip.open(packed, "wt") as f:
        f.write("\n".join(lines))
    assert load_mooncake_trace(plain) == load_mooncake_trace(packed) == [
        MooncakeRequest(0, 0.0, 600, 5, (7, 8)), MooncakeRequest(1, 1.5, 512, 3, (7,))]
    with pytest.raises(FileNotFoundError, match="no Mooncake trace"):
        load_mooncake_trace(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not a JSON object"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"timestamp": 5, "input_length": 600, "output_length": 1}), "missing field.*hash_ids"),
    (_line(timestamp=-1), "timestamp must be a non-negative"),
    (_line(timestamp=0), None),  # equal timestamps are fine: requests arrive together
    (_line(input_length=0, hash_ids=()), "input_length must be a positive integer"),
    (_line(output_length=True), "output_length must be a positive integer"),
    (_line(hash_ids=(0, -3)), "hash_ids must be a list of non-negative integers"),
    (_line(input_length=1025, hash_ids=(0, 1)), r"ceil\(1025/512\) = 3 hash ids.*got 2"),
    (_line(input_length=1024, hash_ids=(0, 1, 2)), r"= 2 hash ids.*got 3"),
])
def test_malformed_lines_name_the_line_and_the_problem(bad, message):
    lines = [_line(timestamp=0), bad]
    if message is None:
        assert len(parse_mooncake_lines(lines)) == 2
        return
    with pytest.raises(ValueError, match=message) as info:
        parse_mooncake_lines(lines, "trace.jsonl")
    assert "trace.jsonl:2" in str(info.value), "the error must say which line is wrong"


def test_unsorted_arrivals_are_refused():
    with pytest.raises(ValueError, match=r":2: arrivals must be sorted"):
        parse_mooncake_lines([_line(timestamp=2000), _line(timestamp=1000)])


def test_synthesized_prompts_are_deterministic_bounded_and_as_long_as_the_input():
    request = _req(0, (5, 9, 2), 1100)
    a, b = PromptSynthesizer(1000, seed=3), PromptSynthesizer(1000, seed=3)
    tokens = a.prompt_token_ids(request)
    assert tokens.shape == (1100,) and tokens.dtype == np.int64
    assert np.array_equal(tokens, b.prompt_token_ids(request)), "same vocab and seed, same tokens"
    assert tokens.min() >= 0 and tokens.max() < 1000
    assert len(set(tokens.tolist())) > 500, "tokens should look varied, not a constant run"
    assert not np.array_equal(tokens, PromptSynthesizer(1000, seed=4).prompt_token_ids(request))
    # A last partial block is the start of that id's full block.
    assert np.array_equal(tokens[1024:], a.block_token_ids([2])[0, :76])
    with pytest.raises(ValueError, match="vocab_size must be an integer >= 2"):
        PromptSynthesizer(1)
    with pytest.raises(ValueError, match=r"hash ids must lie in \[0, 99\]"):
        PromptSynthesizer(10, max_hash_id=99).block_token_ids([100])


@pytest.mark.parametrize("block_size", [16, 512])
def test_shared_hash_prefix_iff_shared_token_blocks(block_size):
    # A tree of prefixes: 0 -> 1 -> {2, 3}, 0 -> 4, and 5 alone. Ids 3 and 13 agree in their first digit at
    # vocab_size 10, so only the second token of the block tells them apart.
    requests = [_req(0, (0, 1, 2), 1536), _req(1, (0, 1, 3), 1300), _req(2, (0, 4), 1024),
                _req(3, (5, 13), 1024), _req(4, (5, 3), 1024), _req(5, (0, 1, 2), 1100)]
    synthesizer = PromptSynthesizer(vocab_size=10, max_hash_id=99)
    assert synthesizer.id_digits == 2
    hashes = [block_hashes(synthesizer.prompt_token_ids(r).tolist(), block_size) for r in requests]
    for (i, a), (j, b) in itertools.combinations(enumerate(requests), 2):
        common_ids = _shared_blocks(a.hash_ids, b.hash_ids)
        # The same id means the same tokens, partial blocks included; full kvlab blocks only are hashed.
        common_tokens = min(512 * common_ids, a.input_length, b.input_length)
        expected = min(common_tokens // block_size, len(hashes[i]), len(hashes[j]))
        assert _shared_blocks(hashes[i], hashes[j]) == expected, (
            f"requests {a.hash_ids} and {b.hash_ids} share {common_ids} hash ids: at block size {block_size} "
            f"they must share exactly {expected} kvlab blocks")


def test_block_keys_name_the_prefix_up_to_each_block_end():
    request = _req(0, (7, 8), 600)
    assert block_keys(request, 512) == [7 * 512 + 511]
    assert block_keys(request, 200) == [7 * 512 + 199, 7 * 512 + 399, 8 * 512 + 87]


def test_hit_rate_on_a_hand_made_trace_with_lru_eviction():
    # Four one-id prompts of 600 tokens (a full 512 block and a partial one), block size 512.
    trace = [_req(0, (0,), 600), _req(1, (1,), 600), _req(2, (0,), 600), _req(3, (0,), 600)]
    # Two blocks: request 1 takes both, evicting id 0's block; request 2 then misses and evicts id 1's,
    # so only request 3 hits (its one full block).
    small = prefix_cache_hits(trace, 1024, block_size=512)
    assert (small.hit_tokens, small.prompt_tokens, small.evictions) == (512, 2400, 2)
    assert small.hit_rate == pytest.approx(512 / 2400)
    # Three blocks: request 1 takes the free block and the partial one, id 0's cached block survives.
    large = prefix_cache_hits(trace, 1536, block_size=512)
    assert (large.hit_tokens, large.evictions) == (1024, 0)
    assert infinite_cache_hits(trace, 512).hit_tokens == 1024
    # The last prompt token is always computed: a prompt of exactly one cached block hits nothing.
    exact = [_req(0, (0,), 512), _req(1, (0,), 512), _req(2, (0, 1), 1024)]
    assert prefix_cache_hits(exact, 2048, 512).hit_tokens == 512 == infinite_cache_hits(exact, 512).hit_tokens
    with pytest.raises(ValueError, match="cannot hold the longest prompt"):
        prefix_cache_hits(trace, 600, block_size=512)


@pytest.mark.parametrize("block_size, capacity", [(16, 9_000), (512, 9_216), (48, 9_600)])
def test_block_key_replay_equals_kv_cache_manager_on_synthesized_tokens(block_size, capacity):
    # Short prompts from the real trace (they share its common first block), replayed through a small cache.
    head = [r for r in load_mooncake_trace(limit=200) if r.input_length <= 4000][:15]
    synthesizer = PromptSynthesizer(vocab_size=32000, max_hash_id=10**6)
    fast = prefix_cache_hits(head, capacity, block_size)
    assert fast.evictions > 0, "the capacity is meant to force evictions"
    assert fast.hit_tokens > 0, "the slice shares prefixes"
    assert prefix_cache_hits_from_tokens(head, capacity, block_size, synthesizer) == fast
    unbounded = prefix_cache_hits(head, 10**6, block_size)
    assert unbounded.evictions == 0 and unbounded.hit_tokens == infinite_cache_hits(head, block_size).hit_tokens
