"""Chapter 3's block-size sweep, cost side: counted lookups, shuffled pools that decode correctly, and the timer."""

import pytest
import torch

from kvlab.benchmarks.block_size import DECODE_PATHS, block_table_reads, decode_step, shuffled_batch, time_decode_paths
from kvlab.cache.attention import causal_attention
from kvlab.cache.paged_cache import gather_kv


@pytest.mark.parametrize("context_len, block_size, expected", [(1024, 1, 1024), (1024, 16, 64), (1000, 16, 63),
                                                               (1, 128, 1), (129, 128, 2), (17, 4, 5)])
def test_block_table_reads_are_context_over_block_size_rounded_up(context_len, block_size, expected):
    assert block_table_reads(context_len, block_size) == expected


def test_shuffled_batch_uses_every_block_once_and_not_in_order():
    batch = shuffled_batch(num_seqs=3, context_len=10, block_size=4, num_heads=2, num_kv_heads=1, head_dim=8)
    blocks = [b for table in batch.block_tables for b in table]
    assert sorted(blocks) == list(range(9)) and blocks != sorted(blocks)
    assert all(len(table) == 3 for table in batch.block_tables)
    assert batch.storage.k_pools[0].shape == (9, 4, 1, 8) and batch.queries.shape == (3, 2, 8)
    layout = batch.layout()
    assert layout.query_lens == [1, 1, 1] and layout.context_lens == [10, 10, 10]
    table = batch.block_tables[1]
    assert layout.slot_mapping[1].item() == table[2] * 4 + 1  # position 9: block 2, offset 1


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_every_path_decodes_like_attention_over_the_contiguous_sequence(block_size):
    batch = shuffled_batch(num_seqs=3, context_len=13, block_size=block_size, num_heads=4, num_kv_heads=2,
                           head_dim=8, seed=block_size)
    k_pool, v_pool = batch.storage.k_pools[0], batch.storage.v_pools[0]
    scaling = 8 ** -0.5
    want = torch.stack([causal_attention(q[:, None], gather_kv(k_pool, t, 13), gather_kv(v_pool, t, 13), scaling)[0]
                        for q, t in zip(batch.queries, batch.block_tables)])
    torch.testing.assert_close(decode_step(batch, "reference"), want)
    torch.testing.assert_close(decode_step(batch, "torch"), want)
    gathered = decode_step(batch, "gather")
    assert len(gathered) == 3 and gathered[0][0].shape == (2, 13, 8)
    with pytest.raises(ValueError, match="path must be one of"):
        decode_step(batch, "triton")


def test_time_decode_paths_reports_a_median_per_path_and_block_size_and_restores_threads():
    threads = torch.get_num_threads()
    times = time_decode_paths(block_sizes=(1, 16), num_seqs=2, context_len=64, num_heads=2, num_kv_heads=1,
                              head_dim=8, repeats=2, threads=1)
    assert set(times) == set(DECODE_PATHS)
    assert all(set(per_size) == {1, 16} and all(t > 0 for t in per_size.values()) for per_size in times.values())
    assert torch.get_num_threads() == threads
    with pytest.raises(ValueError, match="paths must be among"):
        time_decode_paths(paths=("fast",))
