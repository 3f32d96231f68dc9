"""The disk tier's mover: one safetensors file per block, named by the block hash, checked on every load.

A file holds one block's K and V for every layer, the host pool's block layout (kvlab.kv_offload.worker):

    <directory>/<block hash in hex>.safetensors
        tensor "kv": [num_layers, 2, block_size, num_kv_heads, head_dim]
        metadata:    sha256 (of the tensor's bytes), shape, dtype, block_hash (hex)

Why each part:

* the hash names the file, so a block's copy is found without an index and survives a restart;
* the checksum catches a torn or bit-rotted file: serving wrong K/V silently corrupts generations, while a
  missing block only costs a recompute;
* writes go to a temporary file in the same directory, are flushed to disk, then os.replace'd onto the final
  name: a reader sees the old file or the whole new one, never half of one (a crash leaves only a
  temporary file, whose name never matches a block).

load raises DiskBlockError (MissingBlockError or CorruptBlockError) when the copy is unusable; the caller
treats it as a miss and recomputes the block. The bookkeeping for this tier is torch-free: a
kvlab.kv_offload.Backend named DISK_MEDIUM (kvlab.kv_offload.mediums) with as many ids as the disk budget
holds blocks (kvlab.kv_offload.cpu.num_blocks_for_budget does that arithmetic for any medium).
"""

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Hashable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

SUFFIX = ".safetensors"
TENSOR_NAME = "kv"


class DiskBlockError(Exception):
    """A block's file cannot be used: recompute the block."""


class MissingBlockError(DiskBlockError):
    """No file for this block hash (never written, deleted, or its write never finished)."""


class CorruptBlockError(DiskBlockError):
    """The file exists but is not a valid copy: unreadable, or its bytes do not match the checksum it carries."""


def block_hash_hex(block_hash: Hashable) -> str:
    """The file-name form of a block hash: bytes (sha256 hashes) as hex, a 64-bit int (the "builtin" hash) as 16 hex."""
    if isinstance(block_hash, (bytes, bytearray)):
        if not block_hash:
            raise ValueError("block_hash is empty bytes: it cannot name a file")
        return bytes(block_hash).hex()
    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
        try:
            return block_hash.to_bytes(8, "big", signed=True).hex()
        except OverflowError:
            raise ValueError(f"block_hash {block_hash} does not fit in 64 bits") from None
    raise ValueError(f"block_hash must be bytes or an int to name a file, got {type(block_hash).__name__}")


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's raw bytes (any dtype, bfloat16 included), as hex."""
    raw = tensor.detach().contiguous().cpu().view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def _read_metadata(data: bytes) -> dict:
    """The __metadata__ of a safetensors file: 8 bytes of little-endian header length, then a JSON header."""
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len].decode("utf-8"))
    return header["__metadata__"]


# A block file's header is a few hundred bytes; anything far larger is not one of ours.
_MAX_HEADER_BYTES = 1 << 16


def read_block_metadata(path: str | os.PathLike) -> dict | None:
    """The metadata a block file carries, reading only its header; None if the file is not a readable block file."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return None
            (header_len,) = struct.unpack("<Q", head)
            if header_len > _MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(header_len).decode("utf-8"))
        metadata = header["__metadata__"]
        return {"sha256": metadata["sha256"], "shape": json.loads(metadata["shape"]), "dtype": metadata["dtype"],
                "block_hash": metadata["block_hash"]}
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


class DiskBlockStore:
    """Block files under one directory: save, load (verified), contains, remove; by block hash."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def path_for(self, block_hash: Hashable) -> Path:
        """The file that holds this block's copy."""
        return self.directory / f"{block_hash_hex(block_hash)}{SUFFIX}"

    def contains(self, block_hash: Hashable) -> bool:
        """Whether a (complete, not necessarily valid) file exists for this block."""
        return self.path_for(block_hash).is_file()

    def save(self, block_hash: Hashable, block: torch.Tensor) -> Path:
        """Write block [num_layers, 2, block_size, num_kv_heads, head_dim] atomically; returns its path."""
        if not isinstance(block, torch.Tensor):
            raise ValueError(f"block must be a tensor, got {type(block).__name__}")
        if block.dim() != 5 or block.shape[1] != 2:
            raise ValueError("block must be [num_layers, 2, block_size, num_kv_heads, head_dim], "
                             f"got {tuple(block.shape)}")
        path = self.path_for(block_hash)
        block = block.detach().contiguous().cpu()
        metadata = {"sha256": tensor_sha256(block), "shape": json.dumps(list(block.shape)),
                    "dtype": str(block.dtype), "block_hash": block_hash_hex(block_hash)}
        payload = st_save({TENSOR_NAME: block}, metadata=metadata)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def load(self, block_hash: Hashable) -> torch.Tensor:
        """The verified block [num_layers, 2, block_size, num_kv_heads, head_dim]; DiskBlockError if unusable."""
        path = self.path_for(block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise MissingBlockError(f"no file for block {block_hash_hex(block_hash)} in {self.directory}") from None
        try:
            metadata = _read_metadata(data)
            block = st_load(data)[TENSOR_NAME]
            expected = (metadata["sha256"], json.loads(metadata["shape"]), metadata["dtype"],
                        metadata["block_hash"])
        except Exception as e:  # any parse failure means the bytes on disk are not what was written
            raise CorruptBlockError(f"{path.name} cannot be read as a block file: {type(e).__name__}: {e}") from e
        actual = (tensor_sha256(block), list(block.shape), str(block.dtype), block_hash_hex(block_hash))
        names = ("sha256", "shape", "dtype", "block_hash")
        for name, want, got in zip(names, expected, actual):
            if want != got:
                raise CorruptBlockError(f"{path.name}: {name} recorded as {want} but the file holds {got}")
        return block

    def remove(self, block_hash: Hashable) -> None:
        """Delete this block's file (an eviction from the disk tier); nothing if there is none."""
        self.path_for(block_hash).unlink(missing_ok=True)

    def index(self, shape: Sequence[int], dtype: str) -> list[tuple[bytes, float]]:
        """(block hash, modification time) of every block file here whose header records this block shape and dtype
        (str(torch.dtype)), oldest first; files of other layouts, temporary files and unreadable ones are skipped.

        Only the headers are read: a file's checksum is verified when it is loaded.
        """
        found = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            stem = path.name[:-len(SUFFIX)]
            if stem.startswith("."):
                continue
            metadata = read_block_metadata(path)
            if metadata is None or metadata["block_hash"] != stem or metadata["shape"] != list(shape) \
                    or metadata["dtype"] != dtype:
                continue
            try:
                block_hash, mtime = bytes.fromhex(stem), path.stat().st_mtime
            except (ValueError, OSError):  # not a hex name, or removed while listing
                continue
            found.append((block_hash, mtime))
        found.sort(key=lambda item: item[1])
        return found

    def save_blocks(self, pool: torch.Tensor, block_ids: Sequence[int], block_hashes: Sequence[Hashable]) -> None:
        """Write pool[block_ids[i]] under block_hashes[i], for a block-major pool (a host pool)."""
        if len(block_ids) != len(block_hashes):
            raise ValueError(f"{len(block_ids)} block ids but {len(block_hashes)} block hashes")
        for block_id, block_hash in zip(block_ids, block_hashes):
            self.save(block_hash, pool[block_id])

    def load_blocks(self, pool: torch.Tensor, block_ids: Sequence[int],
                    block_hashes: Sequence[Hashable]) -> list[Hashable]:
        """Read block_hashes[i] into pool[block_ids[i]]; returns the hashes that failed (left untouched in pool)."""
        if len(block_ids) != len(block_hashes):
            raise ValueError(f"{len(block_ids)} block ids but {len(block_hashes)} block hashes")
        failed = []
        for block_id, block_hash in zip(block_ids, block_hashes):
            try:
                block = self.load(block_hash)
            except DiskBlockError:
                failed.append(block_hash)
                continue
            if block.shape != pool.shape[1:] or block.dtype != pool.dtype:
                raise ValueError(f"block {block_hash_hex(block_hash)} is {tuple(block.shape)} {block.dtype} but the "
                                 f"pool holds {tuple(pool.shape[1:])} {pool.dtype}")
            pool[block_id] = block.to(pool.device)
        return failed
