"""Chapter 4's block hashes: a full block is named by its parent's hash, its token ids and optional extra keys.

Because each hash folds in the parent's, equal hashes mean equal whole prefixes, not only equal
blocks: "to be or" after "ROMEO:" and after "JULIET:" get different hashes, since the K/V of a token
depend on every token before it. Extra keys (a LoRA adapter's name, an image's id) separate
requests whose token ids agree but whose K/V do not.

The hash is SHA-256 over a pickle of (parent hash, token ids, extra keys), kept as 32 bytes. Python's
built-in hash() would be faster but is only 64 bits (a collision would silently serve another
prompt's K/V) and salts strings differently in every process (PYTHONHASHSEED), so two processes could
not agree on a block's name.
"""

import hashlib
import pickle
from collections.abc import Hashable, Sequence

BlockHash = bytes


def hash_block_tokens(parent_block_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: Hashable | None = None) -> BlockHash:
    """The hash of one full block given its parent's hash (None for the first block)."""
    key = (parent_block_hash, tuple(int(t) for t in token_ids), extra_keys)
    return hashlib.sha256(pickle.dumps(key, protocol=5)).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: Hashable | None = None) -> list[BlockHash]:
    """Hashes of every full block of a sequence, first block first; a partly filled last block gets none."""
    hashes: list[BlockHash] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
