"""The disk tier: one checksummed safetensors file per block, bit-identical back, and every damage caught."""

import hashlib
import os

import pytest
import torch

from kvlab.kv_offload import DISK_MEDIUM, ARCOffloadingManager, Backend
from kvlab.kv_offload.disk import (
    CorruptBlockError,
    DiskBlockError,
    DiskBlockStore,
    MissingBlockError,
    block_hash_hex,
)
from kvlab.kv_offload.worker import make_host_pool

BLOCK_SHAPE = (2, 2, 4, 2, 8)  # [num_layers, 2, block_size, num_kv_heads, head_dim]


def random_block(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        return torch.randint(-128, 128, BLOCK_SHAPE, generator=g, dtype=torch.int8)
    return torch.randn(BLOCK_SHAPE, generator=g).to(dtype)


def sha(i: int) -> bytes:
    """A block hash as an engine makes them: 32 bytes of sha256."""
    return hashlib.sha256(str(i).encode()).digest()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_round_trip_is_bit_identical(tmp_path, dtype):
    store = DiskBlockStore(tmp_path)
    block = random_block(dtype)
    path = store.save(sha(1), block)
    assert path == tmp_path / f"{sha(1).hex()}.safetensors", "the file is named by the block hash in hex"
    loaded = store.load(sha(1))
    assert loaded.dtype == dtype and loaded.shape == block.shape
    assert torch.equal(loaded.view(torch.uint8), block.view(torch.uint8)), "every byte must come back"


def test_hash_names_for_both_hash_functions():
    """sha256 bytes become 64 hex digits; Python's 64-bit hash() (negative too) becomes 16."""
    assert block_hash_hex(sha(0)) == sha(0).hex() and len(block_hash_hex(sha(0))) == 64
    assert block_hash_hex(-1) == "ff" * 8 and block_hash_hex(255) == "00000000000000ff"
    for bad, message in ((2**70, "64 bits"), ("abc", "bytes or an int"), (b"", "empty"), (True, "bytes or an int")):
        with pytest.raises(ValueError, match=message):
            block_hash_hex(bad)


def test_every_flipped_byte_is_detected(tmp_path):
    """Flip each byte of a block file in turn: header or data, load must refuse it, never return wrong K/V."""
    store = DiskBlockStore(tmp_path)
    block = random_block(torch.bfloat16)
    path = store.save(sha(2), block)
    good = path.read_bytes()
    for i in range(len(good)):
        damaged = bytearray(good)
        damaged[i] ^= 0xFF
        path.write_bytes(bytes(damaged))
        with pytest.raises(CorruptBlockError):
            store.load(sha(2))
    path.write_bytes(good)
    assert torch.equal(store.load(sha(2)), block)


def test_a_flipped_data_byte_is_a_checksum_mismatch(tmp_path):
    store = DiskBlockStore(tmp_path)
    path = store.save(sha(3), random_block(torch.float32))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the tensor's bytes end the file
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBlockError, match="sha256 recorded as"):
        store.load(sha(3))


def test_a_file_under_another_blocks_name_is_corrupt(tmp_path):
    """A file copied or renamed onto another hash's name carries the wrong block_hash: refused."""
    store = DiskBlockStore(tmp_path)
    src = store.save(sha(4), random_block(torch.float32))
    os.replace(src, store.path_for(sha(5)))
    with pytest.raises(CorruptBlockError, match="block_hash"):
        store.load(sha(5))


def test_deleted_or_truncated_files_are_reported(tmp_path):
    store = DiskBlockStore(tmp_path)
    path = store.save(sha(6), random_block(torch.float32))
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CorruptBlockError):
        store.load(sha(6))
    path.unlink()
    with pytest.raises(MissingBlockError, match=sha(6).hex()):
        store.load(sha(6))
    assert issubclass(MissingBlockError, DiskBlockError) and issubclass(CorruptBlockError, DiskBlockError), \
        "a caller catches DiskBlockError alone and recomputes"


def test_a_crashed_write_is_never_visible(tmp_path, monkeypatch):
    """The write goes to a temporary file; if the rename never happens, no block file (old or new) is half-written."""
    store = DiskBlockStore(tmp_path)
    old = random_block(torch.float32, seed=0)
    store.save(sha(7), old)

    def crash(src, dst):
        assert os.path.getsize(src) > 0 and os.path.dirname(src) == str(tmp_path), \
            "the payload is written in full to a temporary file in the same directory before the rename"
        raise OSError("power lost before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power lost"):
        store.save(sha(7), random_block(torch.float32, seed=1))
    with pytest.raises(OSError, match="power lost"):
        store.save(sha(8), random_block(torch.float32, seed=2))
    monkeypatch.undo()
    assert torch.equal(store.load(sha(7)), old), "the old copy survives a crashed overwrite"
    assert not store.contains(sha(8))
    with pytest.raises(MissingBlockError):
        store.load(sha(8))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{sha(7).hex()}.safetensors"], \
        "the failed writes cleaned up their temporary files"


def test_a_leftover_temporary_file_is_not_a_block(tmp_path):
    """A temporary file left by a killed process (no cleanup ran) never answers for its block."""
    store = DiskBlockStore(tmp_path)
    name = store.path_for(sha(9)).name
    (tmp_path / f".{name}.abc123.tmp").write_bytes(b"half a file")
    assert not store.contains(sha(9))
    with pytest.raises(MissingBlockError):
        store.load(sha(9))


def test_save_refuses_a_tensor_of_the_wrong_shape(tmp_path):
    with pytest.raises(ValueError, match="num_layers, 2, block_size"):
        DiskBlockStore(tmp_path).save(sha(0), torch.zeros(2, 3, 4, 2, 8))


def test_disk_tier_with_a_manager_evicts_files_and_recomputes_damaged_ones(tmp_path):
    """A full disk tier evicts (and deletes files), and a damaged file becomes a miss for the caller."""
    manager = ARCOffloadingManager(Backend(DISK_MEDIUM, 4, 3))
    store = DiskBlockStore(tmp_path)
    host = make_host_pool(6, 2, 4, 2, 8, torch.float32)
    host.copy_(torch.randn(host.shape, generator=torch.Generator().manual_seed(0)))
    hashes = [sha(i) for i in range(6)]
    for i, h in enumerate(hashes):
        out = manager.prepare_store([h])
        assert out is not None, "a full tier must evict, not refuse"
        for gone in out.block_hashes_evicted:
            store.remove(gone)
        store.save_blocks(host, [i], list(out.store_spec.block_hashes))
        manager.complete_store([h])
        assert len(list(tmp_path.iterdir())) <= 3, "never more files than the tier has blocks"
    assert manager.lookup(hashes[3:]) == 3 and manager.lookup(hashes[:1]) == 0
    victim = store.path_for(hashes[4])
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x10
    victim.write_bytes(bytes(data))
    spec = manager.prepare_load(hashes[3:])
    back = torch.zeros_like(host)
    failed = store.load_blocks(back, [0, 1, 2], list(spec.block_hashes))
    manager.complete_load(hashes[3:])
    assert failed == [hashes[4]], "the damaged block is reported so the engine recomputes it"
    assert torch.equal(back[0], host[3]) and torch.equal(back[2], host[5]) and not back[1].any()


def test_index_finds_this_layouts_blocks_oldest_first(tmp_path):
    store = DiskBlockStore(tmp_path)
    for i in range(3):
        store.save(sha(i), random_block(torch.float32, i))
        os.utime(store.path_for(sha(i)), (1000 + i, 1000 + i))
    store.save(sha(9), random_block(torch.float32, 9)[:1])            # another number of layers
    store.save(sha(8), random_block(torch.bfloat16, 8))               # another dtype
    (tmp_path / f"{sha(7).hex()}.safetensors").write_bytes(b"junk")   # not a block file
    store.path_for(sha(2)).rename(store.path_for(sha(6)))             # a file under another block's name
    found = store.index(BLOCK_SHAPE, str(torch.float32))
    assert [h for h, _ in found] == [sha(0), sha(1)], f"only whole files of this layout, oldest first, got {found}"
